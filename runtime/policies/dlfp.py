"""DLFP (Decode-Latency Feedback Prefill), eq. 2 of the paper, fed completed time.

Only when a decode is active and a prefill shares the iteration (a guarded cycle) the cap
moves proportionally: c <- clamp(floor_q(c * T / L), c_min, c_max), with L the *completed*
duration of that iteration. The paper fed it the host scheduler's interval, which stopped
tracking device work on larger GPUs; here L is measured where the work finishes. With no
decode active the cap resets to c_initial and prefill is not capped at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.plan import IterationTiming, SchedState
from edgeprefill.runtime.policies.registry import POLICIES


@POLICIES.register("dlfp")
@dataclass
class DLFPPolicy(BudgetPolicy):
    """The paper used T=80 ms and q=128 on an A100; unset values come from the device
    profile: T its interactive target, c_initial the chunk predicted at T, q a quarter of
    it (at least the backend's smallest invariant chunk), c_min=q, c_max=n_batch."""

    name: ClassVar[str] = "dlfp"
    required: ClassVar[dict[str, str]] = {
        "c_initial": "c_initial (dlfp:c_initial=N)",
        "target_ms": "target_ms (dlfp:target_ms=MS)",
        "quantum": "quantum (dlfp:quantum=N)",
        "c_min": "c_min (dlfp:c_min=N)",
        "c_max": "c_max (dlfp:c_max=N)",
    }
    target_ms: float | None = None
    c_initial: int | None = None
    c_min: int | None = None
    c_max: int | None = None
    quantum: int | None = None
    _c: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.target_ms is not None and self.target_ms <= 0:
            raise ValueError(f"target_ms must be positive, got {self.target_ms}")
        for key in ("c_initial", "c_min", "c_max", "quantum"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be at least 1, got {value}")

    def calibrate(self, profile: DeviceProfile) -> None:
        if self.target_ms is None:
            self.target_ms = profile.target_s * 1000
        if self.c_initial is None:
            self.c_initial = profile.chunk_for(self.target_ms / 1000)
        if self.quantum is None:
            self.quantum = max(profile.min_chunk, self.c_initial // 4)
        if self.c_min is None:
            self.c_min = self.quantum
        if self.c_max is None:
            self.c_max = profile.n_batch

    def budget(self, state: SchedState) -> int | None:
        if state.n_decode == 0:
            self._c = self._need(self.c_initial, "c_initial")
            return None  # isolated prefill is never capped
        if self._c is None:
            self._c = self._need(self.c_initial, "c_initial")
        return self._c

    def reason(self, state: SchedState, budget: int | None) -> str:
        if budget is None:
            return "no decode running: isolated prefill is not capped"
        return "cap after the last guarded cycle's feedback"

    def observe(self, timing: IterationTiming) -> None:
        if timing.n_decode == 0 or timing.n_prefill == 0 or self._c is None:
            return  # not a guarded cycle
        target = self._need(self.target_ms, "target_ms") / 1000
        q = self._need(self.quantum, "quantum")
        scaled = math.floor(self._c * target / timing.duration_s / q) * q
        lo, hi = self._need(self.c_min, "c_min"), self._need(self.c_max, "c_max")
        self._c = min(max(scaled, lo), hi)

    def params(self) -> dict[str, Any]:
        return {
            k: getattr(self, k) for k in ("target_ms", "c_initial", "c_min", "c_max", "quantum")
        }

    def snapshot(self) -> dict[str, Any]:
        return {"c": self._c}
