"""One completed (or failed) iteration as the results record it, on either engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgeprefill.runtime.core.plan import IterationTiming, Plan
from edgeprefill.runtime.core.request import Request


@dataclass  # not frozen: one is built every iteration (see core/plan.py)
class Iteration:
    """One line of iterations.jsonl."""

    t_start_s: float
    plan: Plan  # what ran (of a preempted iteration: the part it kept)
    timing: IterationTiming
    policy_state: dict[str, Any]
    finished: list[Request] = field(default_factory=list)
    error: str | None = None
    # Aborted part-way for a foreground arrival: prompt tokens kept (those in `plan`) and
    # lost, and the time from the arrival to the abort landing.
    preempted: dict[str, Any] | None = None
    save_s: float | None = None  # copying saved prefixes after it (not in any host time)
    restore_s: float | None = None  # restoring saved prefixes at admission before it
    # Its streamed tokens handed to a server's event loops after it (`api.handover`).
    handover: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        return {
            "t_start_s": self.t_start_s,
            "duration_s": self.timing.duration_s,
            "budget": self.plan.budget,
            "decision": self.plan.decision.record(),
            "n_decode": self.plan.n_decode,
            "n_decode_foreground": self.timing.n_decode_foreground,
            "n_decode_deferred": len(self.plan.deferred),
            "n_prefill": self.plan.n_prefill,
            "n_prefill_foreground": self.plan.n_prefill_foreground,
            "n_prefill_background": self.plan.n_prefill_background,
            # The forward pass's own composition, which the cost model is fitted to: a
            # prompt's last piece of one token is computed as a decode row.
            "rows_decode": self.timing.n_decode,
            "rows_prefill": self.timing.n_prefill,
            "n_chunks": self.timing.n_chunks,
            # which requests rode it, so a run can be traced request by request
            "decode": list(self.plan.decode),
            "prefill": dict(self.plan.prefill),
            "ctx_work": self.timing.ctx_work,
            "n_sampled": self.timing.n_sampled,
            "n_constrained": self.timing.n_constrained,
            "host_s": self.timing.host_s,
            "policy": self.policy_state,
            "error": self.error,
            **({"preempted": self.preempted} if self.preempted else {}),
            **({"save_s": self.save_s} if self.save_s is not None else {}),
            **({"restore_s": self.restore_s} if self.restore_s is not None else {}),
            **({"handover": self.handover} if self.handover is not None else {}),
        }


@dataclass  # not frozen: one is built every iteration (see core/plan.py)
class Advance:
    """What one call to a driver's `advance` produced: the iterations whose timing is
    complete (on vLLM with CUDA events an iteration's timing can arrive an iteration later than its
    tokens) and the requests that ended."""

    iterations: list[Iteration]
    finished: list[Request]
