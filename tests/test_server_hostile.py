"""`edgeprefill serve` against a hostile local program: bodies built to be costly to parse,
idle and half-sent connections, a SIGTERM while one is open, web pages of other origins,
and another user reading the results. Each case runs against the real command over a real
loopback socket, and is followed by an ordinary chat that must be answered."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("uvicorn")

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


class Served:
    def __init__(self, proc: subprocess.Popen[str], port: int, results: Path) -> None:
        self.proc, self.port, self.results = proc, port, results
        self.base = f"http://127.0.0.1:{port}"

    def client(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers=AUTH, timeout=timeout)

    def chat_answered(self) -> None:
        """An ordinary chat, as any client sends it, is still answered."""
        r = self.client().post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1

    def raw(self, head: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        sock.sendall(head)
        return sock


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(tmp_path: Path, *extra: str) -> Iterator[Served]:
    """`edgeprefill serve` on the bundled model, as a user starts it (key from the
    environment), with results in tmp_path/results; stopped with SIGKILL if still up."""
    results, port = tmp_path / "results", _free_port()
    command = [sys.executable, "-m", "edgeprefill.runtime.cli.main", "serve", "--port", str(port)]
    command += ["--policy", "static:64", "--calibration", "none", "--n-ctx", "4096"]
    command += ["--n-seq-max", "4", "--results", str(results), *extra]
    env = {**os.environ, "EDGEPREFILL_API_KEY": KEY}
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    served = Served(proc, port, results)
    try:
        deadline = time.monotonic() + 300
        while not _healthy(served.base):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


class PeakRss:
    """The largest resident size of a process while the block runs, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.process, self.peak = psutil.Process(pid), 0
        self.start = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _token_gaps_while(served: Served, action) -> tuple[list[float], object]:
    """A chat streams while `action` runs: the gaps between its chunks, and what `action`
    returned."""
    gaps: list[float] = []
    body = {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    started = threading.Event()

    def stream() -> None:
        with served.client().stream("POST", "/v1/chat/completions", json=body) as r:
            last = None
            for line in r.iter_lines():
                now = time.monotonic()
                if last is not None and line:
                    gaps.append(now - last)
                if line:
                    last = now
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    result = action()
    thread.join(120)
    return gaps, result


# Bodies under the 8 MiB limit built to be costly: a bad item per value (one error each
# in pydantic, one dict each in FastAPI), valid items past any bound, empty containers.
COSTLY = {
    "negative ids": b"-1",
    "valid ids, too many": b"1",
    "empty lists": b"[]",
    "short strings": b'"a"',
    "commas in strings": b'",,,,,,,,"',
}


@pytest.mark.parametrize("item", COSTLY.values(), ids=COSTLY.keys())
def test_a_costly_8mb_body_is_refused_quickly_in_bounded_memory(tmp_path, item):
    with serve(tmp_path) as served:
        n = (8 << 20) // (len(item) + 1) - 64
        body = b'{"prompt": [' + (item + b",") * n + item + b"]}"
        assert len(body) < 8 << 20
        served.chat_answered()  # the first chat's allocations are not the body's

        def send() -> tuple[httpx.Response, float]:
            started = time.monotonic()
            r = httpx.post(
                f"{served.base}/v1/completions",
                content=body,
                headers={**AUTH, "Content-Type": "application/json"},
                timeout=60,
            )
            return r, time.monotonic() - started

        with PeakRss(served.proc.pid) as rss:
            gaps, (r, took) = _token_gaps_while(served, send)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert len(r.content) < 2000 and error["message"], error  # one error, not millions
        # Bounds against the failure (24 s of a stalled event loop), not the targets (2 s to
        # answer, 300 ms gaps), which benchmarks/hostile_bodies.py measures on a quiet machine.
        assert took < 10.0, took
        assert max(gaps) < 2.0, max(gaps)
        assert rss.peak - rss.start < 200 << 20, (rss.peak - rss.start) >> 20
        served.chat_answered()


def test_idle_sockets_take_no_request_slot_and_are_closed_at_their_deadline(tmp_path):
    with serve(tmp_path, "--max-connections", "8") as served:
        idle = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(300)]
        try:
            assert httpx.get(f"{served.base}/health", timeout=10).status_code == 200
            served.chat_answered()
            for sock in idle[:5]:  # closed by the server within the headers' deadline
                sock.settimeout(20)
                assert sock.recv(1) == b""
        finally:
            for sock in idle:
                sock.close()
        served.chat_answered()


def test_a_half_sent_body_neither_holds_sigterm_nor_loses_the_results(tmp_path):
    """SIGTERM with a body still coming and a document queued: the process exits within
    its shutdown timeout, the document cancelled (nobody could fetch its answer), and the
    results written."""
    with serve(tmp_path) as served:
        served.chat_answered()
        doc = {"text": "Rivers run to the sea. " * 500, "max_tokens": 64}
        assert served.client().post("/v1/documents", json=doc).status_code == 202
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {KEY}\r\n".encode()
            + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        sock = served.raw(head)
        try:
            time.sleep(0.5)
            served.proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            served.proc.wait(30)
            assert time.monotonic() - started < 15
        finally:
            sock.close()
        assert served.proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM)
        summary = json.loads((served.results / "summary.json").read_text())
        assert summary["accounting"]["submitted"] == 2 and summary["accounting"]["reconciled"]
        lines = (served.results / "requests.jsonl").read_text().splitlines()
        errors = {r["class"]: r["error"] for r in map(json.loads, lines)}
        assert errors == {"foreground": None, "background": "cancelled"}, errors


def test_results_are_private_name_no_document_id_and_survive_a_restart(tmp_path):
    old = os.umask(0o022)
    try:
        with serve(tmp_path) as served:
            h = served.client()
            doc = h.post(
                "/v1/documents", json={"text": "The meeting moved to room 4.", "max_tokens": 4}
            )
            doc_id = doc.json()["id"]
            while h.get(f"/v1/documents/{doc_id}").json()["status"] != "finished":
                time.sleep(0.1)
            served.chat_answered()
            served.proc.send_signal(signal.SIGTERM)
            served.proc.wait(60)
        with serve(tmp_path) as served:
            served.chat_answered()
    finally:
        os.umask(old)
    folder = tmp_path / "results"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    names = {f.name for f in folder.iterdir()}
    assert {"requests.jsonl", "requests.jsonl.1", "summary.json.1"} <= names, names
    for f in folder.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    earlier = (folder / "requests.jsonl.1").read_text()
    assert len(earlier.splitlines()) == 2 and doc_id not in earlier


def test_a_result_file_planted_as_a_link_is_not_followed(tmp_path):
    folder, target = tmp_path / "results", tmp_path / "elsewhere"
    folder.mkdir()
    target.write_text("kept\n")
    (folder / "iterations.jsonl").symlink_to(target)
    with serve(tmp_path) as served:
        served.chat_answered()
    assert target.read_text() == "kept\n"  # the link was set aside, not written through
    assert (folder / "iterations.jsonl.1").is_symlink()


def test_foreign_origins_empty_stops_and_untyped_bodies_are_refused(tmp_path):
    with serve(tmp_path) as served:
        h = served.client()
        page = {"Origin": "https://evil.example"}
        r = h.post("/v1/chat/completions", json=CHAT, headers=page)
        assert r.status_code == 403 and "evil.example" in r.json()["error"]["message"]
        own = {"Origin": f"http://127.0.0.1:{served.port}"}
        assert h.post("/v1/chat/completions", json=CHAT, headers=own).status_code == 200
        r = h.post("/v1/chat/completions", json={**CHAT, "stop": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
        # A page's no-preflight request: no JSON Content-Type.
        for kind in (None, "text/plain"):
            headers = {} if kind is None else {"Content-Type": kind}
            r = h.post("/v1/chat/completions", content=json.dumps(CHAT), headers=headers)
            assert r.status_code == 415, (kind, r.text)
        served.chat_answered()


def test_text_past_the_context_is_refused_before_it_is_tokenized(tmp_path):
    """7 MB of text cannot fit 4,096 tokens: refused from its length, at once."""
    with serve(tmp_path) as served:
        h = served.client()
        text = "Snow on the pass. " * 400_000
        for path, body in [
            ("/v1/documents", {"text": text}),
            ("/v1/completions", {"prompt": text}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ]:
            started = time.monotonic()
            r = h.post(path, json=body)
            assert r.status_code == 400 and "split it" in r.json()["error"]["message"], r.text
            assert time.monotonic() - started < 10.0, path  # not tokenized (seconds of a core)
        served.chat_answered()
