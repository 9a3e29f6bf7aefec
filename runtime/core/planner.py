"""One decision per iteration, the same on both engines.

Each engine lists its requests as `Candidate`s (`candidate`); `sched_state` turns them
into the one `SchedState`, so a policy decides from the same facts on both. The `Planner`
builds that state, asks the policy once, lets the thermal guard cap the background's share,
bounds how long background decodes wait and, on a backend that cannot stop an iteration, how
long a documents-only iteration runs (`IterationLimit`). `planning.make_plan` then turns the `Decision`
into the iteration's `Plan`, again the same on both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from edgeprefill.runtime.core.budget import BackgroundCap, BudgetPolicy
from edgeprefill.runtime.core.candidate import Candidate, prompt_order
from edgeprefill.runtime.core.costs.iteration_limit import IterationLimit
from edgeprefill.runtime.core.plan import Decision, IterationTiming, SchedState


def sched_state(
    candidates: Sequence[Candidate],
    n_batch: int,
    last: IterationTiming | None,
    now_s: float,
    may_defer: bool = True,
) -> SchedState:
    """One pass over the candidates (planning runs between two device calls, where a
    chat's next token waits)."""
    n_running = n_waiting = n_decode = n_decode_foreground = decode_ctx = decode_ctx_foreground = 0
    n_prompts_foreground = n_constrained = n_constrained_foreground = 0
    ends: int | None = None  # the fewest tokens a foreground decode may still generate
    for c in candidates:
        n_prompts_foreground += c.cls == "foreground" and c.prompt_left > 0
        if not c.admitted:
            n_waiting += 1
        elif c.prompt_left:
            n_running += 1
        else:
            n_decode += 1
            decode_ctx += c.computed + 1
            n_constrained += c.constrained
            if c.cls == "foreground":
                n_decode_foreground += 1
                decode_ctx_foreground += c.computed + 1
                n_constrained_foreground += c.constrained
                if c.output_left is not None and (ends is None or c.output_left < ends):
                    ends = c.output_left
    head = next(prompt_order(candidates), None)
    # the foreground prompt next in line, if a foreground one is next
    lead = head if head is not None and head.cls == "foreground" else None
    return SchedState(
        n_prompts_running=n_running,
        n_prompts_waiting=n_waiting,
        n_decode=n_decode,
        n_decode_foreground=n_decode_foreground,
        n_batch=n_batch,
        last=last,
        decode_ctx=decode_ctx,
        next_prompt_pos=head.computed if head is not None else 0,
        next_prompt_left=head.prompt_left if head is not None else 0,
        decode_ctx_foreground=decode_ctx_foreground,
        foreground_prompt_left=lead.prompt_left if lead is not None else 0,
        foreground_prompt_pos=lead.computed if lead is not None else 0,
        foreground_waited_s=max(now_s - lead.arrival_s, 0.0) if lead is not None else 0.0,
        foreground_ttft_target_s=lead.ttft_target_s if lead is not None else None,
        foreground_ttft_slowdown=lead.ttft_slowdown if lead is not None else None,
        foreground_prompts_behind=max(n_prompts_foreground - 1, 0) if lead is not None else 0,
        foreground_decode_ends=ends,
        may_defer=may_defer,
        n_constrained=n_constrained,
        n_constrained_foreground=n_constrained_foreground,
    )


# The most iterations in a row background decodes may be left out of, so a document's
# summary always progresses.
MAX_DEFERRED = 8


class Planner:
    def __init__(
        self,
        policy: BudgetPolicy,
        guard: BackgroundCap | None = None,
        iteration_limit: IterationLimit | None = None,  # on a backend that cannot stop one
    ) -> None:
        self.policy = policy
        self.guard = guard
        self.iteration_limit = iteration_limit
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
        return self._limit_iteration(decision, state)

    def _limit_iteration(self, decision: Decision, state: SchedState) -> Decision:
        cap = self.iteration_limit.cap(state) if self.iteration_limit is not None else None
        if cap is None or (decision.background_cap is not None and decision.background_cap <= cap):
            return decision
        reason = f"{decision.reason}; an iteration that cannot be stopped sized for a chat's wait"
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
