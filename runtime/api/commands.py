"""The engine thread's side of the embedding API: the driver loop fed by commands.

`Runtime`'s callers queue commands from any thread (add, cancel, stop); the loop applies
them between iterations, so a cancelled request's sequence and KV cells are freed before
the next iteration and no other request is disturbed. A question about a document waits
here until the document's kept prefix is read, and each iteration's tokens go to their
streams at once (`Handover`).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

from edgeprefill.runtime.api.handle import RequestHandle
from edgeprefill.runtime.api.handover import Handover, HandoverRecord
from edgeprefill.runtime.core.driver import Driver
from edgeprefill.runtime.core.iteration import Advance, Iteration
from edgeprefill.runtime.core.loop import DriverLoop, Recorder
from edgeprefill.runtime.core.request import Request, RequestClass

log = logging.getLogger(__name__)

# ("add", (handle, the request whose prefix it waits for, or None)), ("cancel", request),
# ("finish", (request, how many of its output tokens it keeps)),
# ("stop", (why the requests in flight end now, or None to finish them; whether the
# background ones are cancelled))
Command = tuple[str, Any]


class CommandLoop(DriverLoop):
    def __init__(
        self,
        engine: Driver,
        commands: queue.SimpleQueue[Command],
        handover: Handover,
        *,
        prefix_cache: Any,
        recorder: Recorder | None,
        on_iteration: Callable[[Iteration], None] | None,
        on_end: Callable[[Request], None] | None,
    ) -> None:
        super().__init__(engine, recorder)
        self.commands, self.handover, self.prefix_cache = commands, handover, prefix_cache
        self.on_iteration, self.on_end = on_iteration, on_end
        self.handles: dict[str, RequestHandle] = {}
        self._handed: HandoverRecord | None = None  # this iteration's hand-overs so far
        # Requests held back until the request they share a prefix with has read it.
        self.held: list[tuple[Request, Request]] = []  # (held, the one it waits for)
        engine.on_tokens = self._hand_tokens

    def admit(self, wait: float | None) -> None:
        if wait != 0.0:
            self.handover.flush()  # what cancels and refusals ended, before waiting
        while True:
            try:
                kind, arg = self.commands.get(block=wait != 0.0, timeout=wait)
            except queue.Empty:
                break
            wait = 0.0
            if kind == "add":
                handle, after = arg
                self.handles[handle.id] = handle
                if after is not None and self._still_reading(after):
                    self.held.append((handle.request, after))
                else:
                    self.add(handle.request)
            elif kind == "cancel":
                if self._unhold(arg, "cancelled") or self.engine.cancel(arg):
                    self.ended(arg)
            elif kind == "finish":
                if self.engine.finish(*arg):
                    self.ended(arg[0])
            elif kind == "stop":
                self.closed = True
                everything, background = arg
                if everything is not None:
                    self.abort(everything)
                elif background:
                    self.cancel_class("background")
        self._release_held()  # a document cancelled or failed between iterations

    def advance(self) -> Advance | None:
        self.handover.flush()  # what cancels and refusals ended, before computing
        with self.handover.computing():
            return self.engine.advance()

    def advanced(self, advanced: Advance) -> None:
        """Record the requests that ended and hand their ends over, then record the
        iteration with how its tokens were handed over. The tokens went before, from the
        driver (`_hand_tokens`): recording the requests that ended (their lines in
        requests.jsonl, their gaps in /metrics) took 0.4-0.8 ms, and the engine's own
        bookkeeping after a device call up to 0.9 ms at P99, which every stream's token
        waited for (benchmarks/history.md, sections G and C)."""
        for req in advanced.finished:
            self.ended(req)
        self._hand_tokens()
        handed, self._handed = self._handed, None
        if handed is not None and advanced.iterations:
            advanced.iterations[-1].handover = handed.record()
        for it in advanced.iterations:
            if self.recorder is not None:
                self.recorder.iteration(it)
            if self.on_iteration is not None:
                _observe(self.on_iteration, it)
        self._release_held()

    def _hand_tokens(self) -> None:
        """Hand the tokens appended since the last call over to their streams; the driver
        calls it as soon as an iteration's tokens are appended (`Driver.on_tokens`)."""
        for handle in self.handles.values():
            handle._catch_up()
        handed = self.handover.flush()
        if handed is not None:
            self._handed = handed if self._handed is None else self._handed.then(handed)

    def ended(self, req: Request) -> None:
        """Record a request that ended and end its handle, whatever the recording does."""
        handle = self.handles.pop(req.id, None)
        try:
            super().ended(req)
        finally:
            if self.on_end is not None:
                _observe(self.on_end, req)
            if handle is not None:
                handle._end()

    def cancel_class(self, cls: RequestClass) -> None:
        """Cancel every request of one class, held ones included (a server's documents at
        shutdown, whose answers nobody could fetch once it has stopped)."""
        for handle in list(self.handles.values()):
            req = handle.request
            if req.cls == cls and (self._unhold(req, "cancelled") or self.engine.cancel(req)):
                self.ended(req)

    def abort(self, reason: str) -> None:
        """End every request in flight, held ones included, with `reason`."""
        for req, _ in list(self.held):
            self._unhold(req, reason)
            self.ended(req)
        super().abort(reason)

    def fail(self, reason: str) -> None:
        """End every request the loop holds with the reason it failed: those in the
        engine, those held for a prefix, and those queued since the last drain."""
        self.failure = self.failure or reason
        try:
            self.abort(reason)
        except Exception:
            log.exception("ending the requests in the engine failed too")
        while True:
            try:
                kind, arg = self.commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self.handles[arg[0].id] = arg[0]
        for handle in list(self.handles.values()):
            if not handle.request.done:
                handle.request.fail(reason)
            self.ended(handle.request)

    def _still_reading(self, req: Request) -> bool:
        """`req` has not yet read the prefix it keeps, and will (a prefix cache holds it)."""
        kept = req.share_prefix or 0
        return self.prefix_cache is not None and not req.done and req.num_computed < kept

    def _release_held(self) -> None:
        """Add the held requests whose prefix has been read (and saved) or never will be."""
        if not self.held:
            return
        ready = [(r, a) for r, a in self.held if not self._still_reading(a)]
        for pair in ready:
            self.held.remove(pair)
            self.add(pair[0])

    def _unhold(self, req: Request, reason: str) -> bool:
        """End a held request before it was ever added; False if it is not held."""
        for pair in self.held:
            if pair[0] is req:
                self.held.remove(pair)
                req.fail(reason)
                return True
        return False


def _observe(callback: Callable[[Any], None], arg: Any) -> None:
    """Call an observer (a server's metrics): one that raises is logged, not let end the
    engine thread, which serves every request."""
    try:
        callback(arg)
    except Exception:
        log.exception("%s raised; the runtime goes on", getattr(callback, "__qualname__", callback))
