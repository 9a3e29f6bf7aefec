"""The engine's own host time an iteration, with the caches emptied as a decode empties them.

    .venv/bin/python benchmarks/cold_host.py [--iterations 1000] [--warm]

A decode streams the model's weights through every cache, so the Python that runs between two
device calls finds its code and data evicted: most of its time is that first touch, not the
work (history, section Q). Here the engine (admission, planning, bookkeeping, observation,
update, record, the iterations.jsonl writer) runs on the simulated backend, cadence deciding,
one chat beside three documents, and each device call is replaced by a sweep over memory
larger than the last-level cache
(`--sweep-mb`). No model and no device noise: comparing two versions of
the code in alternated processes (`PYTHONPATH` pointing at the other's checkout) shows
differences of a few microseconds that runs on the real model, whose speed drifts by more,
do not.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgeprefill.backends.sim import SimBackend
from edgeprefill.runtime.core.contract import Capacity, IterationResult, SeqWork
from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.policies.cadence import CadencePolicy
from edgeprefill.runtime.results.writer import RunWriter

# The sweep is to empty every cache: by default 3x the 32 MB L3 of the CPUs seen here; a
# CPU with a larger last-level cache needs --sweep-mb of three times its size.
DEFAULT_SWEEP_MB = 96
# A CPU-like device: 20 ms a pass over the weights, 3 ms a prompt token.
COST = CostModel(per_pass_s=0.020, per_sampled_s=0.002, per_prefill_s=0.003, per_kctx_s=0.001)
CAP = Capacity(
    n_batch=2048, n_ctx=8 * 16384, n_seq_max=8, n_ctx_seq=16384, min_chunk=8, max_chunk=2048
)


class SweepingBackend(SimBackend):
    """The simulated backend, each call preceded by a sweep that evicts the caches; the time
    of both is kept apart so that only the engine's is reported."""

    def __init__(self, sweep_mb: int) -> None:
        super().__init__(COST, CAP)
        self.sweep = np.ones(sweep_mb * 2**20 // 8) if sweep_mb else None
        self.spent_s = 0.0

    def execute(
        self, work: Sequence[SeqWork], abort: threading.Event | None = None
    ) -> IterationResult:
        t0 = time.perf_counter()
        if self.sweep is not None:
            self.sweep.sum()
        result = super().execute(work, abort)
        self.spent_s += time.perf_counter() - t0
        return result


def requests(chat_tokens: int) -> list[Request]:
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return [1, *rng.integers(10, 999, n).tolist()]

    out = [Request("chat", "foreground", 0.0, prompt(200), chat_tokens, ignore_eos=True)]
    out += [
        Request(f"doc{i}", "background", 0.0, prompt(3000), 16, ignore_eos=True) for i in range(3)
    ]
    return out


def host_times(iterations: int, sweep_mb: int) -> np.ndarray:
    """Seconds of the engine's own time for each iteration after the first 20 (`sweep_mb`
    0: warm caches)."""
    backend = SweepingBackend(sweep_mb)
    profile = DeviceProfile(
        COST, decode_s=0.024, target_s=0.1, n_batch=2048, min_chunk=8, source="cold_host"
    )
    engine = Engine(backend, CadencePolicy(itl_ms=100), profile=profile)
    times = []
    with tempfile.TemporaryDirectory() as d, RunWriter(Path(d)) as writer:
        for req in requests(iterations):
            engine.add(req)
        while engine.has_work:
            backend.spent_s = 0.0
            t0 = time.perf_counter()
            it = engine.iterate()
            assert it is not None, "the engine stalled with work left"
            writer.iteration(it)
            times.append(time.perf_counter() - t0 - backend.spent_s)
    return np.array(times[20:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=1000, help="the chat's output tokens")
    ap.add_argument("--warm", action="store_true", help="no sweep: the same code on warm caches")
    ap.add_argument("--sweep-mb", type=int, default=DEFAULT_SWEEP_MB, help="memory swept per call")
    args = ap.parse_args()
    if args.iterations <= 20:
        ap.error(f"--iterations must be over 20 (the first 20 are left out), got {args.iterations}")
    if args.sweep_mb < 1:
        ap.error(f"--sweep-mb must be at least 1, got {args.sweep_mb}")
    us = host_times(args.iterations, 0 if args.warm else args.sweep_mb) * 1e6
    caches = "warm" if args.warm else "cold"
    print(
        f"{caches} caches, {len(us)} iterations: median {np.median(us):.1f} us, mean {us.mean():.1f} us"
    )


if __name__ == "__main__":
    main()
