"""Does a very long document posted to `edgeprefill serve` stall the chats streaming beside
it? Eight chats stream; in every other round a 100k-token document is posted while they
do (refused with 400 once tokenized: longer than the context, so only its tokenizing can
touch the chats). Rounds alternate, without and with, on one warm server.

    .venv/bin/python benchmarks/tokenize_stall.py [--rounds 3] [--out results/tokenize-stall.json]

Reports each round's P99 and max gap between a chat's chunks as the client saw them, and
how long the server took to answer the document (its tokenizing).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

CHATS = 8
DOCUMENT = "Snow falls on the quiet pass tonight. " * 12500  # ~100k tokens


def stream(base: str, gaps: list[float], i: int) -> None:
    body = {"prompt": f"Story {i}:", "max_tokens": 120, "ignore_eos": True, "stream": True}
    times = []
    with httpx.Client(base_url=base, timeout=600) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
    gaps.extend(np.diff(times[1:]).tolist())  # from the first token on


def round_(base: str, with_document: bool) -> dict:
    gaps: list[float] = []
    threads = [threading.Thread(target=stream, args=(base, gaps, i)) for i in range(CHATS)]
    for t in threads:
        t.start()
    took = None
    time.sleep(4)  # all streaming
    if with_document:
        start = time.perf_counter()
        r = httpx.post(f"{base}/v1/documents", json={"text": DOCUMENT}, timeout=600)
        took = time.perf_counter() - start
        assert r.status_code in (400, 202), r.text  # 202: an older server, failing it later
    for t in threads:
        t.join()
    return {
        "document": with_document,
        "p99_gap_ms": float(np.percentile(gaps, 99) * 1e3),
        "max_gap_ms": float(max(gaps) * 1e3),
        "median_gap_ms": float(np.median(gaps) * 1e3),
        "document_answered_s": took,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/tokenize-stall.json"))
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "edgeprefill.runtime.cli.main", "serve", "--port", str(port)]
    command += ["--n-ctx", "4096", "--n-seq-max", str(CHATS)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(1)
        round_(base, False)  # warm-up
        rounds = [round_(base, i % 2 == 1) for i in range(2 * args.rounds)]
    finally:
        proc.terminate()
        proc.wait(120)
    for r in rounds:
        print(json.dumps(r))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rounds, indent=2) + "\n")


if __name__ == "__main__":
    main()
