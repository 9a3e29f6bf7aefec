"""Where completed steps go when vLLM's own server runs the scheduler (`vllm serve
--scheduler-cls ...`): no edgeprefill driver takes them there, so rather than pile up they
are written, one line each in iterations.jsonl's format plus the step's index, to the file
named by `"steps"` in the additional config, or dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgeprefill.backends.vllm.iterations import TIMED_WORKERS, CompletedIteration
from edgeprefill.runtime.core.iteration import Iteration


class IterationLog:
    def __init__(self, path: Path | None) -> None:
        # Line-buffered: a line per step, whole even if the server is killed.
        self._file = None if path is None else Path(path).open("a", buffering=1)

    def __call__(self, step: CompletedIteration) -> None:
        if self._file is None:
            return
        r = step.record
        it = Iteration(r.t_start_s, r.plan, step.timing, step.policy_state)
        self._file.write(json.dumps({"step": r.step, **it.record()}) + "\n")


def check_timed_worker(parallel_config: Any) -> None:
    """The policy learns from each step's time, which only edgeprefill's worker measures;
    without it the steps would wait for readings that never come."""
    worker = parallel_config.worker_cls
    if worker not in TIMED_WORKERS.values():
        timed = TIMED_WORKERS.get(worker, " or ".join(TIMED_WORKERS.values()))
        raise ValueError(
            f"edgeprefill's scheduler needs its timed worker, not {worker}: add "
            f"--worker-cls {timed}"
        )
