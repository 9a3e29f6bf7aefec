"""P-PAS (Prefill-Pressure Adaptive Scheduling), Algorithm 1 of the paper.

N_p = running + waiting prefills, N_d = running decodes. If N_p >= N_th and N_d > 0 the
iteration's aggregate prefill tokens are capped at B_cap, otherwise at B_max. Re-evaluated
every iteration, so the large budget returns as soon as the pressure subsides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.plan import SchedState
from edgeprefill.runtime.policies.registry import POLICIES


@POLICIES.register("ppas")
@dataclass
class PPASPolicy(BudgetPolicy):
    """The paper used N_th=2, B_max=16k, B_cap=2k on GPUs; here B_max defaults to no cap
    (the whole batch) and B_cap to the chunk the device profile predicts at its target."""

    name: ClassVar[str] = "ppas"
    required: ClassVar[dict[str, str]] = {"bcap": "bcap (ppas:bcap=N)"}
    nth: int = 2
    bmax: int | None = None  # None: no cap beyond n_batch
    bcap: int | None = None  # None: from the device profile
    _capped: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.nth < 1:
            raise ValueError(f"nth must be at least 1, got {self.nth}")
        for key in ("bmax", "bcap"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be at least 1, got {value}")
        if self.bmax is not None and self.bcap is not None and self.bcap > self.bmax:
            raise ValueError(f"bcap ({self.bcap}) must not exceed bmax ({self.bmax})")

    def calibrate(self, profile: DeviceProfile) -> None:
        if self.bcap is None:
            self.bcap = profile.chunk_for()

    def budget(self, state: SchedState) -> int | None:
        n_p = state.n_prompts_running + state.n_prompts_waiting
        self._capped = n_p >= self.nth and state.n_decode > 0
        return self._need(self.bcap, "bcap") if self._capped else self.bmax

    def reason(self, state: SchedState, budget: int | None) -> str:
        n_p = state.n_prompts_running + state.n_prompts_waiting
        if self._capped:
            return f"{n_p} prefills (nth={self.nth}) beside {state.n_decode} decodes: bcap"
        return "bmax: " + ("no decode running" if n_p >= self.nth else f"{n_p} prefills")

    def params(self) -> dict[str, Any]:
        return {"nth": self.nth, "bmax": self.bmax, "bcap": self.bcap}

    def snapshot(self) -> dict[str, Any]:
        return {"capped": self._capped}
