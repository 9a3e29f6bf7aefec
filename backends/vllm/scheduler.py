"""The budget policies inside vLLM's V1 scheduler, as a mixin over both of its schedulers.

Load by dotted name (`scheduler_cls`), because the engine core may run in another process:
`EdgeprefillScheduler` (synchronous scheduling, as on the CPU) or
`EdgeprefillAsyncScheduler` (async scheduling, the GPU default; a plain `Scheduler` there
loses the overlap). Used alone, e.g. `vllm serve --scheduler-cls ... --worker-cls ...`, the
policy comes from `--additional-config '{"edgeprefill": {"policy": "ppas:bcap=256,nth=2"}}'`
(with `"steps": PATH`, each completed step is written there); `engine.VllmEngine` installs
its own policy object instead.

The step's plan is the core's (`make_plan`, as on llama.cpp); vLLM carries it out:
`Scheduler._reserve_prefill_lookahead` is called for every running and waiting candidate
right before vLLM's zero check, so granting each request its planned prompt tokens there
bounds the step without copying `schedule()` and without touching decodes (the P-PAS
authors' patch shrank the whole step's token budget, which caps decodes too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from edgeprefill.backends.vllm.iteration_log import IterationLog, check_timed_worker
from edgeprefill.backends.vllm.iterations import (
    TIMINGS_ATTR,
    CompletedIteration,
    IterationLedger,
    IterationRecord,
    class_of,
    prompt_left,
)
from edgeprefill.runtime.core.budget import BackgroundCap, BudgetPolicy
from edgeprefill.runtime.core.candidate import Candidate
from edgeprefill.runtime.core.contract import ctx_work
from edgeprefill.runtime.core.costs.iteration_limit import IterationLimit
from edgeprefill.runtime.core.plan import Plan
from edgeprefill.runtime.core.planner import Planner
from edgeprefill.runtime.core.planning import Chunking, make_plan
from edgeprefill.runtime.policies import parse_policy

if not hasattr(Scheduler, "_reserve_prefill_lookahead"):  # private API: checked at import
    raise ImportError(
        "this vLLM has no Scheduler._reserve_prefill_lookahead, where edgeprefill applies "
        "the prefill budget; install vLLM 0.32"
    )


def _left(req: Any, num_computed: int | None = None) -> int:
    computed = req.num_computed_tokens if num_computed is None else num_computed
    return prompt_left(req.num_tokens, req.num_output_tokens, computed)


# The mixin is checked as the vLLM scheduler it is mixed into.
if TYPE_CHECKING:
    _SchedulerBase = Scheduler
else:
    _SchedulerBase = object


class BudgetMixin(_SchedulerBase):
    """An adapter between vLLM's scheduler and the core's `Planner`: vLLM's queues become
    the planner's candidates, its decision the core's plan, whose grants
    `_reserve_prefill_lookahead` applies, and each completed step's timing goes back to it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.vllm_config
        extra = config.additional_config  # a dict, or an object of a plugin's own
        extra = extra.get("edgeprefill", {}) if isinstance(extra, dict) else {}
        check_timed_worker(config.parallel_config)
        policy = parse_policy(extra.get("policy", "unlimited"))
        policy.check_ready()
        self.install(policy)
        # Until a driver installs its own policy (then it takes the completed steps).
        self._ep_sink: IterationLog | None = IterationLog(extra.get("steps"))

    def install(
        self,
        policy: BudgetPolicy,
        guard: BackgroundCap | None = None,
        clock: Callable[[], float] = time.perf_counter,
        iteration_limit: IterationLimit | None = None,
    ) -> None:
        """Use this policy (and thermal guard) from the next step on; `clock` stamps steps.
        `iteration_limit` sizes documents-only steps: vLLM cannot stop a step a chat arrives in."""
        self.ep_planner = Planner(policy, guard, iteration_limit)
        self.ep_clock = clock
        old = getattr(self, "ep_ledger", None)
        if old is not None and old.waiting:
            raise RuntimeError("a new policy while steps still wait for their timing")
        self.ep_ledger = IterationLedger(old.next_step if old is not None else 0)
        self.ep_completed: list[CompletedIteration] = []
        self._ep_sink = None
        # This step's plan as vLLM applies it: prompt tokens granted by request id (None:
        # vLLM's own batching), and the background decodes it leaves out.
        self._ep_grant: dict[str, int] | None = None
        self._ep_defer: frozenset[str] = frozenset()
        # The engine's requests' first-token targets (absolute, relative), by vLLM's id.
        self.ep_ttft_targets: dict[str, tuple[float | None, float | None]] = getattr(
            self, "ep_ttft_targets", {}
        )

    # --- before the step --------------------------------------------------------------
    def _ep_candidates(self) -> list[Candidate]:
        """vLLM's running and waiting requests as the planner sees requests (vLLM stamps
        `arrival_time` with the wall clock, so the planner is asked at `time.time()`)."""

        def candidate(r: Any, admitted: bool) -> Candidate:
            target, slowdown = self.ep_ttft_targets.get(r.request_id, (None, None))
            return Candidate(
                r.request_id,
                class_of(r.priority),
                r.num_computed_tokens,
                _left(r),
                r.arrival_time,
                target,
                admitted=admitted,
                admissible=admitted or self._ep_can_admit(r),
                ttft_slowdown=slowdown,
                output_left=r.max_tokens - r.num_output_tokens,
                constrained=r.use_structured_output,
                outputs=r.num_output_tokens,
            )

        running = [candidate(r, True) for r in self.running]
        return running + [candidate(r, False) for r in self.waiting]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        t_start = self.ep_clock()
        n_batch = self.max_num_scheduled_tokens
        candidates = self._ep_candidates()
        decision = self.ep_planner.decide(candidates, n_batch, time.time())
        # The running requests and the waiting ones that can be admitted now. vLLM
        # schedules running requests before waiting ones whatever their priority; the
        # plan puts a waiting chat's prompt before a running document's, as on llama.cpp.
        rows = [c for c in candidates if c.admitted or c.admissible]
        plan = make_plan(decision, rows, Chunking(n_batch))
        self._ep_defer = frozenset(plan.deferred)
        self._ep_grant = dict(plan.prefill) if decision.constrains else None
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self._ep_grant, self._ep_defer = None, frozenset()
        if out.total_num_scheduled_tokens > 0:
            self.ep_ledger.add(self._ep_record(out, t_start, plan))
        return out

    def _ep_can_admit(self, request: Any) -> bool:
        """Whether a waiting request has a sequence slot and KV blocks now: holding
        background work back for one that cannot be admitted would stall both."""
        if len(self.running) >= self.max_num_running_reqs:
            return False
        pool = self.kv_cache_manager.block_pool
        return pool.get_num_free_blocks() * self.block_size > _left(request)

    def _reserve_prefill_lookahead(self, request: Any, num_computed: int, num_new: int) -> int:
        """vLLM's tokens for `request` this step, within what the plan granted it (charged
        now, before vLLM allocates KV blocks: a request that then cannot be allocated
        leaves the step below the plan, never above it)."""
        n = super()._reserve_prefill_lookahead(request, num_computed, num_new)
        rid = request.request_id
        prompt = min(n, _left(request, num_computed))
        if prompt == 0:  # a decode: never capped, but a background one may be deferred
            return 0 if rid in self._ep_defer else n
        if self._ep_grant is None:
            return n
        allowed = min(prompt, self._ep_grant.get(rid, 0))
        self._ep_grant[rid] = self._ep_grant.get(rid, 0) - allowed
        return allowed

    def _ep_record(self, out: Any, t_start: float, planned: Plan) -> IterationRecord:
        """What vLLM scheduled of the plan (a request it could not allocate, or a prefix it
        found cached, leaves less)."""
        decode: list[str] = []
        prefill: dict[str, int] = {}
        foreground: set[str] = set()
        ctx = n_sampled = 0
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            before = req.num_computed_tokens - n  # vLLM advanced it when it scheduled
            prompt = min(n, _left(req, before))
            ctx += ctx_work(n, before)
            if class_of(req.priority) == "foreground":
                foreground.add(rid)
            if prompt == 0:
                decode.append(rid)
                n_sampled += 1
                continue
            prefill[rid] = prompt
            n_sampled += before + n >= req.num_tokens  # the chunk ends the prompt: samples
        deferred = tuple(r for r in planned.deferred if r not in out.num_scheduled_tokens)
        plan = Plan(planned.decision, tuple(decode), prefill, deferred, foreground)
        return IterationRecord(self.ep_ledger.next_step, t_start, plan, ctx, n_sampled)

    # --- after the step ---------------------------------------------------------------
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        for reading in getattr(model_runner_output, TIMINGS_ATTR, None) or ():
            record = self.ep_ledger.match(reading.step, reading.tokens)
            timing = record.timing(reading.duration_s)
            self.ep_planner.observe(timing)
            step = CompletedIteration(record, timing, self.ep_planner.snapshot())
            if self._ep_sink is None:
                self.ep_completed.append(step)
            else:
                self._ep_sink(step)
        return super().update_from_output(scheduler_output, model_runner_output)

    def take_completed(self) -> list[CompletedIteration]:
        """Steps whose timing arrived since the last call, in step order."""
        done, self.ep_completed = self.ep_completed, []
        return done


class EdgeprefillScheduler(BudgetMixin, Scheduler):
    """vLLM's synchronous scheduler with the budget policy."""


class EdgeprefillAsyncScheduler(BudgetMixin, AsyncScheduler):
    """vLLM's async scheduler with the budget policy (readings arrive a step late)."""
