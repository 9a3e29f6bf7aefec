"""A submitted request as its caller holds it: streamed tokens and text, status, result,
timing, and cancellation, usable from any thread and from asyncio."""

from __future__ import annotations

import asyncio
import codecs
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from edgeprefill.runtime.api.handover import Handover
from edgeprefill.runtime.core.request import Request, Status, TokenLogprob


@dataclass(frozen=True)
class Piece:
    """One sampled token and the text it completes (empty while a character spans tokens).
    A last piece may carry only text (`token` None): bytes no later token completed."""

    token: int | None
    text: str
    time_s: float  # on the runtime's clock
    logprob: TokenLogprob | None = None  # where the request asked for log-probabilities


class RequestHandle:
    """Filled by the runtime's engine thread; read by anyone.

    Iterating (`for piece in handle`, or `async for` inside an event loop) yields each
    `Piece` as it is sampled and ends when the request ends; one consumer per handle.
    `result()` waits for the end and returns the request with its tokens and times."""

    def __init__(
        self,
        request: Request,
        piece: Callable[[int], bytes],
        cancel: Callable[[], None],
        finish: Callable[[int], None],
        handover: Handover,
    ) -> None:
        self.request = request
        self._piece = piece
        self._cancel, self._finish = cancel, finish
        self._handover = handover
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._events: queue.SimpleQueue[Piece | None] = queue.SimpleQueue()
        self._done = threading.Event()
        # Set once an `async for` consumes it: events then go straight to its event loop.
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Piece | None]] | None = None
        self._lock = threading.Lock()
        self._sent = 0  # output tokens streamed so far

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def status(self) -> Status:
        return self.request.status

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop it at the next iteration boundary and free its sequence and KV cells; a
        request that already ended stays as it ended. Safe to call twice."""
        if not self.done:
            self._cancel()

    def finish(self, kept: int) -> None:
        """End it as finished (`finish_reason` "stop") after its first `kept` output tokens,
        at the next iteration boundary: its reader found a stop string there. Unlike a
        cancel it counts as completed, and the tokens sampled past `kept` are dropped."""
        if not self.done:
            self._finish(kept)

    def token_bytes(self, token: int) -> bytes:
        """A token's text as the model's vocabulary holds it (part of a character maybe)."""
        return self._piece(token)

    def result(self, timeout: float | None = None) -> Request:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not end within {timeout} s")
        return self.request

    @property
    def ttft_s(self) -> float | None:
        times = self.request.token_times_s
        return times[0] - self.request.arrival_s if times else None

    def __iter__(self) -> Iterator[Piece]:
        while (event := self._events.get()) is not None:
            yield event

    async def __aiter__(self) -> AsyncIterator[Piece]:
        """Events reach the event loop through the runtime's `Handover`, once an iteration
        for all its streams, not by a thread blocked on the queue: one waiting thread per
        stream ran asyncio's default executor out of threads (a few per core) with twenty
        open streams, and tokens queued behind them (a served run's P99 ITL was 1.4 s
        where `run` had 0.1 s)."""
        events: asyncio.Queue[Piece | None] = asyncio.Queue()
        with self._lock:
            while True:  # what arrived before this consumer did, in order
                try:
                    events.put_nowait(self._events.get_nowait())
                except queue.Empty:
                    break
            self._async = (asyncio.get_running_loop(), events)
        while (event := await events.get()) is not None:
            yield event

    # --- called from the engine thread ---------------------------------------------
    def _catch_up(self) -> None:
        """Stream the tokens the driver appended and stamped since the last call: one an
        iteration on llama.cpp, maybe more from one of vLLM's."""
        req = self.request
        for i in range(self._sent, len(req.output)):
            token = req.output[i]
            text = self._decoder.decode(self._piece(token))
            logprob = req.logprobs[i] if i < len(req.logprobs) else None
            self._put(Piece(token, text, req.token_times_s[i], logprob))
        self._sent = len(req.output)

    def _end(self) -> None:
        self._catch_up()
        tail = self._decoder.decode(b"", final=True)
        if tail:
            self._put(Piece(None, tail, self.request.token_times_s[-1]))
        self._done.set()
        self._put(None)  # the end

    def _put(self, event: Piece | None) -> None:
        """A piece, or None after the last one."""
        with self._lock:
            target = self._async
            if target is None:
                self._events.put(event)
                return
        self._handover.put(*target, event)
