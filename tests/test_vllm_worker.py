"""The timed worker's own logic over a stand-in for vLLM's worker (no model): readings ride
on the step's output, vLLM's shared empty output is never mutated, async outputs carry the
readings completed when they are materialized, and CLI errors for vLLM are one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs its CPU build)")

from vllm.v1.outputs import (  # noqa: E402
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
)

from edgeprefill.backends.vllm.iterations import TIMINGS_ATTR  # noqa: E402
from edgeprefill.backends.vllm.worker import _IterationTimingMixin  # noqa: E402

pytestmark = pytest.mark.vllm


class StandIn:
    """What vLLM's worker returns: None from execute_model, then the sampled output."""

    def __init__(self, sampled, execute=None) -> None:
        self.sampled, self.execute = sampled, execute

    def execute_model(self, scheduler_output):
        return self.execute

    def sample_tokens(self, grammar_output):
        return self.sampled


class Timed(_IterationTimingMixin, StandIn):
    pass


def step(tokens: int) -> SimpleNamespace:
    return SimpleNamespace(total_num_scheduled_tokens=tokens)


def test_each_step_output_carries_its_reading_with_the_step_index():
    w = Timed(ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}))
    for i in range(3):
        assert w.execute_model(step(10 + i)) is None
        out = w.sample_tokens(None)
        (reading,) = getattr(out, TIMINGS_ATTR)
        assert (reading.step, reading.tokens) == (i, 10 + i) and reading.duration_s >= 0
    assert w.edgeprefill_clock() == "perf_counter"


def test_the_shared_empty_output_is_copied_not_mutated():
    w = Timed(EMPTY_MODEL_RUNNER_OUTPUT)
    w.execute_model(step(4))
    out = w.sample_tokens(None)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT and getattr(out, TIMINGS_ATTR)
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, TIMINGS_ATTR)


def test_a_step_with_nothing_scheduled_is_not_timed_or_counted():
    w = Timed(ModelRunnerOutput(req_ids=[], req_id_to_index={}), execute=EMPTY_MODEL_RUNNER_OUTPUT)
    assert w.execute_model(step(0)) is EMPTY_MODEL_RUNNER_OUTPUT
    w.execute = None
    w.execute_model(step(7))
    (reading,) = getattr(w.sample_tokens(None), TIMINGS_ATTR)
    assert reading.step == 0  # the empty step did not advance the worker's count


def test_async_outputs_get_their_readings_when_materialized():
    inner_out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})

    class Later(AsyncModelRunnerOutput):
        def get_output(self):
            return inner_out

    w = Timed(Later())
    w.execute_model(step(3))
    wrapped = w.sample_tokens(None)
    assert isinstance(wrapped, AsyncModelRunnerOutput)
    (reading,) = getattr(wrapped.get_output(), TIMINGS_ATTR)
    assert reading.tokens == 3
