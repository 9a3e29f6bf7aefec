"""Streamed tokens cross from the engine thread to their consumers' event loops once an
iteration, between device calls, and the engine waits for them to be written.

Why: on a CPU, `llama_decode` keeps every core busy with compute threads that meet at a
barrier after each graph node, and a document's chunk runs with an abort callback that
takes the GIL at every node. So no Python of the server should run beside a graph: the
engine hands each iteration's events over in one wake-up per event loop (not one per token
per stream) and waits, its cores idle, until the loop has run every stream they woke
(written its chunks). The wait is bounded: a loop busy with something else (a large
request body) delays the next iteration by at most `max_wait_s`, and the chunks it writes
while the device computes are counted (`late_writes`). Measured under `serve` on 2 cores
(benchmarks/history.md, section F): a median wait of 0.6 ms, no late writes. The engine
waits even where its compute threads leave a core free (`--threads 1` on 2 cores): not
waiting there gave the chats a worse P99 ITL and token delivery (section C).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

# Waits measured 0.6 ms at the median and under 4 ms at P99 (section F).
MAX_WAIT_S = 0.02


@dataclass
class HandoverRecord:
    """One hand-over, as iterations.jsonl records it."""

    streams: int  # event loops' consumers woken (one that ended: twice, token then end)
    events: int  # pieces and ends handed over
    wait_s: float  # the engine's wait for the loops to write them
    complete: bool  # every loop finished within the bound
    late_writes: int  # chunks written while the device computed, since the last hand-over

    def record(self) -> dict[str, Any]:
        return asdict(self)

    def then(self, later: HandoverRecord) -> HandoverRecord:
        """Two hand-overs of one iteration (its tokens', then its ends'), as one record."""
        return HandoverRecord(
            streams=self.streams + later.streams,
            events=self.events + later.events,
            wait_s=self.wait_s + later.wait_s,
            complete=self.complete and later.complete,
            late_writes=self.late_writes + later.late_writes,
        )


class Handover:
    """Collects the events of an iteration per event loop (on the engine thread), hands
    them over at once, and counts what consumers write while the device computes."""

    def __init__(self, max_wait_s: float = MAX_WAIT_S) -> None:
        self.max_wait_s = max_wait_s
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        self._lock = threading.Lock()
        self._computing = False
        self._late_writes = 0

    def put(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any], event: Any) -> None:
        """Engine thread: an event for an async consumer, delivered at the next `flush`."""
        self._pending.setdefault(loop, []).append((queue, event))

    def flush(self) -> HandoverRecord | None:
        """Engine thread, before a device call: deliver what was put and wait (bounded)
        until each loop has run the consumers it woke. None if nothing was put and nothing
        written late since the last one."""
        self._computing = False  # called between device calls, from within an advance too
        pending, self._pending = self._pending, {}
        with self._lock:
            late, self._late_writes = self._late_writes, 0
        if not pending and not late:
            return None
        t0 = time.perf_counter()
        written = []
        for loop, events in pending.items():
            done = threading.Event()
            try:
                loop.call_soon_threadsafe(_deliver, loop, events, done)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                continue
            written.append(done)
        complete = all(
            done.wait(max(0.0, t0 + self.max_wait_s - time.perf_counter())) for done in written
        )
        streams = sum(len({id(q) for q, _ in events}) for events in pending.values())
        return HandoverRecord(
            streams=streams,
            events=sum(len(events) for events in pending.values()),
            wait_s=time.perf_counter() - t0,
            complete=complete,
            late_writes=late,
        )

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Engine thread: around a driver's advance; its device call ends at the flush of
        its tokens (`Driver.on_tokens`)."""
        self._computing = True
        try:
            yield
        finally:
            self._computing = False

    def written(self) -> None:
        """A consumer wrote a chunk: counted if the device was computing meanwhile."""
        with self._lock:
            self._late_writes += self._computing


def _deliver(
    loop: asyncio.AbstractEventLoop,
    events: list[tuple[asyncio.Queue[Any], Any]],
    done: threading.Event,
) -> None:
    """On the event loop: wake the consumers, then mark the hand-over done once they have
    run. Each woken consumer was scheduled by `put_nowait`, so a callback scheduled after
    them runs once each has written its chunks and waits for more (a write the transport
    cannot take at once ends that step early: its chunk then counts as late)."""
    for queue, event in events:
        queue.put_nowait(event)
    loop.call_soon(done.set)
