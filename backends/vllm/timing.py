"""Completed-step timers on the worker side: CUDA events on a GPU, perf_counter on a CPU.

DLFP timed the scheduler's cadence and failed on larger GPUs; these time the work that
finished. A GPU timer records an event pair around the step and reads it with `query()`
once the device has passed it, never synchronizing the hot path, so its readings may arrive
a step or more late. Each reading therefore carries the index of the step it measured.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class IterationReading:
    """One completed step's duration, as the worker measured it."""

    step: int  # the worker's count of steps it was given, from 0
    tokens: int  # tokens the step computed (matched against the scheduler's record)
    duration_s: float


class IterationTimer(Protocol):
    clock: str  # the name summary.json records

    def start(self, step: int, tokens: int) -> None: ...

    def stop(self) -> None: ...

    def poll(self) -> list[IterationReading]:
        """Readings of steps that have completed since the last poll, oldest first."""
        ...


class PerfCounterTimer:
    """A synchronous device (the CPU): the step has finished when the call returns."""

    clock = "perf_counter"

    def __init__(self) -> None:
        self._open: tuple[int, int, float] | None = None
        self._done: list[IterationReading] = []

    def start(self, step: int, tokens: int) -> None:
        self._open = (step, tokens, time.perf_counter())

    def stop(self) -> None:
        if self._open is None:
            return
        step, tokens, t0 = self._open
        self._done.append(IterationReading(step, tokens, time.perf_counter() - t0))
        self._open = None

    def poll(self) -> list[IterationReading]:
        done, self._done = self._done, []
        return done


class CudaEventTimer:
    """A pair of CUDA events per step on the current stream, read once complete.

    `torch` is passed in (and only `torch.cuda.Event` used), so the logic can be exercised
    without a GPU; `benchmarks/gpu_timer_check.py` checks it against wall-clock time on one.
    """

    clock = "cuda_event"

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self._open: tuple[int, int, Any] | None = None
        self._pending: deque[tuple[int, int, Any, Any]] = deque()

    def _event(self) -> Any:
        return self._torch.cuda.Event(enable_timing=True)

    def start(self, step: int, tokens: int) -> None:
        ev = self._event()
        ev.record()
        self._open = (step, tokens, ev)

    def stop(self) -> None:
        if self._open is None:
            return
        step, tokens, start = self._open
        end = self._event()
        end.record()
        self._pending.append((step, tokens, start, end))
        self._open = None

    def poll(self) -> list[IterationReading]:
        out = []
        while self._pending and self._pending[0][3].query():
            step, tokens, start, end = self._pending.popleft()
            out.append(IterationReading(step, tokens, start.elapsed_time(end) / 1000.0))
        return out

    @property
    def pending(self) -> int:
        return len(self._pending)
