"""The host time between device calls, as policies see it: what a foreground token waits
for besides the device, and nothing else (cadence takes its tail off the ITL target)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest

from edgeprefill.backends.sim import SimBackend
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.policies import parse_policy
from tests.helpers import drain
from tests.test_policies import CAP, COST

SAVE_S = 0.07  # a llama_state_seq_get_data copy of a 7k-token document on a 2-core CPU


class SlowSaves:
    """A prefix cache whose saves take the time a real state copy takes, on the sim clock."""

    def __init__(self, backend: SimBackend) -> None:
        self.clock = backend.clock
        self.saved: list[int] = []

    def save(self, seq_id: int, tokens: Sequence[int]) -> None:
        self.clock.sleep(SAVE_S)
        self.saved.append(len(tokens))

    def restore(self, seq_id: int, prompt: Sequence[int], boundary: Any = int) -> int:
        return 0

    def clear(self) -> None:
        self.saved.clear()

    def describe(self) -> dict[str, Any]:
        return {}


def chat(rid: str, arrival_s: float = 0.0) -> Request:
    return Request(rid, "foreground", arrival_s, list(range(10, 60)), 4, ignore_eos=True)


def test_an_idle_wait_for_an_arrival_is_not_host_time():
    backend = SimBackend(COST, CAP)
    engine = Engine(backend, parse_policy("static:64"))
    drain(engine, [chat("a")])
    backend.clock.sleep(5.0)  # nothing to do until the next chat arrives
    engine.add(chat("b", backend.clock.now()))
    first = engine.iterate()  # only the backend's own host work counts (none on the sim)
    assert first is not None and first.timing.host_s == pytest.approx(0.0, abs=1e-9)
    second = engine.iterate()
    assert second is not None and second.timing.host_s == pytest.approx(0.0, abs=1e-9)


def test_saving_a_documents_state_is_recorded_apart_from_host_time():
    backend = SimBackend(COST, CAP)
    backend.prefix_cache = SlowSaves(backend)
    engine = Engine(backend, parse_policy("static:64"))
    doc = Request("doc", "background", 0.0, list(range(10, 210)), 4, ignore_eos=True)
    doc.share_prefix = 190
    iterations = drain(engine, [doc])
    assert backend.prefix_cache.saved == [engine.scheduler.save_point(doc)]
    saving = [k for k, it in enumerate(iterations) if it.save_s is not None]
    assert len(saving) == 1 and iterations[saving[0]].save_s == pytest.approx(SAVE_S)
    assert iterations[saving[0]].record()["save_s"] == pytest.approx(SAVE_S)
    after = iterations[saving[0] + 1]
    assert after.timing.host_s == pytest.approx(0.0, abs=1e-9)


def test_every_moment_between_device_calls_is_counted_on_llama_cpp(make_backend):
    """Device time and host time together cover the loop: filling llama.cpp's batch and
    sampling happen inside the backend's call but are host time (left out, they were as
    much again as all the host time counted). Only the first iteration's planning and the
    last one's bookkeeping lie outside the first and last device calls."""
    backend = make_backend(kv_cache=False)
    engine = Engine(backend, parse_policy("static:64"))
    for k in range(2):
        engine.add(
            Request(f"c{k}", "foreground", 0.0, list(range(10 + k, 60)), 64, ignore_eos=True)
        )
    iterations = []
    t0 = time.perf_counter()
    while engine.has_work:
        it = engine.iterate()
        assert it is not None
        iterations.append(it)
    wall = time.perf_counter() - t0
    hosts = [it.timing.host_s for it in iterations]
    assert None not in hosts and min(hosts) > 0  # llama.cpp's host work is never free
    counted = sum(it.timing.duration_s for it in iterations) + sum(hosts)
    assert len(iterations) >= 64 and counted <= wall
    assert wall - counted < 2 * max(hosts)


def test_a_chats_token_is_handed_over_before_the_engine_saves_a_document_or_observes():
    """A server streams an iteration's tokens from `Engine.on_tokens`: a chat's token must
    not wait for a document's prefix save (70 ms here) nor for the policy's bookkeeping."""
    backend = SimBackend(COST, CAP)
    backend.prefix_cache = SlowSaves(backend)
    engine = Engine(backend, parse_policy("static:64"))
    doc = Request("doc", "background", 0.0, list(range(10, 210)), 4, ignore_eos=True)
    doc.share_prefix = 190
    a = Request("a", "foreground", 0.0, list(range(10, 60)), 16, ignore_eos=True)
    handed: list[tuple[float, int, object]] = []
    engine.on_tokens = lambda: handed.append(
        (backend.clock.now(), len(a.output), engine.planner.last)
    )
    iterations = drain(engine, [a, doc])
    assert len(handed) == len(iterations)
    for (at, n_out, observed), it in zip(handed, iterations, strict=True):
        if a.id in it.plan.decode or a.id in it.plan.prefill:  # a token of the chat came
            assert at == pytest.approx(a.token_times_s[n_out - 1], abs=1e-9)
        assert observed is not it.timing  # the policy had not yet seen this iteration
    saving = next(k for k, it in enumerate(iterations) if it.save_s is not None)
    assert a.id in iterations[saving].plan.decode  # the chat's token came with the save
    assert handed[saving][0] <= iterations[saving + 1].t_start_s - SAVE_S + 1e-9
