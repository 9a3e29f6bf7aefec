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
from edgeprefill.runtime.core.iteration import Advance, Iteration
from edgeprefill.runtime.core.loop import IDLE_POLL_S, DriverLoop
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.replay.alarm import ArrivalAlarm
from edgeprefill.runtime.replay.signals import on_stop_signals
from edgeprefill.runtime.results.writer import RunWriter


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


class _Replay(DriverLoop):
    """Requests come at their arrival times on the run's clock; a closed-loop turn's when
    the request before it ends plus its think time."""

    def __init__(
        self,
        engine: Driver,
        requests: list[Request],
        writer: RunWriter,
        on_iteration: Callable[[Iteration | None], None],
        stop: _StopFlag,
        alarm: Callable[[list[Request]], None] | None,
    ) -> None:
        super().__init__(engine, writer)
        self.pending = sorted((r for r in requests if r.after is None), key=lambda r: r.arrival_s)
        # Closed-loop turns wait for the request before them: released when it ends.
        self.blocked = {r.after: r for r in requests if r.after is not None}
        self.on_iteration, self.stop, self.alarm = on_iteration, stop, alarm
        self.interrupted = False

    def admit(self, wait: float | None) -> None:
        if self.stop.requested:
            self.stopped()
            return
        clock, pending = self.engine.clock, self.pending
        if pending and wait != 0.0:  # idle until the next arrival: wake often for a Ctrl-C
            ahead = pending[0].arrival_s - clock.now()
            clock.sleep(min(IDLE_POLL_S if wait is None else wait, max(ahead, 0.0)))
        now = clock.now()
        while pending and pending[0].arrival_s <= now:
            self.add(pending.pop(0))
        if self.alarm is not None:  # a chat arriving mid-iteration stops document work
            self.alarm(pending)
        self.closed = not pending and not self.blocked

    def stopped(self) -> None:
        """Ctrl-C: what was waiting or running fails with reason "interrupted"."""
        self.interrupted = self.closed = True
        self.abort("interrupted")

    def advanced(self, advanced: Advance) -> None:
        super().advanced(advanced)
        self.on_iteration(advanced.iterations[-1] if advanced.iterations else None)

    def add(self, req: Request) -> None:
        super().add(req)
        if req.done:
            self.on_iteration(None)

    def ended(self, req: Request) -> None:
        super().ended(req)
        nxt = self.blocked.pop(req.id, None)
        if nxt is not None:
            # The answer as a client holds it: text, without the end-of-generation token.
            nxt.follow(req, req.output[:-1] if req.finish_reason == "stop" else req.output)
            nxt.arrival_s = self.engine.clock.now() + nxt.think_s
            bisect.insort(self.pending, nxt, key=lambda r: r.arrival_s)


def run_requests(
    engine: Driver,
    requests: list[Request],
    writer: RunWriter,
    on_iteration: Callable[[Iteration | None], None] = lambda it: None,
) -> RunOutcome:
    with _graceful_interrupt() as stop, _arrival_alarm(engine) as alarm, _static_heap():
        replay = _Replay(engine, requests, writer, on_iteration, stop, alarm)
        try:
            replay.run()
        except KeyboardInterrupt:  # a second Ctrl-C: at once
            replay.stopped()
    signum = stop.signum or (signal.SIGINT if replay.interrupted else None)
    not_arrived = len(replay.pending) + len(replay.blocked)
    return RunOutcome(engine.clock.now(), replay.interrupted, not_arrived, signum)
