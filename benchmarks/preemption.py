"""A chat arriving while a long document chunk is computed: its TTFT with and without
preemption, and the time from its arrival to the abort landing, in interleaved rounds.

    .venv/bin/python benchmarks/preemption.py [--rounds 5]

One document of 3,000 tokens arrives at 0 s; a 200-token chat arrives at a time that
moves through the document's first 2,048-token chunk from round to round. Fast batching
(a chunk spans several micro-batches), policy P-PAS (no budget while nothing decodes, so
the whole document chunk, and the chat's prompt alone), the bundled model.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np

from edgeprefill.backends.bundled_model import default_model_path
from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.policies import parse_policy
from edgeprefill.runtime.replay.loop import run_requests
from edgeprefill.runtime.results.writer import RunWriter
from edgeprefill.runtime.traffic.prompts import PromptBuilder


def one(be: LlamaCppBackend, chat_at: float, out: Path) -> tuple[float, list[float]]:
    rng = np.random.default_rng(0)
    build = PromptBuilder(be.tokenizer).synthetic
    doc = Request("doc", "background", 0.0, build(3000, rng), 16, ignore_eos=True)
    chat = Request("chat", "foreground", chat_at, build(200, rng), 16, ignore_eos=True)
    with RunWriter(out) as writer:
        run_requests(Engine(be, parse_policy("ppas:bcap=64")), [doc, chat], writer)
        latencies = [p["abort_latency_s"] for p in writer.preemptions]
    return chat.token_times_s[0] - chat.arrival_s, latencies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    rounds = ap.parse_args().rounds
    config = LlamaCppConfig(model=default_model_path(), n_ctx=4096, batching="fast")
    with LlamaCppBackend(config) as be, tempfile.TemporaryDirectory() as tmp:
        on, off, aborts = [], [], []
        for i in range(rounds):
            at = 0.3 + 1.5 * i / max(rounds - 1, 1)
            be.supports_abort = True
            ttft, lat = one(be, at, Path(tmp) / f"on{i}")
            on.append(ttft)
            aborts += lat
            be.supports_abort = False
            off.append(one(be, at, Path(tmp) / f"off{i}")[0])
            print(
                f"chat at {at:.2f} s: TTFT {ttft:.3f} s with preemption, {off[-1]:.3f} s "
                f"without; abort landed {[round(x * 1e3, 1) for x in lat]} ms after arrival"
            )
        print(
            f"median TTFT {statistics.median(on):.3f} s with, {statistics.median(off):.3f} s "
            f"without ({rounds} interleaved rounds); arrival to abort: median "
            f"{statistics.median(aborts) * 1e3:.1f} ms, max {max(aborts) * 1e3:.1f} ms "
            f"over {len(aborts)} aborts"
        )


if __name__ == "__main__":
    main()
