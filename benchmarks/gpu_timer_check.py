"""Check the vLLM backend's CUDA-event step timer on an NVIDIA GPU, with torch alone.

    python benchmarks/gpu_timer_check.py        # a few minutes; no vLLM, model or network

Copy this file and backends/vllm/timing.py side by side (or run it in the repo). It checks
(1) that the timer's reading of a step (events recorded around it, read with query() once
complete) agrees with a synchronized wall-clock measurement of the same work within 2%, and
(2) that recording and polling the events adds under 1% to a step, in interleaved rounds
(with the timer, without, several times) so that clock drift cannot fake either result.
Exit code 0: both hold; 1: one failed (the numbers say which); 2: no CUDA device.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch


def load_timer_module():
    here = Path(__file__).resolve().parent
    for path in (here / "timing.py", here.parent / "backends" / "vllm" / "timing.py"):
        if path.is_file():
            spec = importlib.util.spec_from_file_location("ep_timing", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)  # type: ignore[union-attr]
            return mod
    sys.exit("timing.py not found beside this script or in backends/vllm/")


def make_step(ms: float):
    """A step of matmuls sized to take about `ms` on this GPU."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 20
    n = max(1, round(ms / 1000 / per))

    def step() -> None:
        for _ in range(n):
            a @ b

    return step


def event_vs_wall(timing, step, rounds: int = 30) -> tuple[float, float]:
    timer = timing.CudaEventTimer(torch)
    events, walls = [], []
    for i in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        timer.start(i, 0)
        step()
        timer.stop()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        (reading,) = timer.poll()
        events.append(reading.duration_s)
    return statistics.median(events), statistics.median(walls)


def steps_per_s(timing, step, n: int, timed: bool) -> float:
    """n steps back to back, as a serving loop runs them (the timer polled every step)."""
    timer = timing.CudaEventTimer(torch) if timed else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        if timer is not None:
            timer.start(i, 0)
        step()
        if timer is not None:
            timer.stop()
            timer.poll()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device visible: run this on an NVIDIA GPU", file=sys.stderr)
        return 2
    timing = load_timer_module()
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    ok = True
    for ms in (5.0, 20.0, 100.0):
        step = make_step(ms)
        step()
        ev, wall = event_vs_wall(timing, step)
        diff = abs(ev - wall) / wall
        ok &= diff <= 0.02
        print(
            f"step ~{ms:.0f} ms: events {ev * 1e3:.3f} ms, wall {wall * 1e3:.3f} ms, "
            f"differ by {diff:.2%} (limit 2%)"
        )
    step = make_step(20.0)
    with_t, without = [], []
    for _ in range(5):  # interleaved rounds
        without.append(steps_per_s(timing, step, 50, timed=False))
        with_t.append(steps_per_s(timing, step, 50, timed=True))
    overhead = statistics.median(with_t) / statistics.median(without) - 1
    ok &= overhead < 0.01
    print(
        f"20 ms steps: {statistics.median(without) * 1e3:.3f} ms without the timer, "
        f"{statistics.median(with_t) * 1e3:.3f} ms with it: overhead {overhead:+.2%} "
        f"(limit 1%, 5 interleaved rounds of 50 steps)"
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
