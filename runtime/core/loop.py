"""The one loop that drives an engine, for `run`'s replay of a workload and for the
embedding API (and so the server).

Both add requests as they come, advance the engine an iteration at a time, record each
iteration and each request that ends, and end what is left with a reason when they stop.
Where requests come from is all that differs, and a subclass says it in `admit`: a
workload's arrival times on the run's clock (`replay.loop`), or commands that other
threads queue (`api.commands`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Protocol

from edgeprefill.runtime.core.driver import Driver
from edgeprefill.runtime.core.iteration import Advance, Iteration
from edgeprefill.runtime.core.request import Request

log = logging.getLogger(__name__)

# How long an engine that scheduled nothing while requests decode waits for a new request
# before it tries again (a replay also wakes this often to see a Ctrl-C).
IDLE_POLL_S = 0.05


class Recorder(Protocol):
    """Where a run's records go (`results.writer.RunWriter`)."""

    def iteration(self, it: Iteration) -> None: ...

    def request(self, req: Request) -> None: ...

    def flush(self) -> None: ...


class DriverLoop(ABC):
    """Drives `engine` until no request can come (`closed`) and none is left."""

    def __init__(self, engine: Driver, recorder: Recorder | None) -> None:
        self.engine = engine
        self.recorder = recorder
        self.closed = False  # set by `admit` once no request will come any more
        self.failure: str | None = None  # why the loop failed, once it has (see `ended`)

    def run(self) -> None:
        engine = self.engine
        while not (self.closed and not engine.has_work):
            idle = not engine.has_work
            if idle and self.recorder is not None:
                self.recorder.flush()  # nothing runs until a request comes
            self.admit(wait=None if idle else 0.0)
            if not engine.has_work:
                continue
            advanced = self.advance()
            if advanced is None:
                if not engine.has_running:
                    raise RuntimeError(
                        f"policy {engine.policy.name} gave no prefill budget with nothing "
                        "running: the run cannot progress"
                    )
                self.admit(wait=IDLE_POLL_S)  # what runs needs the device: not a spin
                continue
            self.advanced(advanced)

    @abstractmethod
    def admit(self, wait: float | None) -> None:
        """Add to the engine (`add`) the requests that have come; when none has, first
        wait up to `wait` seconds for one (None: as long as the source likes). Sets
        `closed` once no more will come, ending what is left (`abort`) where it stops
        early."""

    def advance(self) -> Advance | None:
        return self.engine.advance()

    def advanced(self, advanced: Advance) -> None:
        """Record what an advance ended and ran."""
        for req in advanced.finished:
            self.ended(req)
        for it in advanced.iterations:
            if self.recorder is not None:
                self.recorder.iteration(it)

    def add(self, req: Request) -> None:
        if not self.engine.add(req):  # refused: it ended with its reason
            self.ended(req)

    def abort(self, reason: str) -> None:
        """End every request in the engine with `reason`."""
        for req in self.engine.abort(reason):
            self.ended(req)

    def ended(self, req: Request) -> None:
        """Record a request that ended. A recorder that fails is not used again: the loop
        ends with its error, unless it is already failing for another reason, when the
        requests it ends are still ended but no longer written."""
        if self.recorder is None:
            return
        try:
            self.recorder.request(req)
        except Exception:
            self.recorder = None
            if self.failure is None:
                raise
            log.exception("could not record request %s", req.id)
