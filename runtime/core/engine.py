"""The engine: one iteration is plan, execute, observe, update, record.

This is also the embedding API: a desktop assistant creates an `Engine` over a backend and a
policy, `add()`s requests as they come, and calls `step()` in its own loop.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from edgeprefill.runtime.core.budget import BackgroundCap, BudgetPolicy
from edgeprefill.runtime.core.contract import (
    Backend,
    BackendError,
    SeqWork,
    StepResult,
    timing_of,
)
from edgeprefill.runtime.core.plan import IterationTiming, Plan
from edgeprefill.runtime.core.profile import DeviceProfile
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.core.scheduler import BackgroundLimits, Scheduler


class RunClock:
    """Seconds since the run started; every timestamp in a run's results uses it."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@dataclass(frozen=True)
class Iteration:
    """One completed (or failed) iteration, as written to iterations.jsonl."""

    t_start_s: float
    plan: Plan
    timing: IterationTiming
    prefill_by_class: dict[str, int]
    policy_state: dict[str, Any]
    finished: list[Request] = field(default_factory=list)
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> its new token
    error: str | None = None
    # Aborted part-way for a foreground arrival: prompt tokens kept (those in `plan`) and
    # lost, and the time from the arrival to the abort landing.
    preempted: dict[str, Any] | None = None
    save_s: float | None = None  # copying saved prefixes after it (not in any host time)

    def record(self) -> dict[str, Any]:
        return {
            "t_start_s": self.t_start_s,
            "duration_s": self.timing.duration_s,
            "budget": self.plan.budget,
            "background_cap": self.plan.background_cap,
            "n_decode": self.plan.n_decode,
            "n_decode_foreground": self.timing.n_decode_foreground,
            "n_decode_deferred": len(self.plan.deferred),
            "foreground_floor": self.plan.foreground_floor,
            "n_prefill": self.plan.n_prefill,
            "n_prefill_foreground": self.prefill_by_class.get("foreground", 0),
            "n_prefill_background": self.prefill_by_class.get("background", 0),
            "n_chunks": self.timing.n_chunks,
            "ctx_work": self.timing.ctx_work,
            "n_sampled": self.timing.n_sampled,
            "host_s": self.timing.host_s,
            "policy": self.policy_state,
            "error": self.error,
            **({"preempted": self.preempted} if self.preempted else {}),
            **({"save_s": self.save_s} if self.save_s is not None else {}),
        }


@dataclass(frozen=True)
class Advance:
    """What one call to a driver's `advance` produced: the iterations whose timing is
    complete (on vLLM with CUDA events a step's timing can arrive a step later than its
    tokens) and the requests that ended."""

    iterations: list[Iteration]
    finished: list[Request]


class Driver(Protocol):
    """What replays a workload in real time: the runtime's `Engine` over a backend it
    schedules, or a backend's own engine that schedules itself (vLLM) with the same
    policy objects."""

    clock: Any
    policy: BudgetPolicy

    @property
    def has_work(self) -> bool: ...

    @property
    def has_running(self) -> bool:
        """Some request holds a sequence (the device is not idle for want of budget)."""
        ...

    def add(self, req: Request) -> bool: ...

    @property
    def can_preempt(self) -> bool:
        """Whether `preempt` can stop an iteration in flight."""
        ...

    def preempt(self) -> None:
        """A foreground request is arriving: stop background-only prompt work in flight."""
        ...

    def advance(self) -> Advance | None:
        """Run one iteration; None when nothing could be scheduled."""
        ...

    def cancel(self, req: Request) -> bool: ...

    def abort(self, reason: str) -> list[Request]: ...


class SchedulingBackend(Protocol):
    """A backend that schedules its own batches (vLLM): the runtime hands it the policy
    object and replays the workload through the driver it returns."""

    name: str
    tokenizer: Any

    def engine(self, policy: BudgetPolicy, *, guard: Any = None, clock: Any = None) -> Driver: ...

    def probe_timings(self, seed: int = 0) -> list[IterationTiming]:
        """Timed iterations of a chat alone and beside prompt chunks of several sizes, for
        the startup cost model."""
        ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class Engine:
    def __init__(
        self,
        backend: Backend,
        policy: BudgetPolicy,
        *,
        limits: BackgroundLimits | None = None,
        clock: RunClock | None = None,
        profile: DeviceProfile | None = None,
        guard: BackgroundCap | None = None,
    ) -> None:
        self.backend = backend
        self.policy = policy
        self.guard = guard
        self.clock = clock or backend.clock or RunClock()
        if profile is not None:
            policy.calibrate(profile)
        policy.check_ready()
        self.scheduler = Scheduler(
            backend.capacity,
            is_eog=backend.tokenizer.is_eog,
            release=backend.release,
            limits=limits,
            restore=self._restore if backend.prefix_cache is not None else None,
        )
        self.last: IterationTiming | None = None
        self._device_done: float | None = None  # when the last device call returned
        # Set by `preempt` (any thread) when a foreground request arrives; an iteration
        # holding only background prompt work stops soon after (on a backend that can).
        self._abort = threading.Event()
        self._abort_at: float | None = None

    def add(self, req: Request) -> bool:
        """Submit an arrived request; False if it failed at once (see `req.error`)."""
        if req.cls == "foreground":
            self._abort.clear()  # the next plan holds it: nothing left to stop for
        if not self.scheduler.has_work:
            self._device_done = None  # the wait for this arrival was idle, not host time
        return self.scheduler.add(req)

    def preempt(self) -> None:
        """A foreground request is arriving (call from any thread, then `add` it): stop the
        iteration in flight if it holds only background prompt work, keeping what it
        finished. Chats' tokens are never stopped, nor are decodes (an iteration with a
        chat's decode runs whole; documents' decodes finish before their iteration's prompt
        work, which is what stops). Arrivals trigger it, not a timer: the replay calls it at
        a foreground request's arrival time."""
        self._abort_at = self.clock.now()
        self._abort.set()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> Iteration | None:
        """Run one iteration; None when nothing could be scheduled."""
        t_start = self.clock.now()
        state = self.scheduler.state(self.last, t_start)
        # Documents' decodes wait, only ever for a chat's sake (never leaving an iteration
        # empty): while a chat's prompt computes (its first token waits for every row
        # beside it, ~30 ms each on a small model), or when the policy says the chats'
        # tokens would be late with them.
        defer = state.n_decode_background > 0 and (
            (state.foreground_prompt_left > 0 and self.policy.caps)
            or (state.n_decode_foreground > 0 and self.policy.defer_background_decodes(state))
        )
        budget = self.policy.budget(state.without_background_decodes() if defer else state)
        background_cap = None
        if self.guard is not None:
            self.guard.update()
            background_cap = self.guard.background_cap(budget, self.backend.capacity.n_batch)
        floor = self.policy.foreground_chunk(state) if state.foreground_prompt_left else None
        plan = self.scheduler.plan(budget, background_cap, defer, floor, self.policy.caps)
        if plan.empty:
            self._device_done = None  # idle until work arrives: not host overhead
            return None
        by_id = {r.id: r for r in self.scheduler.running}
        by_class = {"foreground": 0, "background": 0}
        for rid, n in plan.prefill.items():
            by_class[by_id[rid].cls] += n
        n_fg = sum(by_id[rid].cls == "foreground" for rid in plan.decode)
        work = self.scheduler.work(plan)
        # A chat arriving meanwhile stops the documents' prompt work; documents' decodes in
        # it finish first (the backend computes them before any prompt chunk). Chats' work
        # is never stopped: neither their prompts nor iterations that carry their tokens.
        abortable = (
            self.backend.supports_abort
            and plan.n_prefill > 0
            and n_fg == 0
            and by_class["foreground"] == 0
        )
        started = self.clock.now()
        host_s = None if self._device_done is None else started - self._device_done
        try:
            result = self.backend.execute(work, self._abort if abortable else None)
        except BackendError as e:
            self._device_done = None
            failed = self.scheduler.fail_plan(plan, str(e))
            timing = IterationTiming(self.clock.now() - t_start, 0, 0, 0, plan.budget)
            return Iteration(t_start, plan, timing, by_class, {}, failed, error=str(e))
        if result.kept is not None:
            return self._preempted(t_start, plan, work, result, host_s)
        timing = timing_of(
            work,
            result.duration_s,
            n_decode_foreground=n_fg,
            budget=plan.budget,
            host_s=host_s,
            n_prefill_foreground=by_class["foreground"],
        )
        self._device_done = self.clock.now()
        self.policy.observe(timing)
        self.last = timing
        seq_to_id = {r.seq_id: r.id for r in self.scheduler.running}
        sampled = {seq_to_id[seq]: token for seq, token in result.sampled.items()}
        finished = self.scheduler.update(plan, result.sampled, self.clock.now())
        saved_s = self._save_prefixes(plan)
        return Iteration(
            t_start, plan, timing, by_class, self._state(), finished, sampled, save_s=saved_s
        )

    def _restore(self, req: Request) -> None:
        """Fill a just-admitted request's sequence from the longest saved prefix of its
        prompt: those tokens count as computed, and the budget is spent on the rest."""
        cache = self.backend.prefix_cache
        assert cache is not None and req.seq_id is not None
        t0 = time.perf_counter()
        n = cache.restore(req.seq_id, req.prompt)
        if n:
            req.num_computed = req.prefix_reused_tokens = n
            req.restore_s = time.perf_counter() - t0

    def _save_prefixes(self, plan: Plan) -> float | None:
        """Save what requests' shareable prefixes this iteration completed (a copy of the
        sequence's KV state; the disk write happens off this thread). Returns the time the
        copies took, which the next iteration's host time leaves out: a save happens once
        per document, and as host time it would enter a policy's tail margin (cadence's
        margin sat at its cap for hundreds of iterations after each ~70 ms copy)."""
        cache = self.backend.prefix_cache
        due = [] if cache is None else self.scheduler.saves_due(plan)
        if cache is None or not due:
            return None
        t0 = self.clock.now()
        for req in due:
            assert req.seq_id is not None
            cache.save(req.seq_id, req.prompt[: req.num_computed])
        spent = self.clock.now() - t0
        if self._device_done is not None:
            self._device_done += spent
        return spent

    def _state(self) -> dict[str, Any]:
        """The policy's (and thermal guard's) state after an iteration, for its record."""
        state = self.policy.snapshot()
        if self.guard is not None:
            state = {**state, "thermal": self.guard.snapshot()}
        return state

    def _preempted(
        self,
        t_start: float,
        plan: Plan,
        work: list[SeqWork],
        result: StepResult,
        host_s: float | None,
    ) -> Iteration:
        """An iteration aborted for a foreground arrival: keep what finished, as if the plan
        had been that much (so tokens reconcile); the policy does not learn from it."""
        landed = self.clock.now()
        self._device_done = landed
        self._abort.clear()
        kept_by_seq = result.kept or {}
        seq_to_id = {r.seq_id: r.id for r in self.scheduler.running}
        kept = {seq_to_id[w.seq_id]: kept_by_seq.get(w.seq_id, 0) for w in work}
        done = replace(plan, prefill={rid: n for rid, n in kept.items() if n > 0})
        finished = self.scheduler.update(done, result.sampled, landed)
        saved_s = self._save_prefixes(done)
        timing = timing_of(
            [
                w if w.is_decode else replace(w, tokens=w.tokens[: kept_by_seq.get(w.seq_id, 0)])
                for w in work
                if w.is_decode or kept_by_seq.get(w.seq_id)
            ],
            result.duration_s,
            budget=plan.budget,
            host_s=host_s,
        )
        record = {
            "kept": done.n_prefill,
            "lost": plan.n_prefill - done.n_prefill,
            "abort_latency_s": None if self._abort_at is None else landed - self._abort_at,
        }
        kept_class = {"foreground": 0, "background": done.n_prefill}
        sampled = {seq_to_id[s]: t for s, t in result.sampled.items()}
        state = self._state()
        return Iteration(
            t_start, done, timing, kept_class, state, finished, sampled, None, record, saved_s
        )

    @property
    def has_running(self) -> bool:
        return bool(self.scheduler.running)

    @property
    def can_preempt(self) -> bool:
        return self.backend.supports_abort

    def advance(self) -> Advance | None:
        it = self.step()
        return None if it is None else Advance([it], it.finished)

    def cancel(self, req: Request) -> bool:
        """End one request between iterations (see `Scheduler.cancel`)."""
        return self.scheduler.cancel(req)

    def abort(self, reason: str) -> list[Request]:
        """Fail every waiting and running request (the run is stopping)."""
        return self.scheduler.abort(reason)
