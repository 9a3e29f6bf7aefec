"""A request handle read from asyncio: many open streams wait on the event loop itself, not
on a thread each (asyncio's default executor has a few threads per core; a server with
twenty open streams queued their tokens behind one another)."""

from __future__ import annotations

import asyncio
import threading

from edgeprefill.runtime.api.handle import RequestHandle
from edgeprefill.runtime.api.handover import Handover
from edgeprefill.runtime.core.request import Request


def handle(i: int, handover: Handover | None = None) -> RequestHandle:
    return RequestHandle(
        Request(f"r{i}", "foreground", 0.0, [1, 2], 4),
        lambda t: b"ab",
        lambda: None,
        lambda kept: None,
        handover or Handover(),
    )


def emit(h: RequestHandle, tokens: int) -> None:
    """What the engine thread does for a request: stamp, hand over, end."""
    for _ in range(tokens):
        h.request.output.append(7)
        h.request.token_times_s.append(1.0)
        h._catch_up()
        h._handover.flush()
    h._end()
    h._handover.flush()


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


def test_the_engine_waits_until_the_event_loop_has_run_every_stream_it_woke():
    """One hand-over for twenty streams: when `flush` returns, every consumer has taken its
    piece (a server has written its chunk), so no stream's HTTP work is left to run beside
    the next device call."""
    handover = Handover(max_wait_s=5.0)
    handles = [handle(i, handover) for i in range(20)]
    taken: list[list[str]] = [[] for _ in handles]

    async def consume(i: int) -> None:
        async for piece in handles[i]:
            taken[i].append(piece.text)

    def engine() -> list[tuple[int, bool]]:
        seen = []
        for _ in range(3):
            for h in handles:
                h.request.output.append(7)
                h.request.token_times_s.append(1.0)
                h._catch_up()
            record = handover.flush()
            assert record is not None
            seen.append((sum(map(len, taken)), record.complete))
        for h in handles:
            h._end()
        handover.flush()
        return seen

    async def main() -> list[tuple[int, bool]]:
        tasks = [asyncio.create_task(consume(i)) for i in range(len(handles))]
        for _ in range(5):
            await asyncio.sleep(0)
        seen = await asyncio.to_thread(engine)
        await asyncio.gather(*tasks)
        return seen

    assert asyncio.run(main()) == [(20, True), (40, True), (60, True)]


def test_a_busy_event_loop_delays_the_engine_only_up_to_the_bound_and_is_counted():
    handover = Handover(max_wait_s=0.05)
    h = handle(0, handover)

    async def main() -> tuple[float, bool, int]:
        task = asyncio.create_task(anext(aiter(h)))
        await asyncio.sleep(0)
        # The engine hands a token over while the loop is stuck for 0.5 s.
        asyncio.get_running_loop().call_soon(threading.Event().wait, 0.5)
        h.request.output.append(7)
        h.request.token_times_s.append(1.0)
        h._catch_up()
        record = await asyncio.to_thread(handover.flush)
        with handover.computing():
            await task
            handover.written()  # the chunk is written while the device computes
        assert record is not None
        late = handover.flush()
        return record.wait_s, record.complete, late.late_writes if late else -1

    waited, complete, late = asyncio.run(main())
    assert waited < 0.3 and not complete
    assert late == 1
