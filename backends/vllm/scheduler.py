"""The budget policies inside vLLM's V1 scheduler, as a mixin over both of its schedulers.

Load by dotted name (`scheduler_cls`), because the engine core may run in another process:
`EdgeprefillScheduler` (synchronous scheduling, as on the CPU) or
`EdgeprefillAsyncScheduler` (async scheduling, the GPU default; a plain `Scheduler` there
loses the overlap). Used alone, e.g. `vllm serve --scheduler-cls ... --worker-cls ...`, the
policy comes from `--additional-config '{"edgeprefill": {"policy": "ppas:bcap=256,nth=2"}}'`
(with `"steps": PATH`, each completed step is written there); `engine.VllmEngine` installs
its own policy object instead.

The cap is aggregate: `Scheduler._reserve_prefill_lookahead` is called for every running
and waiting candidate right before vLLM's zero check, so clamping there limits the sum of
prompt tokens in a step without copying `schedule()` and without touching decodes (the
P-PAS authors' patch shrank the whole step's token budget, which caps decodes too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from edgeprefill.backends.vllm.steplog import StepLog, check_timed_worker
from edgeprefill.backends.vllm.steps import (
    TIMINGS_ATTR,
    CompletedStep,
    StepLedger,
    StepRecord,
    class_of,
    prompt_left,
)
from edgeprefill.runtime.core.budget import BackgroundCap, BudgetPolicy
from edgeprefill.runtime.core.plan import Decision, Plan, riders
from edgeprefill.runtime.core.planner import Planner
from edgeprefill.runtime.core.state import Candidate
from edgeprefill.runtime.core.steplimit import StepLimit
from edgeprefill.runtime.policies import parse_policy

if not hasattr(Scheduler, "_reserve_prefill_lookahead"):  # private API: checked at import
    raise ImportError(
        "this vLLM has no Scheduler._reserve_prefill_lookahead, where edgeprefill applies "
        "the prefill budget; install vLLM 0.32"
    )


def _left(req: Any, num_computed: int | None = None) -> int:
    computed = req.num_computed_tokens if num_computed is None else num_computed
    return prompt_left(req.num_tokens, req.num_output_tokens, computed)


def _outputs(req: Any) -> int:
    return int(req.num_output_tokens)


class BudgetMixin:
    """An adapter between vLLM's scheduler and the core's `Planner`: vLLM's queues become
    the planner's candidates, its decision becomes caps that `_reserve_prefill_lookahead`
    applies, and each completed step's timing goes back to it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.vllm_config  # type: ignore[attr-defined]
        extra = (config.additional_config or {}).get("edgeprefill", {})
        check_timed_worker(config.parallel_config)
        policy = parse_policy(extra.get("policy", "unlimited"))
        policy.check_ready()
        self.install(policy)
        # Until a driver installs its own policy (then it takes the completed steps).
        self._ep_sink: StepLog | None = StepLog(extra.get("steps"))

    def install(
        self,
        policy: BudgetPolicy,
        guard: BackgroundCap | None = None,
        clock: Callable[[], float] = time.perf_counter,
        step_limit: StepLimit | None = None,
    ) -> None:
        """Use this policy (and thermal guard) from the next step on; `clock` stamps steps.
        `step_limit` sizes documents-only steps: vLLM cannot stop a step a chat arrives in."""
        self.ep_planner = Planner(policy, guard, step_limit)
        self.ep_clock = clock
        old = getattr(self, "ep_ledger", None)
        if old is not None and old.waiting:
            raise RuntimeError("a new policy while steps still wait for their timing")
        self.ep_ledger = StepLedger(old.next_step if old is not None else 0)
        self.ep_completed: list[CompletedStep] = []
        self._ep_sink = None
        self._ep_left: int | None = None
        self._ep_bg_left: int | None = None
        self._ep_defer: tuple[str, ...] = ()  # background decodes this step leaves out
        self._ep_fg_floor = 0  # prompt tokens the first waiting chat gets, budget or not
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
                class_of(r.priority),
                r.num_computed_tokens,
                _left(r),
                r.arrival_time,
                target,
                admitted=admitted,
                admissible=admitted or self._ep_can_admit(r),
                ttft_slowdown=slowdown,
                output_left=r.max_tokens - r.num_output_tokens,
            )

        running = [candidate(r, True) for r in self.running]  # type: ignore[attr-defined]
        return running + [candidate(r, False) for r in self.waiting]  # type: ignore[attr-defined]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        t_start = self.ep_clock()
        n_batch = self.max_num_scheduled_tokens  # type: ignore[attr-defined]
        decision = self.ep_planner.decide(self._ep_candidates(), n_batch, time.time())
        self._ep_apply(decision)
        try:
            out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._ep_left = self._ep_bg_left = None
        if out.total_num_scheduled_tokens > 0:
            self.ep_ledger.add(self._ep_record(out, t_start, decision))
        return out

    def _ep_apply(self, decision: Decision) -> None:
        """The decision as the caps `_reserve_prefill_lookahead` applies this step."""
        decodes = [r for r in self.running if _left(r) == 0]  # type: ignore[attr-defined]
        background = [r for r in decodes if class_of(r.priority) == "background"]
        riding = {r.request_id for r in riders(background, decision, _outputs)}
        self._ep_defer = tuple(r.request_id for r in background if r.request_id not in riding)
        self._ep_fg_floor = decision.floor or 0
        self._ep_left, self._ep_bg_left = decision.budget, decision.background_cap
        if decision.foreground_alone:
            held = self._ep_foreground_first(decision.budget, len(decodes) - len(self._ep_defer))
            if held is not None:
                bg = self._ep_bg_left
                self._ep_bg_left = held if bg is None else min(bg, held)

    def _ep_foreground_first(self, budget: int | None, n_decode: int) -> int | None:
        """The most background prompt tokens this step while foreground prompt work waits:
        what the budget (or the step's room) leaves after it. vLLM schedules running
        requests before waiting ones whatever their priority, so without this a chat that
        arrives while documents are being read would wait for their whole prompts; the
        llama.cpp scheduler serves foreground prompts first, and so does this one."""
        running = [r for r in self.running if class_of(r.priority) == "foreground"]  # type: ignore[attr-defined]
        waiting = [r for r in self.waiting if class_of(r.priority) == "foreground"]  # type: ignore[attr-defined]
        pending = sum(_left(r) for r in running)
        if waiting and self._ep_can_admit(min(waiting, key=lambda r: r.arrival_time)):
            pending += sum(_left(r) for r in waiting)
        if pending == 0:
            return None
        # With no budget, no background prompt work rides beside a chat's prompt (as on
        # llama.cpp); with one, background gets what the foreground leaves of it.
        if budget is None:
            return 0
        room = self.max_num_scheduled_tokens - n_decode  # type: ignore[attr-defined]
        return max(min(budget, room) - pending, 0)

    def _ep_can_admit(self, request: Any) -> bool:
        """Whether a waiting request has a sequence slot and KV blocks now: holding
        background work back for one that cannot be admitted would stall both."""
        if len(self.running) >= self.max_num_running_reqs:  # type: ignore[attr-defined]
            return False
        pool = self.kv_cache_manager.block_pool  # type: ignore[attr-defined]
        return pool.get_num_free_blocks() * self.block_size > _left(request)  # type: ignore[attr-defined]

    def _reserve_prefill_lookahead(self, request: Any, num_computed: int, num_new: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed, num_new)  # type: ignore[misc]
        prompt = min(n, _left(request, num_computed))
        if prompt == 0:  # a decode: never capped, but a background one may be deferred
            return 0 if request.request_id in self._ep_defer else n
        if self._ep_left is None and self._ep_bg_left is None:
            return n  # no cap this step
        background = class_of(request.priority) == "background"
        allowed = prompt if self._ep_left is None else min(prompt, self._ep_left)
        if not background and self._ep_fg_floor:  # sized by its TTFT target
            allowed = max(allowed, min(prompt, self._ep_fg_floor))
            self._ep_fg_floor = 0
        if background and self._ep_bg_left is not None:
            allowed = min(allowed, self._ep_bg_left)
        # Charged now, before vLLM allocates KV blocks: a candidate that then cannot be
        # allocated leaves the step below the cap, never above it.
        if self._ep_left is not None:
            self._ep_left = max(self._ep_left - allowed, 0)
        if background and self._ep_bg_left is not None:
            self._ep_bg_left -= allowed
        return allowed

    def _ep_record(self, out: Any, t_start: float, decision: Decision) -> StepRecord:
        decode: list[str] = []
        prefill: dict[str, int] = {}
        classes: dict[str, str] = {}
        by_class = {"foreground": 0, "background": 0}
        ctx_work = n_sampled = 0
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]  # type: ignore[attr-defined]
            before = req.num_computed_tokens - n  # vLLM advanced it when it scheduled
            cls = classes[rid] = class_of(req.priority)
            prompt = min(n, _left(req, before))
            ctx_work += n * before + n * (n + 1) // 2
            if prompt == 0:
                decode.append(rid)
                n_sampled += 1
                continue
            prefill[rid] = prompt
            by_class[cls] += prompt
            n_sampled += before + n >= req.num_tokens  # the chunk ends the prompt: samples
        deferred = tuple(r for r in self._ep_defer if r not in out.num_scheduled_tokens)
        plan = Plan(decision, tuple(decode), prefill, deferred)
        return StepRecord(
            self.ep_ledger.next_step, t_start, plan, classes, ctx_work, n_sampled, by_class
        )

    # --- after the step ---------------------------------------------------------------
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        for reading in getattr(model_runner_output, TIMINGS_ATTR, None) or ():
            record = self.ep_ledger.match(reading.step, reading.tokens)
            timing = record.timing(reading.duration_s)
            self.ep_planner.observe(timing)
            step = CompletedStep(record, timing, self.ep_planner.snapshot())
            if self._ep_sink is None:
                self.ep_completed.append(step)
            else:
                self._ep_sink(step)
        return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]

    def take_completed(self) -> list[CompletedStep]:
        """Steps whose timing arrived since the last call, in step order."""
        done, self.ep_completed = self.ep_completed, []
        return done


class EdgeprefillScheduler(BudgetMixin, Scheduler):
    """vLLM's synchronous scheduler with the budget policy."""


class EdgeprefillAsyncScheduler(BudgetMixin, AsyncScheduler):
    """vLLM's async scheduler with the budget policy (readings arrive a step late)."""
