"""Worker subclasses that time every step from `execute_model` to `sample_tokens`.

vLLM loads these by dotted name (`worker_cls`), in whatever process runs the model. The
readings ride to the scheduler on the step's `ModelRunnerOutput` (attribute
`edgeprefill_timings`), the same path the sampled tokens take, so they arrive with tensor
parallelism too (only rank 0's output reaches the scheduler). vLLM's shared empty output
object is copied, never mutated.
"""

from __future__ import annotations

from copy import copy
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from edgeprefill.backends.vllm.iterations import TIMINGS_ATTR
from edgeprefill.backends.vllm.timing import CudaEventTimer, IterationTimer, PerfCounterTimer


class _TimedAsyncOutput(AsyncModelRunnerOutput):
    """Async scheduling: the step's output is materialized later; the readings completed
    by then go with it."""

    def __init__(self, inner: AsyncModelRunnerOutput, worker: _IterationTimingMixin) -> None:
        self._inner = inner
        self._worker = worker

    def get_output(self) -> ModelRunnerOutput:
        return self._worker._attach(self._inner.get_output())


# The mixin is checked as the vLLM worker it is mixed into.
if TYPE_CHECKING:
    _WorkerBase = Worker
else:
    _WorkerBase = object


class _IterationTimingMixin(_WorkerBase):
    _ep_timer: IterationTimer | None = None
    _ep_iterations = 0

    def _timer(self) -> IterationTimer:
        if self._ep_timer is None:
            device = getattr(self, "device", None)
            on_gpu = device is not None and torch.device(device).type == "cuda"
            on_gpu = on_gpu and torch.cuda.is_available()
            self._ep_timer = CudaEventTimer(torch) if on_gpu else PerfCounterTimer()
        return self._ep_timer

    def execute_model(self, scheduler_output: Any) -> Any:
        tokens = scheduler_output.total_num_scheduled_tokens
        if tokens == 0:  # nothing computed: not a step the scheduler counts either
            return super().execute_model(scheduler_output)
        timer = self._timer()
        timer.start(self._ep_iterations, tokens)
        self._ep_iterations += 1
        out = super().execute_model(scheduler_output)
        if out is None:  # sampling follows in sample_tokens
            return out
        timer.stop()  # a step without sampling (pooling, a pipeline stage)
        return self._wrap(out)

    def sample_tokens(self, grammar_output: Any) -> Any:
        out = super().sample_tokens(grammar_output)
        self._timer().stop()
        return self._wrap(out)

    def _wrap(self, out: Any) -> Any:
        if isinstance(out, AsyncModelRunnerOutput):
            return _TimedAsyncOutput(out, self)
        return self._attach(out)

    def _attach(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        readings = self._timer().poll()
        if not readings:
            return out
        if out is EMPTY_MODEL_RUNNER_OUTPUT:
            out = copy(out)
        setattr(out, TIMINGS_ATTR, readings)
        return out

    def edgeprefill_clock(self) -> str:
        """The clock's name, for summary.json (called through `collective_rpc`)."""
        return self._timer().clock


class TimedCPUWorker(_IterationTimingMixin, CPUWorker):
    """vLLM's CPU worker, timed synchronously with perf_counter."""


class TimedGPUWorker(_IterationTimingMixin, Worker):
    """vLLM's GPU worker, timed with CUDA events."""
