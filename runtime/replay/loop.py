"""Drive a workload through an engine in real time and record everything.

Requests are submitted when their arrival time passes on the run's clock; a closed-loop
turn's arrival time is set when the request before it ends. Ctrl-C (or SIGTERM)
stops at the next iteration boundary: what finished is kept, what was waiting or running
fails with reason "interrupted", and the run is marked interrupted. A second Ctrl-C stops at
once.
"""

from __future__ import annotations

import bisect
import gc
import signal
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass

from edgeprefill.runtime.core.driver import Driver
from edgeprefill.runtime.core.iteration import Iteration
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.replay.alarm import ArrivalAlarm
from edgeprefill.runtime.replay.signals import on_stop_signals
from edgeprefill.runtime.results.writer import RunWriter

IDLE_POLL_S = 0.05


@dataclass
class RunOutcome:
    duration_s: float
    interrupted: bool
    not_arrived: int
    signal: int | None = None  # the signal that stopped it (a shell reports 128 + it)


class _StopFlag:
    requested = False
    signum: int | None = None


@contextmanager
def _graceful_interrupt() -> Iterator[_StopFlag]:
    """The first signal asks for a stop at the next iteration boundary; a second one
    stops at once."""
    flag = _StopFlag()

    def note(signum: int) -> None:
        if flag.requested:
            raise KeyboardInterrupt
        flag.requested, flag.signum = True, signum

    with on_stop_signals(note):
        yield flag


@contextmanager
def _static_heap() -> Iterator[None]:
    """Leave everything built before the replay (the model's and tokenizer's objects, the
    requests' prompts, thousands of tokens each) out of the cyclic collector's scans while
    it runs: the collections that still come, between two device calls, then scan only the
    run's own objects. vLLM freezes its startup heap for the same reason. No collection
    first: with a large heap (vLLM and torch imported) one takes seconds, on the run's
    clock, and requests arriving meanwhile would wait. What is unreachable now is kept
    until the replay ends."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def _arrival_alarm(engine: Driver) -> Iterator[Callable[[list[Request]], None] | None]:
    """An alarm that stops the iteration in flight at a chat's arrival (None where the
    engine cannot stop one), as a function that sets it to the next chat among the pending
    requests. A simulated clock rings its own alarms (its time passes only when it is
    moved); a real one needs a thread that waits for the deadline."""
    if not engine.can_preempt:
        yield None
        return
    virtual = getattr(engine.clock, "alarm", None)
    fire = engine.preempt
    alarm = virtual(fire) if virtual is not None else ArrivalAlarm(engine.clock.now, fire)
    armed: float | None = None

    def follow(pending: list[Request]) -> None:
        nonlocal armed
        chat = next((r.arrival_s for r in pending if r.cls == "foreground"), None)
        if chat != armed:  # told only of changes: its lock cost ~10 us a token waits for
            alarm.set(chat)
            armed = chat

    with closing(alarm):
        yield follow


def run_requests(
    engine: Driver,
    requests: list[Request],
    writer: RunWriter,
    on_iteration: Callable[[Iteration | None], None] = lambda it: None,
) -> RunOutcome:
    pending: list[Request] = sorted(
        (r for r in requests if r.after is None), key=lambda r: r.arrival_s
    )
    # Closed-loop turns wait for the request before them: released when it ends.
    blocked = {r.after: r for r in requests if r.after is not None}
    clock = engine.clock

    def ended(req: Request) -> None:
        writer.request(req)
        nxt = blocked.pop(req.id, None)
        if nxt is not None:
            nxt.arrival_s = clock.now() + nxt.think_s
            bisect.insort(pending, nxt, key=lambda r: r.arrival_s)

    interrupted = False
    with _graceful_interrupt() as stop, _arrival_alarm(engine) as alarm, _static_heap():
        try:
            while pending or engine.has_work:
                if stop.requested:
                    interrupted = True
                    break
                now = clock.now()
                while pending and pending[0].arrival_s <= now:
                    req = pending.pop(0)
                    if not engine.add(req):
                        ended(req)
                        on_iteration(None)
                if alarm is not None:  # a chat arriving mid-iteration stops document work
                    alarm(pending)
                step = engine.advance() if engine.has_work else None
                if step is None:
                    if engine.has_work and not engine.has_running:
                        raise RuntimeError(
                            f"policy {engine.policy.name} gave no prefill budget with nothing "
                            "running: the run cannot progress"
                        )
                    if pending:
                        writer.flush()  # nothing runs until the next arrival
                        clock.sleep(min(IDLE_POLL_S, max(pending[0].arrival_s - clock.now(), 0)))
                    continue
                for it in step.iterations:
                    writer.iteration(it)
                for req in step.finished:
                    ended(req)
                on_iteration(step.iterations[-1] if step.iterations else None)
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        for req in engine.abort("interrupted"):
            writer.request(req)
    signum = stop.signum or (signal.SIGINT if interrupted else None)
    return RunOutcome(clock.now(), interrupted, len(pending) + len(blocked), signum)
