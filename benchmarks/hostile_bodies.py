"""What a hostile local program costs `edgeprefill serve` (bundled model): the targets of the
hostile-client work, measured on the machine at hand against a real server.

    .venv/bin/python benchmarks/hostile_bodies.py [--threads 2]

- Each costly body under the 8 MiB limit (a bad item per value, valid items past every
  bound, empty containers, short strings): seconds to its answer, the server's peak RSS
  growth, and the longest gap of a chat streaming meanwhile (targets: 2 s, 200 MB, 300 ms).
- 1,000 idle sockets: /health's status and a chat's time, against the same chat without
  them (targets: 200, the usual time).
- SIGTERM with a half-sent body open: seconds to exit (target: 15) and summary.json there.
Prints one line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from http_replay import ServeProcess

from edgeprefill.thermal.machine import describe_machine

KEY = "benchmark-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "ignore_eos": True}
BODIES = {"negative ids": b"-1", "valid ids": b"1", "empty lists": b"[]", "strings": b'"a"'}


def stream_gaps(url: str, stop: threading.Event, gaps: list[float]) -> None:
    body = {**CHAT, "max_tokens": 400, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=600
    ) as r:
        last = None
        for line in r.iter_lines():
            now = time.monotonic()
            if line and last is not None:
                gaps.append(now - last)
            last = now if line else last
            if stop.is_set():
                break


def costly_body(url: str, pid: int, item: bytes) -> str:
    n = (8 << 20) // (len(item) + 1) - 64
    body = b'{"prompt": [' + (item + b",") * n + item + b"]}"
    process, peak, done = psutil.Process(pid), [0], threading.Event()
    start_rss = process.memory_info().rss

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.005)

    gaps: list[float] = []
    streamer = threading.Thread(target=stream_gaps, args=(url, done, gaps))
    sampler = threading.Thread(target=sample)
    streamer.start()
    time.sleep(1.0)  # streaming
    sampler.start()
    sent = time.monotonic()
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(f"{url}/v1/completions", content=body, headers=headers, timeout=120)
    took = time.monotonic() - sent
    time.sleep(0.5)
    done.set()
    streamer.join()
    sampler.join()
    growth = (peak[0] - start_rss) / 2**20
    return f"{r.status_code} in {took:.3f} s, RSS +{growth:.0f} MB, stream's longest gap {max(gaps) * 1e3:.0f} ms"


def chat_s(url: str) -> float:
    sent = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=AUTH, timeout=120)
    r.raise_for_status()
    return time.monotonic() - sent


def idle_sockets(url: str, port: int) -> str:
    alone = min(chat_s(url) for _ in range(3))
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(1000)]
    try:
        health = httpx.get(f"{url}/health", timeout=30).status_code
        crowded = min(chat_s(url) for _ in range(3))
    finally:
        for sock in idle:
            sock.close()
    return f"/health {health}; a chat {crowded:.3f} s with them, {alone:.3f} s without"


def half_sent_sigterm(server: ServeProcess, results: Path) -> str:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"Authorization: Bearer {KEY}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    time.sleep(0.5)
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(120)
    took = time.monotonic() - sent
    sock.close()
    written = (results / "summary.json").exists()
    return (
        f"exited in {took:.1f} s (code {server.proc.returncode}), summary.json written: {written}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    os.environ["EDGEPREFILL_API_KEY"] = KEY
    with tempfile.TemporaryDirectory() as folder:
        results = Path(folder) / "results"
        options = f"--threads {args.threads} --results {results} --no-progress"
        server = ServeProcess(options, Path(folder) / "serve.log")
        try:
            chat_s(server.url)  # the first chat's allocations are not the bodies'
            for name, item in BODIES.items():
                print(
                    f"8 MiB of {name}: {costly_body(server.url, server.proc.pid, item)}", flush=True
                )
            print(f"1,000 idle sockets: {idle_sockets(server.url, server.port)}", flush=True)
            print(f"SIGTERM, a body half sent: {half_sent_sigterm(server, results)}", flush=True)
        finally:
            if server.proc.poll() is None:
                server.close()
        print(json.dumps({"machine": describe_machine(), "threads": args.threads}))


if __name__ == "__main__":
    main()
