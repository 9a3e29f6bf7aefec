"""Completed-step timing for the vLLM backend, around the thinnest layer: CUDA events are
replaced by fakes (no GPU here), and late readings are matched to the steps they measured."""

from __future__ import annotations

import pytest

from edgeprefill.backends.vllm.iterations import IterationLedger, IterationRecord, prompt_left
from edgeprefill.backends.vllm.timing import CudaEventTimer, PerfCounterTimer
from edgeprefill.runtime.core.plan import Decision, Plan


class FakeEvent:
    """A CUDA event whose completion the test decides; times in ms like torch's."""

    clock_ms = 0.0
    done_up_to = -1.0  # events recorded at or before this time have completed

    def __init__(self, enable_timing: bool = True) -> None:
        self.at: float | None = None

    def record(self) -> None:
        self.at = FakeEvent.clock_ms

    def query(self) -> bool:
        return self.at is not None and self.at <= FakeEvent.done_up_to

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "read before both events completed"
        return end.at - self.at  # type: ignore[operator]


class FakeTorch:
    class cuda:  # noqa: N801
        Event = FakeEvent


def test_cuda_event_readings_arrive_once_complete_in_step_order_without_waiting():
    FakeEvent.clock_ms, FakeEvent.done_up_to = 0.0, -1.0
    timer = CudaEventTimer(FakeTorch)
    for step, ms in enumerate([30.0, 10.0, 20.0]):
        timer.start(step, 100 + step)
        FakeEvent.clock_ms += ms
        timer.stop()
    assert timer.poll() == []  # nothing has completed on the device: no blocking read
    FakeEvent.done_up_to = 40.0  # the first two steps finished
    got = timer.poll()
    assert [(r.step, r.tokens, r.duration_s) for r in got] == [(0, 100, 0.030), (1, 101, 0.010)]
    FakeEvent.done_up_to = 1e9
    assert [(r.step, r.duration_s) for r in timer.poll()] == [(2, 0.020)]
    assert timer.pending == 0


def test_perf_counter_readings_are_ready_when_the_step_returns():
    timer = PerfCounterTimer()
    timer.start(0, 5)
    timer.stop()
    (r,) = timer.poll()
    assert r.step == 0 and r.tokens == 5 and r.duration_s >= 0
    assert timer.poll() == []


def record(step: int, decode: int, prefill: int) -> IterationRecord:
    decodes = tuple(f"d{i}" for i in range(decode))
    plan = Plan(
        Decision(64), decodes, {"p": prefill} if prefill else {}, foreground={"p", *decodes}
    )
    return IterationRecord(step, float(step), plan, 0, decode)


def test_a_late_reading_is_matched_to_the_step_it_measured():
    ledger = IterationLedger()
    ledger.add(record(0, 1, 64))
    ledger.add(record(1, 2, 0))  # async scheduling: step 1 planned before 0's reading
    assert ledger.match(0, 65).plan.n_prefill == 64
    assert ledger.match(1, 2).plan.n_decode == 2
    assert ledger.waiting == 0


def test_readings_that_do_not_line_up_with_steps_are_an_error_not_a_wrong_number():
    ledger = IterationLedger()
    ledger.add(record(0, 1, 64))
    with pytest.raises(RuntimeError, match="no longer line up"):
        ledger.match(0, 3)
    ledger.add(record(1, 1, 0))
    ledger.add(record(2, 1, 0))
    with pytest.raises(RuntimeError, match="without a timing"):
        ledger.match(2, 1)  # step 1's reading never came


def test_prompt_work_left_counts_recomputation_after_preemption_and_never_a_decode():
    assert prompt_left(num_tokens=100, num_output_tokens=0, num_computed=40) == 60
    assert prompt_left(num_tokens=105, num_output_tokens=5, num_computed=104) == 0  # decode
    assert prompt_left(num_tokens=105, num_output_tokens=5, num_computed=0) == 104  # preempted
    assert prompt_left(num_tokens=105, num_output_tokens=5, num_computed=106) == 0  # async
