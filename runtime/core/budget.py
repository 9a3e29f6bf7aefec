"""The policy seam: what chooses each iteration's prefill budget, and what may cap the
background's share of it (the thermal guard), as the engine sees them.

A policy sees only `SchedState` and completed `IterationTiming`s and imports nothing from a
backend, so the same objects run under llama.cpp and vLLM (where they run inside vLLM's
engine-core process with the core alone).
"""

from __future__ import annotations

import dataclasses
from abc import ABC
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.plan import Decision, IterationTiming, SchedState

if TYPE_CHECKING:
    from edgeprefill.runtime.core.costs.profile import DeviceProfile


class BudgetPolicy(ABC):
    """Decides each iteration's prompt-token budget, and what goes with it.

    `decide` is called once before each iteration is planned, `observe` once after it
    completed, with the time of the finished work. A rule that only sets a budget
    implements `budget`; a policy that also sizes a chat's prompt or defers background
    decodes (cadence) overrides `decide` and works its answer out once.
    """

    name: ClassVar[str]
    # False for a policy that never caps: then the backend schedules as it would without
    # edgeprefill (no chat prompt served alone where no budget applies; on vLLM, vLLM's
    # own order), which is the baseline the capping policies are compared with.
    caps: ClassVar[bool] = True
    # True for the policies a new one is measured against (the papers', the fixed ones):
    # `compare` and `sweep` give ratios against them by default.
    baseline: ClassVar[bool] = True
    # Parameters that must be set (by the user, or by `calibrate` from a device profile)
    # before the first iteration: attribute -> what to tell a user who left it unset.
    required: ClassVar[dict[str, str]] = {}

    def decide(self, state: SchedState) -> Decision:
        """This iteration's decision: the budget `budget` gives, for the iteration as it
        will run (without the background's decodes when a chat's prompt defers them)."""
        defer = self.prompt_defers(state)
        seen = state.without_background_decodes() if defer else state
        budget = self.budget(seen)
        return Decision(
            budget,
            background_decodes=0 if defer else None,
            foreground_alone=self.caps,
            reason=self.reason(seen, budget),
        )

    def budget(self, state: SchedState) -> int | None:
        """The iteration's prompt-token cap (None: no cap beyond n_batch)."""
        raise NotImplementedError(f"policy {self.name} implements neither decide nor budget")

    def reason(self, state: SchedState, budget: int | None) -> str:
        """Why `budget` gave what it gave, in a few words."""
        return self.name

    def prompt_defers(self, state: SchedState) -> bool:
        """Background decodes wait while a chat's prompt computes, for any policy that
        caps: its first token waits for every row beside it (~30 ms each on a small
        model), and a document's summary loses one token's time."""
        return bool(
            self.caps
            and state.may_defer
            and state.n_decode_background
            and state.foreground_prompt_left
        )

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

    @property
    def spec(self) -> str:
        """This policy as `--policy` spells it, with the parameters it runs with (a policy
        built in code has no spec of its own; results name it by this)."""
        params = ",".join(f"{k}={v}" for k, v in self.params().items() if v is not None)
        return f"{self.name}:{params}" if params else self.name


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
