"""Arrival processes. Seeded and independent of the model, so the same seed gives the same
arrival times on every backend and policy."""

from __future__ import annotations

import numpy as np

from edgeprefill.runtime.workload import (
    Arrivals,
    BurstArrivals,
    PhasedArrivals,
    PoissonArrivals,
)


def arrival_times(spec: Arrivals, rng: np.random.Generator) -> list[float]:
    """Seconds after the run starts, ascending."""
    if isinstance(spec, PoissonArrivals):
        # The first request arrives at start_s; exponential gaps after it.
        gaps = rng.exponential(1.0 / spec.rate_per_s, spec.count - 1)
        offsets = np.concatenate([[0.0], np.cumsum(gaps)])
        return [spec.start_s + float(x) for x in offsets]
    if isinstance(spec, BurstArrivals):
        return [spec.start_s + i * spec.interval_s for i in range(spec.count)]
    if isinstance(spec, PhasedArrivals):
        # Exponential gaps restart at each phase boundary, which is exact for a Poisson
        # process (memoryless).
        times: list[float] = []
        t0 = spec.start_s
        for phase in spec.phases:
            t = t0
            while phase.rate_per_s > 0:
                t += float(rng.exponential(1.0 / phase.rate_per_s))
                if t >= t0 + phase.duration_s:
                    break
                times.append(t)
            t0 += phase.duration_s
        return times
    raise TypeError(f"unknown arrival process {spec!r}")
