"""Result files of a run (the contract: docs/running.md, "What a run writes").

requests.jsonl is appended as requests finish, so a crash or Ctrl-C never loses finished
work; summary.json is written last, computed from exactly the request records written, so it
always agrees with requests.jsonl. iterations.jsonl is written `ITERATIONS_AT_ONCE` lines
at a time, whatever is left whenever the engine has nothing to do (`flush`: a served
runtime's file is current while it waits for requests), and in full on close. One record
serialized right after a `llama_decode` has streamed the weights through the caches takes
~75 us, one of a batch ~15 us, and that time is between two iterations, where a chat's next
token waits: mostly 0.7-3 ms every 64 iterations, where batches of 256 took 3-37 ms each
(measured: no cheaper a line). Both files are serialized by orjson, ~3x faster than the
standard library's encoder on these records (floats are most of them).

Nothing but counters stays in memory: a server writes results for days. The records, the
iterations' spans and the preemptions are read back from the files when asked for (the
summary, energy by class), one pass each.
"""

from __future__ import annotations

import bisect
import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from edgeprefill.runtime.analysis.metrics import class_summary, completed
from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.iteration import Iteration
from edgeprefill.runtime.core.private import open_private, private_folder, set_aside
from edgeprefill.runtime.core.request import CLASSES, Request
from edgeprefill.runtime.core.resource import Closeable
from edgeprefill.thermal.energy import IterationSpan
from edgeprefill.thermal.machine import describe_machine

ITERATIONS_AT_ONCE = 64
# One JSON object per line; NumPy numbers (a policy's state may hold them) as plain numbers.
_LINE = orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY


def run_meta(
    backend: dict[str, Any], policy: BudgetPolicy, spec: str, workload: dict[str, Any], **more: Any
) -> dict[str, Any]:
    """What summary.json says of a run, built once for `run`, the embedding API and the
    server: the backend, the policy (`spec` as given, its parameters as it ran), the
    workload and the machine; `more` adds what only one of them knows."""
    return {
        "backend": backend,
        "simulated": bool(backend.get("simulated", False)),
        "policy": {**policy.describe(), "spec": spec},
        "workload": workload,
        "machine": describe_machine(),
        **more,
    }


RESULT_FILES = ("requests.jsonl", "iterations.jsonl", "summary.json", "telemetry.jsonl")


class RunWriter(Closeable):
    def __init__(self, out_dir: Path, keep_earlier: bool = False) -> None:
        """Into `out_dir`, readable by this user alone (the requests' outputs are their
        answers). `keep_earlier`: result files already there are renamed `NAME.1`, `.2`...
        rather than overwritten (a server restarted with the same folder)."""
        try:
            private_folder(out_dir)
            if keep_earlier:
                for name in RESULT_FILES:
                    set_aside(out_dir / name)
            self._requests: IO[bytes] = open_private(out_dir / "requests.jsonl")
            self._iterations: IO[bytes] = open_private(out_dir / "iterations.jsonl")
        except OSError as e:
            raise UserError(f"cannot write results to {out_dir}: {e.strerror}") from None
        self.out_dir = out_dir
        self.n_iterations = 0
        self.prefill_tokens = 0  # in iterations that completed
        self.decode_tokens = 0
        self._unwritten: list[Iteration] = []

    def request(self, req: Request) -> None:
        self._requests.write(orjson.dumps(req.record(), option=_LINE))
        self._requests.flush()  # a finished request is on disk before the run goes on

    def iteration(self, it: Iteration) -> None:
        """Record an iteration; the requests it finished are recorded with `request`."""
        self.n_iterations += 1
        if it.error is None:
            self.prefill_tokens += it.plan.n_prefill
            self.decode_tokens += it.plan.n_decode
        self._unwritten.append(it)
        if len(self._unwritten) >= ITERATIONS_AT_ONCE:
            self.flush()

    def flush(self) -> None:
        """Write the iterations recorded so far: call it when the engine is idle."""
        if not self._unwritten:
            return
        lines = b"".join(orjson.dumps(it.record(), option=_LINE) for it in self._unwritten)
        self._unwritten.clear()
        self._iterations.write(lines)
        self._iterations.flush()

    @property
    def records(self) -> list[dict[str, Any]]:
        """The request records written so far."""
        return list(self._read("requests.jsonl", self._requests))

    @property
    def spans(self) -> list[IterationSpan]:
        """When each completed iteration ran and what each class computed in it."""
        spans = []
        for it in self._iterations_written():
            if it["error"] is None:
                foreground = it["n_decode_foreground"] + it["n_prefill_foreground"]
                background = it["n_decode"] + it["n_prefill"] - foreground
                end = it["t_start_s"] + it["duration_s"]
                spans.append(IterationSpan(it["t_start_s"], end, foreground, background))
        return spans

    @property
    def preemptions(self) -> list[dict[str, Any]]:
        return [it["preempted"] for it in self._iterations_written() if "preempted" in it]

    def _iterations_written(self) -> Iterator[dict[str, Any]]:
        if not self._iterations.closed:
            self.flush()
        return self._read("iterations.jsonl", self._iterations)

    def _read(self, name: str, file: IO[bytes]) -> Iterator[dict[str, Any]]:
        """A file's records, line by line; none where it is not a plain file (a results
        folder whose file is a device: nothing written there can be read back)."""
        path = self.out_dir / name
        if not stat.S_ISREG(path.stat().st_mode):
            return
        if not file.closed:
            file.flush()
        with path.open("rb") as f:
            for line in f:
                yield orjson.loads(line)

    def summary(
        self, meta: dict[str, Any], duration_s: float, interrupted: bool, not_arrived: int
    ) -> dict[str, Any]:
        recs = self.records
        n_done = sum(completed(r) for r in recs)
        arrivals = [r["arrival_s"] for r in recs]
        last_tokens = [r["token_times_s"][-1] for r in recs if r["token_times_s"]]
        makespan = max(last_tokens) - min(arrivals) if last_tokens else 0.0
        prefilled = sum(r["prefilled_tokens"] for r in recs)
        fed = sum(max(len(r["output_token_ids"]) - 1, 0) for r in recs)
        accounting = {
            "submitted": len(recs),
            "completed": n_done,
            "failed": len(recs) - n_done,
            "not_arrived": not_arrived,
            "prefill_tokens_iterations": self.prefill_tokens,
            "prefill_tokens_requests": prefilled,
            "decode_tokens_iterations": self.decode_tokens,
            "decode_tokens_requests": fed,
        }
        accounting["reconciled"] = (
            accounting["submitted"] == accounting["completed"] + accounting["failed"]
            and self.prefill_tokens == prefilled
            and self.decode_tokens == fed
            and all(completed(r) or r["error"] for r in recs)
        )
        return {
            **meta,
            "completed": n_done,
            "failed": len(recs) - n_done,
            "interrupted": interrupted,
            "duration_s": duration_s,
            "makespan_s": makespan,
            "iterations": self.n_iterations,
            "accounting": accounting,
            "preemption": self._preemption(),
            "step_wait": self._iteration_wait(recs),
            **{c: class_summary([r for r in recs if r["class"] == c], duration_s) for c in CLASSES},
        }

    def _preemption(self) -> dict[str, Any]:
        """Background iterations stopped for a foreground arrival: how many, prompt tokens
        kept and lost (planned but not kept: the stopped micro-batch's, partly computed,
        and any not started), and how long from the arrival to the abort landing."""
        preemptions = self.preemptions
        latencies = [p["abort_latency_s"] for p in preemptions if p["abort_latency_s"] is not None]
        return {
            "count": len(preemptions),
            "prompt_tokens_kept": sum(p["kept"] for p in preemptions),
            "prompt_tokens_lost": sum(p["lost"] for p in preemptions),
            "median_abort_latency_ms": float(np.median(latencies)) * 1e3 if latencies else None,
            "max_abort_latency_ms": max(latencies) * 1e3 if latencies else None,
        }

    def _iteration_wait(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """How long chats that arrived while an iteration was running waited for it to end: the
        part of a first token no scheduling decision can shorten once the iteration started, so
        what a backend that cannot stop an iteration (vLLM) must bound by the iterations it plans."""
        spans = self.spans
        starts = [s.t_start_s for s in spans]  # in order: iterations run one at a time
        waits = []
        for r in records:
            # One that starts at the arrival holds the chat (on the simulator's clock the
            # times are equal): only one started before it keeps the chat waiting.
            i = bisect.bisect_left(starts, r["arrival_s"]) - 1
            if r["class"] == "foreground" and i >= 0 and spans[i].t_end_s > r["arrival_s"]:
                waits.append(spans[i].t_end_s - r["arrival_s"])
        return {
            "foreground_arrivals_mid_step": len(waits),
            "median_ms": float(np.median(waits)) * 1e3 if waits else None,
            "max_ms": max(waits) * 1e3 if waits else None,
        }

    def write_summary(self, summary: dict[str, Any]) -> None:
        with open_private(self.out_dir / "summary.json") as f:
            f.write(json.dumps(summary, indent=2).encode() + b"\n")

    def close(self) -> None:
        if not self._iterations.closed:
            self.flush()
        for f in (self._requests, self._iterations):
            if not f.closed:
                f.close()
