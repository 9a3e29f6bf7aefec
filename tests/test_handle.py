"""A request handle read from asyncio: many open streams wait on the event loop itself, not
on a thread each (asyncio's default executor has a few threads per core; a server with
twenty open streams queued their tokens behind one another)."""

from __future__ import annotations

import asyncio
import threading

from edgeprefill.runtime.api.handle import RequestHandle
from edgeprefill.runtime.core.request import Request


def handle(i: int) -> RequestHandle:
    return RequestHandle(
        Request(f"r{i}", "foreground", 0.0, [1, 2], 4), lambda t: b"ab", lambda: None
    )


def emit(h: RequestHandle, tokens: int) -> None:
    """What the engine thread does for a request: stamp, hand over, end."""
    for _ in range(tokens):
        h.request.output.append(7)
        h.request.token_times_s.append(1.0)
        h._catch_up()
    h._end()


def test_twenty_async_streams_wait_without_a_thread_each_and_lose_nothing():
    handles = [handle(i) for i in range(20)]
    early = handle(99)
    emit(early, 2)  # all of it before anyone listens: kept, in order

    async def consume(h: RequestHandle) -> list[str]:
        return [piece.text async for piece in h]

    async def main() -> tuple[int, list[list[str]]]:
        before = threading.active_count()
        tasks = [asyncio.create_task(consume(h)) for h in [*handles, early]]
        for _ in range(5):
            await asyncio.sleep(0)  # every consumer is now waiting
        grew = threading.active_count() - before
        engine = threading.Thread(target=lambda: [emit(h, 3) for h in handles])
        engine.start()
        out = await asyncio.gather(*tasks)
        engine.join()
        return grew, out

    grew, out = asyncio.run(main())
    assert grew == 0
    assert out[:-1] == [["ab"] * 3] * 20 and out[-1] == ["ab", "ab"]
