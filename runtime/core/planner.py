"""One decision per iteration, the same on both engines.

The runtime's `Engine` and the vLLM scheduler adapter each describe their requests as
`Candidate`s and ask the `Planner`; it builds the state, asks the policy once, lets the
thermal guard cap the background's share, bounds how long background decodes wait and, on a
backend that cannot stop a step, how long a documents-only step runs (`StepLimit`). What
each engine then does with the `Decision` (the runtime's `Scheduler.plan`, or vLLM's
`_reserve_prefill_lookahead`) is the only part that differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from edgeprefill.runtime.core.budget import BackgroundCap, BudgetPolicy
from edgeprefill.runtime.core.plan import Decision, IterationTiming, SchedState
from edgeprefill.runtime.core.state import Candidate, sched_state
from edgeprefill.runtime.core.steplimit import StepLimit

# The most iterations in a row background decodes may be left out of, so a document's
# summary always progresses.
MAX_DEFERRED = 8


class Planner:
    def __init__(
        self,
        policy: BudgetPolicy,
        guard: BackgroundCap | None = None,
        step_limit: StepLimit | None = None,  # on a backend that cannot stop a step
    ) -> None:
        self.policy = policy
        self.guard = guard
        self.step_limit = step_limit
        self.last: IterationTiming | None = None  # the latest completed iteration
        self._deferred_run = 0  # decisions in a row that deferred background decodes

    def state(self, candidates: Sequence[Candidate], n_batch: int, now_s: float) -> SchedState:
        may_defer = self._deferred_run < MAX_DEFERRED
        return sched_state(candidates, n_batch, self.last, now_s, may_defer)

    def decide(self, candidates: Sequence[Candidate], n_batch: int, now_s: float) -> Decision:
        """Called once before each iteration is planned."""
        state = self.state(candidates, n_batch, now_s)
        decision = self.policy.decide(state)
        if decision.defers_background_decodes and not self._may_defer(state):
            decision = replace(decision, background_decodes=None)
        self._deferred_run = self._deferred_run + 1 if decision.defers_background_decodes else 0
        if self.guard is not None:
            self.guard.update()
            cap = self.guard.background_cap(decision.budget, n_batch)
            decision = replace(decision, background_cap=cap)
        return self._limit_step(decision, state)

    def _limit_step(self, decision: Decision, state: SchedState) -> Decision:
        cap = self.step_limit.cap(state) if self.step_limit is not None else None
        if cap is None or (decision.background_cap is not None and decision.background_cap <= cap):
            return decision
        reason = f"{decision.reason}; a step that cannot be stopped sized for a chat's wait"
        return replace(decision, background_cap=cap, reason=reason)

    @staticmethod
    def _may_defer(state: SchedState) -> bool:
        """Background decodes wait only for the foreground's sake (a foreground decode or
        prompt in the same iteration), so an iteration is never left empty, and never more
        than MAX_DEFERRED iterations in a row."""
        foreground = state.n_decode_foreground or state.foreground_prompt_left
        return bool(state.may_defer and state.n_decode_background and foreground)

    def observe(self, timing: IterationTiming) -> None:
        """Called once per completed iteration, with the time of the finished work."""
        self.policy.observe(timing)
        self.last = timing

    def snapshot(self) -> dict[str, Any]:
        """The policy's (and thermal guard's) state after an iteration, for its record."""
        state = self.policy.snapshot()
        if self.guard is not None:
            state = {**state, "thermal": self.guard.snapshot()}
        return state
