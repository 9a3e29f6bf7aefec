"""The engine: one iteration is admit, plan, execute, observe, update, record.

This is also the embedding API's core: a desktop assistant creates an `Engine` over a
backend and a policy, `add()`s requests as they come, and calls `iterate()` in its own loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from edgeprefill.runtime.core.budget import BackgroundCap, BudgetPolicy
from edgeprefill.runtime.core.contract import Backend, BackendError, SeqWork, timing_of
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.costs.targets import FirstTokenTargets
from edgeprefill.runtime.core.driver import RunClock
from edgeprefill.runtime.core.iteration import Advance, Iteration
from edgeprefill.runtime.core.parked import ParkedSequences
from edgeprefill.runtime.core.plan import IterationTiming, Plan
from edgeprefill.runtime.core.planner import Planner
from edgeprefill.runtime.core.request import CLASSES, Request, Status, TokenLogprob
from edgeprefill.runtime.core.scheduler import BackgroundLimits, Scheduler


@dataclass  # not frozen: one is built every iteration (see core/plan.py)
class Executed:
    """What the backend did with a plan: all of it, the part a preemption kept, or
    nothing (an error)."""

    plan: Plan  # what ran
    timing: IterationTiming
    landed_s: float  # when the device call returned
    sampled: dict[int, int] = field(default_factory=dict)  # sequence id -> new token
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # where asked, by sequence
    preempted: dict[str, Any] | None = None  # prompt tokens kept and lost, abort latency
    error: str | None = None

    @property
    def complete(self) -> bool:
        """The plan ran whole: a policy learns from its time (not from a part of one)."""
        return self.error is None and self.preempted is None


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
        self.clock = clock or backend.clock or RunClock()
        if profile is not None:
            policy.calibrate(profile)
        policy.check_ready()
        self.planner = Planner(policy, guard)
        self.targets = FirstTokenTargets(profile)
        cache = backend.prefix_cache
        self.scheduler = Scheduler(
            backend.capacity,
            is_eog=backend.tokenizer.is_eog,
            release=backend.release,
            limits=limits,
            keeps_prefixes=cache is not None,
            parked=ParkedSequences(backend, None if cache is None else cache.save)
            if backend.keeps_sequences
            else None,
        )
        if backend.keeps_sequences:  # an earlier engine over this backend may have parked some
            for seq_id in range(backend.capacity.n_seq_max):
                backend.release(seq_id)
        self._device_done: float | None = None  # when the last device call returned
        # Set by `preempt` (any thread) when a foreground request arrives; an iteration
        # whose prompt work is all background stops soon after (on a backend that can).
        self._abort = threading.Event()
        self._abort_at: float | None = None
        # Called once an iteration's tokens are appended, before the engine's own
        # bookkeeping (saves, the policy's observation, the record): a server's streams
        # get their tokens without waiting for it (see `Driver.on_tokens`).
        self.on_tokens: Callable[[], None] | None = None

    @property
    def policy(self) -> BudgetPolicy:
        return self.planner.policy

    @property
    def guard(self) -> BackgroundCap | None:
        return self.planner.guard

    @guard.setter
    def guard(self, guard: BackgroundCap | None) -> None:
        self.planner.guard = guard

    def add(self, req: Request) -> bool:
        """Submit an arrived request; False if it failed at once (see `req.error`)."""
        if req.cls == "foreground":
            self._abort.clear()  # the next plan holds it: nothing left to stop for
        if not self.scheduler.has_work:
            self._device_done = None  # the wait for this arrival was idle, not host time
        self.targets.estimate(req)
        return self.scheduler.add(req)

    def preempt(self) -> None:
        """A foreground request is arriving (call from any thread, then `add` it): stop the
        iteration in flight if its prompt work is background only, keeping what it
        finished. Decodes are never stopped (they are computed and sampled before the
        prompt work, which is what stops), nor is a chat's prompt. Arrivals trigger it, not
        a timer: the replay calls it at a foreground request's arrival time."""
        self._abort_at = self.clock.now()
        self._abort.set()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def iterate(self) -> Iteration | None:
        """Run one iteration; None when nothing could be scheduled."""
        t_start = self.clock.now()
        restore_s = self._admit()
        plan = self._plan(t_start)
        if plan.empty:
            self._device_done = None  # idle until work arrives: not host overhead
            return None
        ran = self._execute(plan)
        finished = self._update(ran)
        if self.on_tokens is not None:
            self.on_tokens()
        save_s = None if ran.error is not None else self._save_prefixes(ran.plan)
        if ran.complete:
            self.planner.observe(ran.timing)
        return self._record(t_start, ran, finished, restore_s, save_s)

    # --- the parts of one iteration -----------------------------------------------------
    def _admit(self) -> float | None:
        """Give waiting requests their sequences, each continuing the parked sequence or the
        saved prefix that shares the most of its prompt (those tokens count as computed;
        the budget is spent on the rest). Returns the time the copies took (restores, and
        parked sequences saved as they are evicted), which no host time includes."""
        cache, scheduler = self.backend.prefix_cache, self.scheduler
        parked = scheduler.parked
        spilled = parked.stats.spilled if parked is not None else 0
        copied = False
        t0 = time.perf_counter()
        for req in scheduler.admit():
            assert req.seq_id is not None
            if cache is not None and req.num_computed == 0:
                t1 = time.perf_counter()
                n = cache.restore(req.seq_id, req.prompt, scheduler.piece_floor)
                if n:
                    req.num_computed = req.prefix_reused_tokens = n
                    req.restore_s = time.perf_counter() - t1
            if req.num_computed:
                self.targets.estimate(req)
                copied = True
        if parked is not None and parked.stats.spilled != spilled:
            copied = True
        if not copied:
            return None
        spent = time.perf_counter() - t0
        self._leave_out_of_host_time(spent)
        return spent

    def _plan(self, now_s: float) -> Plan:
        candidates = self.scheduler.candidates()
        decision = self.planner.decide(candidates, self.backend.capacity.n_batch, now_s)
        return self.scheduler.plan(decision, candidates)

    def _execute(self, plan: Plan) -> Executed:
        """Run the plan on the backend. A chat arriving meanwhile stops the documents'
        prompt work; the decodes in it, chats' and documents', finish first (the backend
        computes and samples them before any prompt chunk), so a running chat's token is
        never lost and comes sooner. A chat's prompt is never stopped."""
        abortable = (
            self.backend.supports_abort and plan.n_prefill > 0 and not plan.n_prefill_foreground
        )
        work = self.scheduler.work(plan)
        started = self.clock.now()
        host_s = None if self._device_done is None else started - self._device_done
        try:
            result = self.backend.execute(work, self._abort if abortable else None)
        except BackendError as e:
            self._device_done = None
            timing = IterationTiming(self.clock.now() - started, 0, 0, 0, plan.budget)
            return Executed(plan, timing, self.clock.now(), error=str(e))
        landed = self._device_done = self.clock.now()
        # The backend's own host work inside the call (filling the batch, reading logits,
        # sampling) is host time too: only `duration_s` is the device's. Left out, it was
        # as much again as all the host time counted (seed 1 of the default workload:
        # 437 ms against 517, benchmarks/history.md section O).
        in_call = max(landed - started - result.duration_s, 0.0)
        host_s = in_call if host_s is None else host_s + in_call
        preempted = None
        if result.kept is not None:  # only an iteration without chats' work is stopped
            plan, work, preempted = self._kept(plan, work, result.kept, landed)
        timing = timing_of(work, result.duration_s, plan, host_s)
        return Executed(plan, timing, landed, result.sampled, result.logprobs, preempted)

    def _kept(
        self, plan: Plan, work: list[SeqWork], kept_by_seq: dict[int, int], landed: float
    ) -> tuple[Plan, list[SeqWork], dict[str, Any]]:
        """An iteration aborted for a foreground arrival: what finished, as if the plan had
        been that much (so tokens reconcile), and the preemption's record."""
        self._abort.clear()
        # A backend lists the prompt chunks it stopped in or never started; work it does
        # not list ran whole (decodes, and a prompt's one-token last piece, which is shaped
        # as a decode and computed with them).
        kept_by_seq = {w.seq_id: kept_by_seq.get(w.seq_id, len(w.tokens)) for w in work}
        id_to_seq = {r.id: r.seq_id for r in self.scheduler.running if r.seq_id is not None}
        kept = {rid: kept_by_seq[id_to_seq[rid]] for rid in plan.prefill}
        done = replace(plan, prefill={rid: n for rid, n in kept.items() if n > 0})
        work = [
            replace(w, tokens=w.tokens[: kept_by_seq[w.seq_id]])
            for w in work
            if kept_by_seq[w.seq_id] > 0
        ]
        record = {
            "kept": done.n_prefill,
            "lost": plan.n_prefill - done.n_prefill,
            "abort_latency_s": None if self._abort_at is None else landed - self._abort_at,
        }
        return done, work, record

    def _update(self, ran: Executed) -> list[Request]:
        """Apply what ran: prompts advance, tokens append, finished requests end (all of an
        iteration's requests fail when the backend refused it). Returns those that ended."""
        if ran.error is not None:
            return self.scheduler.fail_plan(ran.plan, ran.error)
        return self.scheduler.update(ran.plan, ran.sampled, ran.landed_s, ran.logprobs)

    def _record(
        self,
        t_start: float,
        ran: Executed,
        finished: list[Request],
        restore_s: float | None,
        save_s: float | None,
    ) -> Iteration:
        return Iteration(
            t_start,
            ran.plan,
            ran.timing,
            self.planner.snapshot(),
            finished,
            ran.error,
            ran.preempted,
            save_s,
            restore_s,
        )

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
        self._leave_out_of_host_time(spent)
        return spent

    def _leave_out_of_host_time(self, spent: float) -> None:
        if self._device_done is not None:
            self._device_done += spent

    # --- the Driver interface -----------------------------------------------------------
    @property
    def has_running(self) -> bool:
        return any(r.status is Status.DECODE for r in self.scheduler.running)

    @property
    def can_preempt(self) -> bool:
        return self.backend.supports_abort

    def advance(self) -> Advance | None:
        it = self.iterate()
        return None if it is None else Advance([it], it.finished)

    def cancel(self, req: Request) -> bool:
        """End one request between iterations (see `Scheduler.cancel`)."""
        return self.scheduler.cancel(req)

    def finish(self, req: Request, kept: int) -> bool:
        """End one request as finished after its first `kept` output tokens, between
        iterations (see `Scheduler.finish`)."""
        return self.scheduler.finish(req, kept)

    def abort(self, reason: str) -> list[Request]:
        """Fail every waiting and running request (the run is stopping)."""
        return self.scheduler.abort(reason)

    def queues(self) -> dict[str, tuple[int, int]]:
        s = self.scheduler
        return {c: (len(s.waiting[c]), sum(r.cls == c for r in s.running)) for c in CLASSES}
