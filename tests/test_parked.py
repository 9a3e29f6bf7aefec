"""Sequences parked when their requests end, continued by prompts that start with their
tokens: the scheduler's side, over a pretend device (the real model: test_conversation.py)."""

from __future__ import annotations

import numpy as np

from edgeprefill.runtime.core.contract import Capacity
from edgeprefill.runtime.core.parked import ParkedSequences, common_prefix
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.core.scheduler import Scheduler
from tests.helpers import EOG, run_plan


class Device:
    """What the backend is asked: cuts, releases, spills, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def park(self, seq: int) -> None:
        self.calls.append(("park", seq))

    def reuse(self, seq: int, n: int) -> int:
        self.calls.append(("reuse", seq, n))
        return n

    def release(self, seq: int) -> None:
        self.calls.append(("release", seq))

    def spill(self, seq: int, tokens) -> None:
        self.calls.append(("spill", seq, len(tokens)))


def scheduler(device: Device, n_seq_max: int = 2, n_ctx: int = 1000, quantum: int = 1):
    cap = Capacity(256, n_ctx, n_seq_max, n_ctx, quantum, None, quantum)
    parked = ParkedSequences(device, device.spill)  # type: ignore[arg-type]
    return Scheduler(cap, lambda t: t == EOG, device.release, parked=parked)


def request(rid: str, prompt: list[int], max_tokens: int = 3) -> Request:
    return Request(rid, "foreground", 0.0, prompt, max_tokens, ignore_eos=True)


def finish(sched: Scheduler, req: Request) -> None:
    sched.add(req)
    while not req.done:
        run_plan(sched, 256, token=7)


def test_a_conversation_turn_continues_the_sequence_its_last_turn_left():
    device, turn1 = Device(), list(range(100, 140))
    sched = scheduler(device)
    first = request("t1", turn1)
    finish(sched, first)
    assert ("release", first.seq_id) not in device.calls  # parked, not freed
    assert ("park", first.seq_id) in device.calls  # its sampler freed
    assert len(sched.parked) == 1 and sched.parked.cells == 40 + 2  # prompt + 2 fed tokens
    turn2 = turn1 + [7, 7, 7] + list(range(200, 220))  # the answer, then the new question
    second = request("t2", turn2)
    finish(sched, second)
    assert second.seq_id == first.seq_id and second.prefix_reused_tokens == 42
    assert ("reuse", first.seq_id, 42) in device.calls
    assert sched.kv_free == 1000  # reservations returned; parked cells counted apart
    assert sched.parked.stats.hits == 1 and sched.parked.stats.reused_tokens == 42


def test_the_reuse_stops_a_token_short_of_the_prompt_and_at_a_piece_boundary():
    device = Device()
    sched = scheduler(device, quantum=8)
    finish(sched, request("a", list(range(100, 150))))  # parks 52 tokens
    same = request("b", list(range(100, 150)))  # the same prompt again
    finish(sched, same)
    assert same.prefix_reused_tokens == 48  # 49 shared at most, cut to a multiple of 8


def test_an_unrelated_prompt_takes_a_free_sequence_and_the_oldest_parked_is_evicted_last():
    device = Device()
    sched = scheduler(device, n_seq_max=2)
    a, b = request("a", list(range(100, 130))), request("b", list(range(300, 330)))
    finish(sched, a)
    finish(sched, b)  # unrelated: a stays parked, b takes the other sequence
    assert a.seq_id != b.seq_id and len(sched.parked) == 2
    c = request("c", list(range(500, 530)))  # no sequence free: the oldest parked (a) goes
    finish(sched, c)
    assert ("spill", a.seq_id, 32) in device.calls and ("release", a.seq_id) in device.calls
    assert c.seq_id == a.seq_id and c.prefix_reused_tokens == 0
    assert sched.parked.stats.evicted == 1 == sched.parked.stats.spilled


def test_parked_cells_give_way_to_a_request_that_needs_them():
    device = Device()
    sched = scheduler(device, n_seq_max=4, n_ctx=100)
    finish(sched, request("a", list(range(100, 150))))  # parks 52 of the 100 cells
    big = request("big", list(range(300, 380)), max_tokens=10)  # reserves 89 cells
    finish(sched, big)
    assert ("spill", 0, 52) in device.calls and sched.parked.stats.evicted == 1
    assert sched.kv_free - sched.parked.cells >= 0


def test_a_failed_iteration_releases_its_sequences_instead_of_parking_them():
    device = Device()
    sched = scheduler(device)
    req = request("a", list(range(100, 120)))
    sched.add(req)
    for _ in sched.admit():
        pass
    from edgeprefill.runtime.core.plan import Decision

    sched.fail_plan(sched.plan(Decision(256)), "device fault")
    assert ("release", req.seq_id) in device.calls and len(sched.parked) == 0


def test_a_request_finished_at_a_stop_string_keeps_its_answer_to_the_stop_and_parks():
    """A reader found a stop string after the 2nd output token while the engine sampled
    two more: the answer is cut back, it counts as completed, and its sequence is parked
    with all it computed, so the next turn (which resends the answer cut) reuses it."""
    device = Device()
    sched = scheduler(device)
    req = request("a", list(range(100, 120)), max_tokens=10)
    sched.add(req)
    for token in (7, 8, 9, 10):
        run_plan(sched, 256, token=token)
    assert sched.finish(req, 2) and not sched.finish(req, 2)  # once only
    assert req.output == [7, 8] and len(req.token_times_s) == 2
    assert req.finish_reason == "stop" and req.error is None and req.done
    assert sched.parked.cells == 20 + 3 and not sched.running  # the 3 tokens fed back
    turn2 = request("b", list(range(100, 120)) + [7, 8] + list(range(300, 310)))
    finish(sched, turn2)
    assert turn2.seq_id == req.seq_id and turn2.prefix_reused_tokens == 22


def test_common_prefix():
    a = np.array([1, 2, 3, 4], dtype=np.int32)
    assert common_prefix(a, np.array([1, 2, 9], dtype=np.int32)) == 2
    assert common_prefix(a, np.array([1, 2], dtype=np.int32)) == 2
    assert common_prefix(a, np.array([5], dtype=np.int32)) == 0
