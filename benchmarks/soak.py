"""Hours of mixed load through the embedding API, on the real model: does anything leak?

    .venv/bin/python benchmarks/soak.py [--minutes 30] [--users 3] [--out results/soak]

Closed-loop chat users (each waits for its answer, thinks, asks again), an indexer reading
documents, questions about documents it read (their KV state restored, not computed),
cancels at random moments (in a prompt, mid-stream), and now and then a request that can
never fit the context. Every loop is bounded by the clock and every request by a timeout.

Reports (JSON in OUT/soak.json, lines on the console): requests submitted, completed,
cancelled and failed with their reasons (they must add up); KV cells held once all ended
(must be 0); the process's RSS every 10 s, and after warm-up (the first fifth) whether it is
flat (within 5% of its median) with no upward trend (least-squares slope over the rest,
projected over that span, under 5%); files left in the KV-state folder that are not whole
states (must be none); P99 inter-token latency of the chats in each 5-minute window.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil

from edgeprefill.backends.bundled_model import default_model_path
from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from edgeprefill.backends.llamacpp.probe import plain_tokens
from edgeprefill.backends.llamacpp.state_store import SUFFIX
from edgeprefill.runtime import Runtime
from edgeprefill.runtime.api.handle import RequestHandle

TOPICS = ["the sea", "a mountain", "bread", "rain", "a library", "trains", "winter", "bees"]
WINDOW_S = 300
N_CTX = 4096


class Ledger:
    """Every request the soak submitted and how it ended (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ended: Counter[str] = Counter()
        self.submitted = 0
        self.tokens: list[tuple[float, list[float]]] = []  # chats: (first token time, times)

    def submit(self) -> None:
        with self.lock:
            self.submitted += 1

    def end(self, handle: RequestHandle, chat: bool) -> None:
        req = handle.result(timeout=600)
        with self.lock:
            self.ended[req.error or "completed"] += 1
            if chat and req.error is None and req.token_times_s:
                self.tokens.append((req.token_times_s[0], list(req.token_times_s)))


def chat_user(rt: Runtime, ledger: Ledger, rng: random.Random, stop: float) -> None:
    history: list[dict[str, str]] = []
    while time.monotonic() < stop:
        history = history[-4:] + [
            {"role": "user", "content": f"Tell me one fact about {rng.choice(TOPICS)}."}
        ]
        handle = rt.chat(history, max_tokens=rng.randint(16, 48))
        ledger.submit()
        if rng.random() < 0.1:  # the person changes their mind, early or mid-answer
            time.sleep(rng.uniform(0, 1.5))
            handle.cancel()
        ledger.end(handle, chat=True)
        answer = handle.result().output
        history.append({"role": "assistant", "content": rt.backend.tokenizer.decode(answer)})
        time.sleep(rng.expovariate(1 / 3.0))  # think time, mean 3 s


def indexer(rt: Runtime, ledger: Ledger, rng: random.Random, stop: float, model) -> None:
    read: list[RequestHandle] = []
    while time.monotonic() < stop:
        kind = rng.random()
        if kind < 0.05:  # can never fit: longer than a sequence's context
            handle = rt.index(plain_tokens(model, N_CTX + 200), max_tokens=8)
        elif kind < 0.35 and read:  # a question about a document read earlier
            handle = rt.ask(rng.choice(read), "What is it about?", max_tokens=24)
        else:
            start = rng.randint(0, 5000)
            doc = plain_tokens(model, start + rng.randint(1000, 3000))[start:]
            handle = rt.index(doc, max_tokens=rng.randint(8, 32))
            if rng.random() < 0.15:  # the user closes the folder while it is read
                time.sleep(rng.uniform(0, 4))
                handle.cancel()
        ledger.submit()
        ledger.end(handle, chat=False)
        if handle.result().error is None and handle.request.cls == "background":
            read = (read + [handle])[-6:]
        time.sleep(rng.uniform(0, 2))


def p99_itl_by_window(tokens: list[tuple[float, list[float]]], t0: float) -> list[float | None]:
    windows: dict[int, list[float]] = {}
    for first, times in tokens:
        gaps = np.diff(times)
        windows.setdefault(int((first - t0) // WINDOW_S), []).extend(gaps.tolist())
    n = max(windows, default=-1) + 1
    return [
        float(np.percentile(windows[w], 99) * 1e3) if windows.get(w) else None for w in range(n)
    ]


def rss_verdict(samples: list[tuple[float, int]]) -> dict:
    if len(samples) < 10:
        return {"samples": len(samples), "flat": None}
    rest = samples[len(samples) // 5 :]
    t = np.array([s[0] for s in rest])
    rss = np.array([s[1] for s in rest], dtype=float)
    median = float(np.median(rss))
    slope = float(np.polyfit(t, rss, 1)[0])  # bytes per second
    drift = float(slope * (t[-1] - t[0]) / median)
    spread = float(np.max(np.abs(rss - median)) / median)
    return {
        "samples": len(samples),
        "median_mib": median / 2**20,
        "max_deviation": spread,
        "trend_over_span": drift,
        "flat": bool(spread <= 0.05 and drift < 0.05),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/soak"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--trim",
        action="store_true",
        help="call glibc's malloc_trim(0) at every RSS sample (a diagnostic: does RSS grow "
        "because freed memory stays with the allocator, or because something is kept?)",
    )
    args = ap.parse_args()
    trim = ctypes.CDLL("libc.so.6").malloc_trim if args.trim else None
    args.out.mkdir(parents=True, exist_ok=True)
    kv_folder = Path(tempfile.mkdtemp(prefix="edgeprefill-soak-kv-"))
    proc = psutil.Process()
    rss: list[tuple[float, int]] = []
    ledger = Ledger()
    config = LlamaCppConfig(
        model=default_model_path(),
        n_ctx=N_CTX,
        n_seq_max=8,
        kv_cache_dir=kv_folder,
        kv_cache_disk=512 << 20,
        kv_cache_ram=128 << 20,
    )
    with LlamaCppBackend(config) as be:
        rt = Runtime(be, results=args.out)
        t0 = time.monotonic()
        stop = t0 + args.minutes * 60
        threads = [
            threading.Thread(
                target=chat_user, args=(rt, ledger, random.Random(args.seed + u), stop)
            )
            for u in range(args.users)
        ]
        threads.append(
            threading.Thread(
                target=indexer, args=(rt, ledger, random.Random(args.seed + 99), stop, be.model)
            )
        )
        for th in threads:
            th.start()
        next_report = t0
        while any(th.is_alive() for th in threads):
            now = time.monotonic()
            if now >= next_report:
                if trim is not None:
                    trim(0)
                rss.append((now - t0, proc.memory_info().rss))
                print(
                    f"{(now - t0) / 60:5.1f} min: {ledger.submitted} submitted, "
                    f"{dict(ledger.ended)}, RSS {rss[-1][1] / 2**20:.0f} MiB",
                    flush=True,
                )
                next_report += 10
            time.sleep(0.5)
        rt.shutdown()
        held = [s for s in range(config.n_seq_max) if be.seq_pos_max(s) >= 0]
        be.prefix_cache.flush()
        leftovers = [
            p.name for p in kv_folder.iterdir() if p.suffix != SUFFIX and p.name != ".lock"
        ]
    summary = json.loads((args.out / "summary.json").read_text())
    ended = sum(ledger.ended.values())
    report = {
        "minutes": args.minutes,
        "users": args.users,
        "malloc_trim": args.trim,
        "submitted": ledger.submitted,
        "ended": dict(ledger.ended),
        "accounted": ended == ledger.submitted,
        "summary_reconciled": summary["accounting"]["reconciled"],
        "kv_sequences_holding_cells": held,
        "kv_folder_leftovers": leftovers,
        "rss": rss_verdict(rss),
        "rss_samples": rss,
        "p99_itl_ms_per_5min": p99_itl_by_window(ledger.tokens, 0.0),
    }
    (args.out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=2))


if __name__ == "__main__":
    main()
