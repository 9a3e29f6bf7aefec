"""Replay a workload's exact trace against any OpenAI-compatible server over HTTP, and write
the same result files as `edgeprefill run`, so that `report` and `compare` read both.

    # a server already listening (edgeprefill serve, llama-server, vllm serve):
    .venv/bin/python benchmarks/http_replay.py workloads/assistant_plus_indexer.yaml \
        --url http://127.0.0.1:8080 --out results/http-serve [--seed 0]
    # or start `edgeprefill serve` for the replay and stop it after:
    .venv/bin/python benchmarks/http_replay.py workloads/assistant_plus_indexer.yaml \
        --serve "--policy cadence" --out results/http-serve

The requests are exactly those `edgeprefill run` builds for the workload and seed (same
arrivals, prompt token ids, output lengths; `arrivals.jsonl` byte-identical), sent as token
ids to `POST /v1/completions` at their arrival times (a closed-loop turn `think_s` after the
one before it ended), streamed, greedy, with `ignore_eos` as the workload says and vLLM's
`priority` (0 for chats, 1 for documents). Each streamed chunk is stamped as it arrives on
the replay's clock; a chunk whose text spans several tokens (a character split across them)
stamps them all at its arrival, and the final `usage` gives the count. So the times include
HTTP on the server's side and the client's, as a user's program sees them.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from llama_server import (
    answers_tokenizer,
    release,
    replay,
    run_meta,
    stop,
    trace,
    write_results,
)

from edgeprefill.runtime.core.contract import Tokenizer
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.traffic.workload import load_workload


class Endpoint:
    """An OpenAI-compatible server's /v1/completions, one streamed request per call, read
    through httpx (what many Python programs use)."""

    def __init__(
        self, url: str, model: str | None = None, tokenizer: Tokenizer | None = None
    ) -> None:
        """`tokenizer`: the model's, for conversations' turns (see `answer`)."""
        self.url = url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.client = httpx.Client(timeout=httpx.Timeout(3600, connect=10))
        self.texts: dict[str, str] = {}  # each answer's text

    def body(self, req: Request) -> dict[str, Any]:
        return {
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
            "ignore_eos": req.ignore_eos,
            "priority": int(req.cls == "background"),
            **({"model": self.model} if self.model else {}),
        }

    def lines(self, req: Request, clock: Any) -> Iterator[tuple[str, float]]:
        """The response's lines, each with the replay's time it arrived; fails `req` and
        yields nothing on a status other than 200."""
        with self.client.stream("POST", f"{self.url}/v1/completions", json=self.body(req)) as r:
            if r.status_code != 200:
                req.fail(f"the server answered {r.status_code}: {r.read()[:200]!r}")
                return
            for line in r.iter_lines():
                yield line, clock()

    def replay(self, requests: list[Request]) -> float:
        """Every request at its arrival time, a thread each; returns the duration."""
        return replay(self, requests)  # type: ignore[arg-type]

    def complete(self, req: Request, clock: Any) -> None:
        self.record(req, self.lines(req, clock), clock)

    def record(self, req: Request, lines: Iterator[tuple[str, float]], clock: Any) -> None:
        """Fill `req` from its response's lines, each with the time it arrived."""
        times: list[float] = []
        texts: list[str] = []
        n_tokens = None
        for line, now in lines:
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if usage := chunk.get("usage"):
                n_tokens = usage["completion_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                req.prefix_reused_tokens = cached or 0
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    times.append(now)
                    texts.append(choice["text"])
                if choice.get("finish_reason"):
                    req.finish_reason = choice["finish_reason"]
        self.texts[req.id] = "".join(texts)
        if req.error is not None:
            return
        if req.finish_reason is None or n_tokens is None:
            req.fail("the stream ended without a finish reason and usage")
            return
        times += [times[-1] if times else clock()] * max(0, n_tokens - len(times))
        req.token_times_s.extend(times[:n_tokens])
        req.output.extend([0] * n_tokens)  # the count is what is compared, not the ids
        req.num_computed = req.prompt_len

    def answer(self, req: Request) -> list[int]:
        """The answer a conversation's next turn resends: its text, tokenized as the server
        will see it again (what a client of a stateless API sends is text)."""
        if self.tokenizer is None:
            raise ValueError("a conversation's turns need the model's tokenizer")
        return self.tokenizer.encode(self.texts[req.id], add_bos=False, special=False)


class RawEndpoint(Endpoint):
    """The same requests on a plain socket, doing nothing a token but `recv` and a time
    stamp: the HTTP framing and the JSON are read once the stream has ended. httpx spent
    250-400 us of CPU a token, and the standard library's `http.client` 240-310 us, on the
    cores the server and llama.cpp share (benchmarks/history.md, section C), and that CPU
    runs exactly when the server writes; this client is what a server's own cost per
    token is measured against."""

    def lines(self, req: Request, clock: Any) -> Iterator[tuple[str, float]]:
        where = urlsplit(self.url)
        received: list[tuple[float, bytes]] = []  # each recv's bytes and when they came
        with socket.create_connection((where.hostname, where.port), timeout=3600) as sock:
            sock.sendall(self.head(req))
            while data := sock.recv(1 << 16):
                received.append((clock(), data))
        return self.parse(req, received)

    def head(self, req: Request) -> bytes:
        """The request as it goes on the wire."""
        body = json.dumps(self.body(req)).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {urlsplit(self.url).netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        return head.encode() + body

    def parse(
        self, req: Request, received: list[tuple[float, bytes]]
    ) -> Iterator[tuple[str, float]]:
        """The response's lines from its reads; fails `req` on a status other than 200."""
        raw = b"".join(data for _, data in received)
        ends = list(itertools.accumulate(len(data) for _, data in received))
        start = raw.find(b"\r\n\r\n") + 4
        status = raw.split(b" ", 2)[1] if raw.startswith(b"HTTP/") else b"none"
        if status != b"200":
            req.fail(f"the server answered {status.decode()}: {raw[start:][:200]!r}")
            return
        chunked = b"transfer-encoding: chunked" in raw[:start].lower()
        for line, end in _lines(*_body(raw, start, chunked)):
            yield line, received[bisect.bisect_left(ends, end)][0]


def _body(raw: bytes, start: int, chunked: bool) -> tuple[bytes, list[tuple[int, int]]]:
    """The body that begins at `raw[start]`, without its chunked framing, and where each of
    its pieces begins: (offset in the body, offset in `raw`)."""
    if not chunked:
        return raw[start:], [(0, start)]
    parts: list[bytes] = []
    spans: list[tuple[int, int]] = []
    pos, length = start, 0
    while (eol := raw.find(b"\r\n", pos)) >= 0 and (size := int(raw[pos:eol].split(b";")[0], 16)):
        spans.append((length, eol + 2))
        parts.append(raw[eol + 2 : eol + 2 + size])
        length += size
        pos = eol + 2 + size + 2
    return b"".join(parts), spans


def _lines(body: bytes, spans: list[tuple[int, int]]) -> Iterator[tuple[str, int]]:
    """Each line of `body` and the offset in the raw response just past its newline."""
    starts = [b for b, _ in spans]
    pos = 0
    while (newline := body.find(b"\n", pos)) >= 0:
        i = bisect.bisect_right(starts, newline) - 1
        yield body[pos:newline].rstrip(b"\r").decode(), spans[i][1] + newline - starts[i] + 1
        pos = newline + 1


class OneThreadEndpoint(RawEndpoint):
    """The raw client with every request in one thread (asyncio's streams), as an async
    program reads its streams: the server's writes of one hand-over wake one client thread,
    not one a stream, on the cores the server shares."""

    def replay(self, requests: list[Request]) -> float:
        return asyncio.run(self._replay(requests))

    async def _replay(self, requests: list[Request]) -> float:
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        done = {r.id: asyncio.Event() for r in requests}
        by_id = {r.id: r for r in requests}

        async def one(req: Request) -> None:
            if req.after is not None:
                await done[req.after].wait()
                release(self, req, by_id[req.after])
            await asyncio.sleep(max(0.0, req.arrival_s - clock()))
            try:
                received = await self._receive(req, clock)
                self.record(req, self.parse(req, received), clock)
            except (OSError, ValueError) as e:
                req.fail(f"{type(e).__name__}: {e}")
            finally:
                done[req.id].set()

        await asyncio.gather(*(one(r) for r in requests))
        return clock()

    async def _receive(self, req: Request, clock: Any) -> list[tuple[float, bytes]]:
        where = urlsplit(self.url)
        reader, writer = await asyncio.open_connection(where.hostname, where.port)
        received: list[tuple[float, bytes]] = []
        try:
            writer.write(self.head(req))
            while data := await reader.read(1 << 16):
                received.append((clock(), data))
        finally:
            writer.close()
        return received


CLIENTS = {"httpx": Endpoint, "raw": RawEndpoint, "one-thread": OneThreadEndpoint}


class ServeProcess:
    """`edgeprefill serve` on a free loopback port for the replay."""

    def __init__(self, args: str, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "edgeprefill.runtime.cli.main", "serve"]
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port), *shlex.split(args)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        if not wait_healthy(self.url, self.proc, 600):
            self.close()
            raise RuntimeError(f"edgeprefill serve did not come up; see {log}")

    def close(self) -> None:
        stop(self.proc, timeout_s=120)  # it finishes what is in flight first
        self._log.close()


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float) -> bool:
    """Whether the server at `url` answered /health with 200 before `proc` exited or
    `seconds` passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return False


def server_delivery(url: str) -> dict[str, float | None]:
    """`edgeprefill serve`'s own time per streamed token (engine stamp to the connection),
    from its /metrics histogram: the bucket bounds under which 50% and 99% of tokens fell,
    and the share within 1 ms (read from bounds alone, a P99 near 1 ms moves in steps of
    0.25-0.5 ms)."""
    counts: dict[float, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("edgeprefill_token_delivery_seconds_bucket"):
            bound = line.split('le="')[1].split('"')[0]
            counts[float(bound)] = float(line.rsplit(" ", 1)[1])
    total = counts.get(float("inf"), 0.0)

    def under(q: float) -> float | None:
        return next((b * 1e3 for b, n in sorted(counts.items()) if n >= q * total), None)

    within = counts[0.001] / total if total and 0.001 in counts else None
    return {
        "tokens": total,
        "p50_ms_at_most": under(0.5),
        "p99_ms_at_most": under(0.99),
        "within_1ms": within,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=None)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a server already listening, e.g. http://127.0.0.1:8080")
    where.add_argument("--serve", help="start `edgeprefill serve` with these options")
    ap.add_argument("--model", default=None, help="the model name to send [default: none]")
    ap.add_argument("--client", choices=CLIENTS, default="httpx")
    args = ap.parse_args()
    spec = load_workload(args.workload)
    requests = trace(spec, args.seed, args.out)
    server = None if args.url else ServeProcess(args.serve, args.out / "server.log")
    url = args.url or server.url  # type: ignore[union-attr]
    started = datetime.now(UTC)
    try:
        with answers_tokenizer(requests) as tokenizer:
            duration = CLIENTS[args.client](url, args.model, tokenizer).replay(requests)
        delivery = server_delivery(url) if server is not None else None
    finally:
        if server is not None:
            server.close()
    name = "edgeprefill serve " + args.serve if args.serve is not None else url
    backend = {"name": "http", "url": url, "server": name, "token_delivery": delivery}
    seed = spec.seed if args.seed is None else args.seed
    meta = run_meta(backend, name, args.workload, seed, started)
    write_results(args.out, requests, duration, meta, name)


if __name__ == "__main__":
    main()
