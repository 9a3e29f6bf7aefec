"""Thermal- and battery-aware background budget, for any policy.

On a laptop, reading documents at full speed while hot or on battery costs the user comfort
and charge for work that can wait. When the device reports thermal throttling, a
temperature at or above `max_temp_c`, or (with `on_battery`) no external power, the
background's prompt tokens per iteration are scaled by `factor`; the foreground is never
touched. The condition clears only when every signal has: temperature must fall
`hysteresis_c` below the threshold, so the budget does not flap around it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgeprefill.thermal.energy import throttle_flags

Sample = dict[str, Any]


def _temperatures(sample: Sample) -> list[float]:
    temps = []
    if "cpu_temp" in sample:
        temps.append(sample["cpu_temp"]["c"])
    temps += [g["temp_c"] for g in sample.get("gpu", {}).get("gpus", [])]
    return temps


@dataclass(frozen=True)
class ThermalSettings:
    factor: float = 0.5  # background prompt tokens are scaled by this while the condition holds
    max_temp_c: float | None = 90.0
    on_battery: bool = True
    hysteresis_c: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.factor <= 1:
            raise ValueError(f"thermal factor must be in (0, 1], got {self.factor}")
        if self.hysteresis_c < 0:
            raise ValueError(f"thermal hysteresis must not be negative, got {self.hysteresis_c}")


@dataclass
class ThermalGuard:
    source: Callable[[], Sample | None]  # the latest telemetry sample
    settings: ThermalSettings = field(default_factory=ThermalSettings)
    active: bool = field(default=False, init=False)
    reasons: list[str] = field(default_factory=list, init=False)

    def update(self) -> None:
        """Re-evaluate the condition from the latest sample (once per iteration)."""
        sample = self.source()
        if sample is None:
            return
        s = self.settings
        reasons = []
        if throttle_flags(sample):
            reasons.append("throttling")
        hottest = max(_temperatures(sample), default=None)
        if s.max_temp_c is not None and hottest is not None:
            limit = s.max_temp_c - (s.hysteresis_c if self.active else 0.0)
            if hottest >= limit:
                reasons.append(f"temperature {hottest:.0f} C")
        battery = sample.get("battery")
        if s.on_battery and battery is not None and not battery["plugged"]:
            reasons.append("on battery")
        self.active, self.reasons = bool(reasons), reasons

    def background_cap(self, budget: int | None, n_batch: int) -> int | None:
        """The most background prompt tokens this iteration; None: no extra cap."""
        if not self.active:
            return None
        return max(1, math.floor(self.settings.factor * (n_batch if budget is None else budget)))

    def snapshot(self) -> dict[str, Any]:
        return {"active": self.active, "reasons": list(self.reasons)}
