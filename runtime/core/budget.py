"""The policy seam: what chooses each iteration's prefill budget, and what may cap the
background's share of it (the thermal guard), as the engine sees them.

A policy sees only `SchedState` and completed `IterationTiming`s and imports nothing from a
backend, so the same objects run under llama.cpp and vLLM (where they run inside vLLM's
engine-core process with the core alone).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.plan import IterationTiming, SchedState

if TYPE_CHECKING:
    from edgeprefill.runtime.core.profile import DeviceProfile


class BudgetPolicy(ABC):
    """Chooses the iteration's aggregate prefill-token cap.

    `budget` is called once before each iteration is planned; `observe` once after it
    completed, with the time of the finished work. `None` means no cap beyond `n_batch`.
    """

    name: ClassVar[str]
    # False for a policy that never caps: then the backend schedules as it would without
    # edgeprefill (no chat prompt served alone where no budget applies; on vLLM, vLLM's
    # own order), which is the baseline the capping policies are compared with.
    caps: ClassVar[bool] = True
    # Parameters that must be set (by the user, or by `calibrate` from a device profile)
    # before the first iteration: attribute -> what to tell a user who left it unset.
    required: ClassVar[dict[str, str]] = {}

    @abstractmethod
    def budget(self, state: SchedState) -> int | None: ...

    def defer_background_decodes(self, state: SchedState) -> bool:
        """Whether this iteration should leave the background's decodes out (a summary's
        token costs as much as a chat's, and can push a chat's token over its target).
        Asked only while a foreground decode is running, before `budget`, which then sees
        the state without them. The scheduler bounds how long one can be deferred."""
        return False

    def foreground_chunk(self, state: SchedState) -> int | None:
        """The least prompt tokens the first waiting foreground prompt should get this
        iteration to meet its TTFT target, budget or not (None: the budget decides). Asked
        only while one waits (`state.foreground_prompt_left > 0`)."""
        return None

    def observe(self, timing: IterationTiming) -> None:
        """Learn from a completed iteration; stateless policies ignore it."""

    def calibrate(self, profile: DeviceProfile) -> None:
        """Fill the parameters the user left unset from the device's measured profile.
        Called once, before the first iteration."""

    def check_ready(self) -> None:
        """Called by the engine before the first iteration: a missing parameter is the
        user's to fix, reported when the run starts rather than from inside `budget`."""
        missing = [what for attr, what in self.required.items() if getattr(self, attr) is None]
        if missing:
            raise UserError(
                f"policy {self.name} has no {', '.join(missing)}: set it in the policy spec "
                f"or give the engine a device profile to take it from"
            )

    def _need(self, value: Any, what: str) -> Any:
        """A required parameter, for the type checker: `check_ready` ran, so it is set."""
        if value is None:
            raise RuntimeError(f"policy {self.name} used before check_ready: no {what}")
        return value

    def params(self) -> dict[str, Any]:
        """The parameters the policy runs with, for summary.json."""
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}

    def snapshot(self) -> dict[str, Any]:
        """The policy's own state after an iteration, for iterations.jsonl."""
        return {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.params()}


class BackgroundCap(Protocol):
    """Scales the background's prompt tokens down for a reason outside the scheduler (the
    device throttling, running hot or on battery); `thermal.guard.ThermalGuard` is one."""

    def update(self) -> None:
        """Read the latest telemetry; called once before each iteration is planned."""
        ...

    def background_cap(self, budget: int | None, n_batch: int) -> int | None:
        """The most background prompt tokens this iteration (None: no further cap)."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Its state, for iterations.jsonl."""
        ...
