"""Arrival processes. Seeded and independent of the model, so the same seed gives the same
arrival times on every backend and policy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeprefill.runtime.traffic.workload import (
    Arrivals,
    BurstArrivals,
    ClosedLoopArrivals,
    GammaArrivals,
    PhasedArrivals,
    PoissonArrivals,
    TraceArrivals,
)


@dataclass(frozen=True)
class Arrival:
    """When one request arrives: at `t_s`, or (closed loop) `think_s` after the request
    `after` (its index in the same stream) finished."""

    t_s: float | None
    after: int | None = None
    think_s: float = 0.0


def _from_gaps(start_s: float, gaps: np.ndarray) -> list[Arrival]:
    # The first request arrives at start_s; the gaps follow it.
    offsets = np.concatenate([[0.0], np.cumsum(gaps)])
    return [Arrival(start_s + float(x)) for x in offsets]


def arrival_times(
    spec: Arrivals, rng: np.random.Generator, count: int | None = None
) -> list[Arrival]:
    """In request order; `count` replaces the spec's count (one request per document
    piece)."""
    if isinstance(spec, PoissonArrivals):
        n = count or spec.count or 0
        return _from_gaps(spec.start_s, rng.exponential(1.0 / spec.rate_per_s, n - 1))
    if isinstance(spec, GammaArrivals):
        n = count or spec.count or 0
        theta = 1.0 / (spec.rate_per_s * spec.burstiness)  # mean gap 1/rate for any shape
        return _from_gaps(spec.start_s, rng.gamma(spec.burstiness, theta, n - 1))
    if isinstance(spec, BurstArrivals):
        n = count or spec.count or 0
        return [Arrival(spec.start_s + i * spec.interval_s) for i in range(n)]
    if isinstance(spec, PhasedArrivals):
        # Exponential gaps restart at each phase boundary, which is exact for a Poisson
        # process (memoryless).
        times: list[Arrival] = []
        t0 = spec.start_s
        for phase in spec.phases:
            t = t0
            while phase.rate_per_s > 0:
                t += float(rng.exponential(1.0 / phase.rate_per_s))
                if t >= t0 + phase.duration_s:
                    break
                times.append(Arrival(t))
            t0 += phase.duration_s
        return times
    if isinstance(spec, ClosedLoopArrivals):
        out: list[Arrival] = []
        for user in range(spec.users):
            out.append(Arrival(spec.start_s + user * spec.stagger_s))
            for _ in range(spec.turns - 1):
                think = float(rng.exponential(spec.think_s)) if spec.think_s else 0.0
                out.append(Arrival(None, after=len(out) - 1, think_s=think))
        return out
    if isinstance(spec, TraceArrivals):
        return [Arrival(spec.start_s + row["timestamp_s"]) for row in spec.rows]
    raise TypeError(f"unknown arrival process {spec!r}")
