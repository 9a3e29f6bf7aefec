"""An hour of mixed traffic against `edgeprefill serve` on the real model, over loopback:
does the server lose a request, hold KV cells, or grow?

    .venv/bin/python benchmarks/server_soak.py [--minutes 60] [--users 3] [--out results/server-soak]

The server runs as users run it (`edgeprefill serve`, the default policy, `--results`, a
key from the environment). Beside it, on loopback only: chat users (streamed and whole
answers, a tenth dropped mid-stream), an indexer (documents posted, polled, asked about
by `document_id`, some deleted while read), and a hostile client (bodies that are not JSON,
non-finite and huge numbers, lone surrogates, a wrong key, another Host, an oversized body,
a stream dropped before its first chunk). Every loop is bounded by the clock and every
request by a timeout.

Reports (OUT/soak.json and the console): requests the server took (answered 200 or 202)
against those in its requests.jsonl, which must be equal, and its summary reconciled; KV
cells reserved once idle (/metrics, must be 0); the refusals by status; the server's RSS
every 10 s, flat after warm-up (within 5% of its median, trend over the span under 5%,
`soak.rss_verdict`); chats' P99 inter-token gap, as the client saw it, per 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
from soak import p99_itl_by_window, rss_verdict

KEY = "soak-key"
TOPICS = ["the sea", "a mountain", "bread", "rain", "a library", "trains", "winter", "bees"]
WORDS = "river stone cloud letter garden window candle harbour meadow lantern".split()


class Ledger:
    """What the server took and refused (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.taken = 0  # answered 200/202: the server submitted it
        self.status: Counter[str] = Counter()
        self.tokens: list[tuple[float, list[float]]] = []  # chats: (first token, times)

    def saw(self, r_status: int, taken: bool, label: str = "") -> None:
        with self.lock:
            self.taken += taken
            self.status[f"{label}{r_status}"] += 1


def chat_user(base: str, ledger: Ledger, rng: random.Random, stop: float, t0: float) -> None:
    h = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    while time.monotonic() < stop:
        messages = [{"role": "user", "content": f"Tell me one fact about {rng.choice(TOPICS)}."}]
        body = {"messages": messages, "max_tokens": rng.randint(16, 48), "temperature": 0.7}
        if rng.random() < 0.3:
            r = h.post("/v1/chat/completions", json=body)
            ledger.saw(r.status_code, r.status_code == 200)
        else:
            drop = rng.random() < 0.1
            times = []
            with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                ledger.saw(r.status_code, r.status_code == 200)
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                        times.append(time.monotonic() - t0)
                        if drop and len(times) >= 3:
                            break  # the person closes the window mid-answer
            if not drop and len(times) > 1:
                with ledger.lock:
                    ledger.tokens.append((times[0], times))
        time.sleep(rng.expovariate(1 / 3.0))


def indexer(base: str, ledger: Ledger, rng: random.Random, stop: float) -> None:
    h = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    read: list[str] = []
    while time.monotonic() < stop:
        if read and rng.random() < 0.3:  # a question about a document read earlier
            doc = rng.choice(read)
            r = h.post(
                "/v1/completions",
                json={"prompt": "What is it about?", "document_id": doc, "max_tokens": 24},
            )
            ledger.saw(r.status_code, r.status_code == 200, "ask ")
            if r.status_code == 404:  # forgotten (--documents-kept): the oldest go first
                read.remove(doc)
        else:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(800, 2500)))
            r = h.post("/v1/documents", json={"text": text, "max_tokens": rng.randint(8, 32)})
            ledger.saw(r.status_code, r.status_code == 202, "doc ")
            if r.status_code == 202:
                doc = r.json()["id"]
                if rng.random() < 0.15:  # the user closes the folder while it is read
                    time.sleep(rng.uniform(0, 4))
                    h.delete(f"/v1/documents/{doc}")
                else:
                    deadline = time.monotonic() + 300
                    while time.monotonic() < deadline:
                        state = h.get(f"/v1/documents/{doc}").json()
                        if state["status"] in ("finished", "failed"):
                            break
                        time.sleep(1)
                    read = (read + [doc])[-20:]
        time.sleep(rng.uniform(0, 2))


BAD = [
    b'{"messages": [',
    b'{"messages": [{"role": "user", "content": "Hi"}], "ttft_target_ms": 1e400}',
    b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": null}]}]}',
    b'{"messages": [{"role": "user", "content": "Hi"}], "seed": 100000000000000000000000}',
    b'{"prompt": [1, 2, 99999999999]}',
]


def hostile(base: str, port: int, ledger: Ledger, rng: random.Random, stop: float) -> None:
    key = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    h = httpx.Client(base_url=base, timeout=60)
    while time.monotonic() < stop:
        kind = rng.randrange(5)
        if kind == 0:
            r = h.post("/v1/chat/completions", content=rng.choice(BAD), headers=key)
        elif kind == 1:
            r = h.post(
                "/v1/chat/completions", json={"messages": []}, headers={"Authorization": "x"}
            )
        elif kind == 2:
            r = h.get("/v1/models", headers={**key, "Host": "attacker.example"})
        elif kind == 3:
            r = h.post("/v1/completions", content=b"x" * (9 << 20), headers=key)
        else:  # a stream whose client leaves before reading a byte
            body = json.dumps({"prompt": "Count:", "max_tokens": 64, "stream": True})
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(
                    f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                    f"{KEY}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                    f"\r\n\r\n{body}".encode()
                )
                time.sleep(rng.uniform(0, 0.5))
            ledger.saw(0, False, "dropped-before-read ")  # counted in results, not here
            time.sleep(rng.uniform(1, 3))
            continue
        ledger.saw(r.status_code, False, "bad ")
        time.sleep(rng.uniform(1, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/server-soak"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "served"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "EDGEPREFILL_API_KEY": KEY,
        "EDGEPREFILL_KV_CACHE_DIR": tempfile.mkdtemp(prefix="edgeprefill-soak-kv-"),
    }
    command = [
        sys.executable,
        "-m",
        "edgeprefill.runtime.cli.main",
        "serve",
        "--port",
        str(port),
        "--results",
        str(results),
        "--n-ctx",
        "4096",
        "--n-seq-max",
        "8",
        "--kv-cache-ram",
        "128MiB",
        "--kv-cache-disk",
        "512MiB",
        "--documents-kept",
        "16",
    ]
    log = (args.out / "server.log").open("w")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while not _healthy(base):
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(1)
    server = psutil.Process(proc.pid)
    ledger, rss = Ledger(), []
    t0 = time.monotonic()
    stop = t0 + args.minutes * 60
    rng = random.Random(args.seed)
    threads = [
        threading.Thread(
            target=chat_user, args=(base, ledger, random.Random(rng.random()), stop, t0)
        )
        for _ in range(args.users)
    ] + [
        threading.Thread(target=indexer, args=(base, ledger, random.Random(rng.random()), stop)),
        threading.Thread(
            target=hostile, args=(base, port, ledger, random.Random(rng.random()), stop)
        ),
    ]
    for th in threads:
        th.start()
    while any(th.is_alive() for th in threads):
        rss.append((time.monotonic() - t0, server.memory_info().rss))
        print(
            f"{rss[-1][0] / 60:5.1f} min: {ledger.taken} taken, {dict(ledger.status)}, "
            f"RSS {rss[-1][1] / 2**20:.0f} MiB",
            flush=True,
        )
        time.sleep(10)
    metrics = _wait_idle(base)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(600)
    summary = json.loads((results / "summary.json").read_text())
    recorded = (results / "requests.jsonl").read_text().splitlines()
    dropped = ledger.status["dropped-before-read 0"]
    report = {
        "minutes": args.minutes,
        "users": args.users,
        "taken": ledger.taken,
        "dropped_before_read": dropped,
        "recorded": len(recorded),
        "all_recorded": ledger.taken <= len(recorded) <= ledger.taken + dropped,
        "summary_reconciled": summary["accounting"]["reconciled"],
        "submitted_completed_failed": [
            summary["accounting"][k] for k in ("submitted", "completed", "failed")
        ],
        "errors_recorded": dict(Counter(json.loads(x)["error"] for x in recorded)),
        "kv_cells_reserved_idle": metrics.get("edgeprefill_kv_cells_reserved"),
        "exit_code": code,
        "statuses": dict(ledger.status),
        "rss": rss_verdict(rss),
        "rss_samples": rss,
        "p99_itl_ms_per_5min": p99_itl_by_window(ledger.tokens, 0.0),
    }
    (args.out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=2))


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _wait_idle(base: str) -> dict[str, float]:
    """/metrics' plain values once no KV cell is reserved (or after 10 minutes)."""
    deadline = time.monotonic() + 600
    while True:
        text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        if values.get("edgeprefill_kv_cells_reserved") == 0 or time.monotonic() > deadline:
            return values
        time.sleep(1)


if __name__ == "__main__":
    main()
