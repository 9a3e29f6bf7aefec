"""The fixed budgets: a static chunk size, and no cap at all."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.plan import SchedState
from edgeprefill.runtime.policies.registry import POLICIES


@POLICIES.register("static")
@dataclasses.dataclass
class StaticPolicy(BudgetPolicy):
    """A fixed cap of `tokens` prompt tokens per iteration (chunked prefill's chunk size)."""

    name: ClassVar[str] = "static"
    tokens: int = 64

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"tokens must be at least 1, got {self.tokens}")

    def budget(self, state: SchedState) -> int | None:
        return self.tokens

    def reason(self, state: SchedState, budget: int | None) -> str:
        return f"a fixed {self.tokens}-token chunk"


@POLICIES.register("unlimited")
@dataclasses.dataclass
class UnlimitedPolicy(BudgetPolicy):
    """No cap: prompts fill whatever `n_batch` leaves after the decodes, as llama.cpp's
    own server does (and vLLM schedules as it would without edgeprefill)."""

    name: ClassVar[str] = "unlimited"
    caps: ClassVar[bool] = False

    def budget(self, state: SchedState) -> int | None:
        return None

    def reason(self, state: SchedState, budget: int | None) -> str:
        return "no cap: the backend batches as it would alone"
