"""What one vLLM step did, counted from the scheduler's decisions, in the runtime's terms.

Kept free of vLLM imports so the matching of late timings to steps is testable alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgeprefill.runtime.core.plan import IterationTiming, Plan
from edgeprefill.runtime.core.request import RequestClass

TIMINGS_ATTR = "edgeprefill_timings"  # on ModelRunnerOutput: the worker's readings
FOREGROUND_PRIORITY = 0  # vLLM runs lower priorities first
BACKGROUND_PRIORITY = 1


# vLLM's default worker for each platform -> the timed subclass that replaces it.
TIMED_WORKERS = {
    "vllm.v1.worker.cpu_worker.CPUWorker": "edgeprefill.backends.vllm.worker.TimedCPUWorker",
    "vllm.v1.worker.gpu_worker.Worker": "edgeprefill.backends.vllm.worker.TimedGPUWorker",
}


def class_of(priority: int) -> RequestClass:
    return "foreground" if priority <= FOREGROUND_PRIORITY else "background"


def prompt_left(num_tokens: int, num_output_tokens: int, num_computed: int) -> int:
    """Tokens still to prefill: everything known but the newest output token, which is the
    next decode's input. After a preemption vLLM recomputes prompt and outputs alike, so
    those count as prompt work too; a decode (computed up to its newest token) has none."""
    known_inputs = num_tokens - (1 if num_output_tokens > 0 else 0)
    return max(known_inputs - num_computed, 0)


@dataclass
class IterationRecord:
    """A scheduled step, until its timing arrives."""

    step: int  # the scheduler's count of steps that computed tokens, from 0
    t_start_s: float
    plan: Plan
    ctx_work: int
    n_sampled: int

    @property
    def tokens(self) -> int:
        return self.plan.n_decode + self.plan.n_prefill

    def timing(self, duration_s: float) -> IterationTiming:
        return IterationTiming(
            duration_s=duration_s,
            n_decode=self.plan.n_decode,
            n_prefill=self.plan.n_prefill,
            n_decode_foreground=self.plan.n_decode_foreground,
            budget=self.plan.budget,
            n_chunks=len(self.plan.prefill),
            ctx_work=self.ctx_work,
            n_sampled=self.n_sampled,
            n_prefill_foreground=self.plan.n_prefill_foreground,
        )


@dataclass(frozen=True)
class CompletedIteration:
    record: IterationRecord
    timing: IterationTiming
    policy_state: dict[str, Any]


class IterationLedger:
    """Scheduled steps waiting for their timing. Under async scheduling (or CUDA events
    read once complete) a reading arrives a step or more after its step; it is matched by
    the step index both sides count, and its token count must agree."""

    def __init__(self, next_step: int = 0) -> None:
        self._pending: dict[int, IterationRecord] = {}
        self.next_step = next_step  # the worker's count goes on across runs on one engine

    def add(self, record: IterationRecord) -> None:
        self._pending[record.step] = record
        self.next_step = record.step + 1

    def match(self, step: int, tokens: int) -> IterationRecord:
        record = self._pending.pop(step, None)
        if record is None:
            raise RuntimeError(
                f"a timing for step {step}, which was never scheduled or timed twice"
            )
        if record.tokens != tokens:
            raise RuntimeError(
                f"step {step}: the worker computed {tokens} tokens, the scheduler planned "
                f"{record.tokens}; timings no longer line up with steps"
            )
        # Readings come oldest first, so any earlier step still pending lost its reading.
        lost = [s for s in self._pending if s < step]
        if lost:
            raise RuntimeError(f"steps {lost} completed without a timing")
        return record

    @property
    def waiting(self) -> int:
        return len(self._pending)
