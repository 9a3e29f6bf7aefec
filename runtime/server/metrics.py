"""Prometheus metrics of a served runtime, fed from its engine thread."""

from __future__ import annotations

from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from edgeprefill.runtime.core.iteration import Iteration
from edgeprefill.runtime.core.request import CLASSES, Request
from edgeprefill.thermal.energy import cpu_series, gpu_series
from edgeprefill.thermal.sampler import TelemetrySampler

# Seconds: chat TTFT from tens of ms to a document's minutes; ITL from a few ms to stalls.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2, 5)
# Fine around 1 ms, the target of a token's own server time (issue 40).
DELIVERY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
)
HANDOVER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._latency_metrics(r)
        self._handover_metrics(r)
        self._state_gauges(r)
        self.preemptions = Counter(
            "edgeprefill_preemptions", "document prompt passes stopped for a chat", registry=r
        )
        self.requests = Counter(
            "edgeprefill_requests_ended",
            "requests ended, by class and outcome",
            ["cls", "outcome"],
            registry=r,
        )
        self.kv_hits = Counter(
            "edgeprefill_kv_restores",
            "prompts that continued a parked sequence or a saved prefix",
            registry=r,
        )
        self.kv_tokens = Counter(
            "edgeprefill_kv_restored_tokens",
            "prompt tokens reused (as usage.prompt_tokens_details.cached_tokens), not computed",
            registry=r,
        )
        self.tokens = Counter(
            "edgeprefill_output_tokens", "tokens generated, by class", ["cls"], registry=r
        )
        self.energy = Gauge(
            "edgeprefill_energy_joules_per_token",
            "energy measured since the server started over the tokens generated since, by "
            "device and source (RAPL, NVML, or an estimate from a declared TDP); absent where "
            "nothing measures it",
            ["device", "source"],
            registry=r,
        )
        self._tdp_w: float | None = None
        self._last_sample: dict[str, Any] | None = None
        self._joules: dict[tuple[str, str], float] = {}  # (device, source) -> since start
        self._n_tokens = 0
        for cls in CLASSES:  # every series present from the start
            self.waiting.labels(cls).set(0)
            self.running.labels(cls).set(0)

    def _latency_metrics(self, r: CollectorRegistry) -> None:
        """What a client waits for: first tokens, gaps between tokens, and the server's own
        share of each streamed token's wait."""
        self.ttft = Histogram(
            "edgeprefill_ttft_seconds",
            "time to first token",
            ["cls"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "edgeprefill_itl_seconds",
            "gaps between a request's tokens",
            ["cls"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.delivery = Histogram(
            "edgeprefill_token_delivery_seconds",
            "the server's own time per streamed token: from the engine's stamp to the SSE "
            "chunk handed to the connection",
            buckets=DELIVERY_BUCKETS,
            registry=r,
        )

    def _handover_metrics(self, r: CollectorRegistry) -> None:
        """How streamed tokens reach the event loop: once an iteration, between device
        calls (`api.handover`)."""
        self.handovers = Counter(
            "edgeprefill_handovers",
            "iterations whose streamed tokens were handed to the event loop, once each",
            registry=r,
        )
        self.handover_wait = Histogram(
            "edgeprefill_handover_wait_seconds",
            "the engine's wait, between device calls, for the event loop to write an "
            "iteration's chunks",
            buckets=HANDOVER_BUCKETS,
            registry=r,
        )
        self.late_writes = Counter(
            "edgeprefill_chunks_written_during_compute",
            "streamed chunks written while the device computed (the hand-over's bound ran "
            "out: the event loop was busy)",
            registry=r,
        )

    def _state_gauges(self, r: CollectorRegistry) -> None:
        """What the engine holds now: queues, the last budget, reserved KV cells."""
        self.waiting = Gauge(
            "edgeprefill_requests_waiting", "requests not admitted yet", ["cls"], registry=r
        )
        self.running = Gauge(
            "edgeprefill_requests_running", "requests holding a sequence", ["cls"], registry=r
        )
        self.budget = Gauge(
            "edgeprefill_prefill_budget_tokens",
            "the policy's last prefill budget (-1: unlimited)",
            registry=r,
        )
        self.kv_reserved = Gauge(
            "edgeprefill_kv_cells_reserved",
            "KV cells held for the requests admitted (prompt and answer), read at each scrape; "
            "0 once every request has ended",
            registry=r,
        )
        self.kv_parked = Gauge(
            "edgeprefill_kv_parked_sequences",
            "sequences of ended requests left in the context for prompts that continue them",
            registry=r,
        )
        self.kv_evicted = Gauge(
            "edgeprefill_kv_parked_evictions",
            "parked sequences given up for another request's sequence or cells (a running "
            "total; each saved to the prefix cache's memory first where there is one)",
            registry=r,
        )
        self.kv_saved_bytes = Gauge(
            "edgeprefill_kv_saved_bytes",
            "bytes of saved prefix states held in memory (--kv-cache-ram bounds them)",
            registry=r,
        )

    def iteration(self, it: Iteration, queues: dict[str, tuple[int, int]]) -> None:
        self.budget.set(-1 if it.plan.budget is None else it.plan.budget)
        if it.preempted:
            self.preemptions.inc()
        if it.handover is not None:
            self.handovers.inc()
            self.handover_wait.observe(it.handover["wait_s"])
            self.late_writes.inc(it.handover["late_writes"])
        for cls, (waiting, running) in queues.items():
            self.waiting.labels(cls).set(waiting)
            self.running.labels(cls).set(running)

    def measure_energy(self, sampler: TelemetrySampler, tdp_w: float | None) -> None:
        """Report energy per token from `sampler`'s samples: each one adds the energy since
        the one before to a running total, so a server that runs for days neither keeps
        every sample nor sums them all again at each scrape."""
        self._tdp_w = tdp_w
        sampler.listeners.append(self._add_energy)

    def ended(self, req: Request) -> None:
        self.requests.labels(req.cls, "error" if req.error else "completed").inc()
        self.tokens.labels(req.cls).inc(len(req.output))
        self._n_tokens += len(req.output)
        if req.token_times_s:
            self.ttft.labels(req.cls).observe(req.token_times_s[0] - req.arrival_s)
            for gap in np.diff(req.token_times_s):
                self.itl.labels(req.cls).observe(float(gap))
        if req.prefix_reused_tokens:
            self.kv_hits.inc()
            self.kv_tokens.inc(req.prefix_reused_tokens)

    def text(self) -> bytes:
        if self._n_tokens:
            for (device, source), joules in list(self._joules.items()):
                self.energy.labels(device, source).set(joules / self._n_tokens)
        return generate_latest(self.registry)

    def _add_energy(self, sample: dict[str, Any]) -> None:
        """On the sampling thread: the energy between the previous sample and this one."""
        last, self._last_sample = self._last_sample, sample
        if last is None:
            return
        pair = [last, sample]
        for device, series in (
            ("cpu", cpu_series(pair, self._tdp_w)),
            ("gpu", gpu_series(pair)),
        ):
            if series is not None:
                key = (device, series.source)
                joules = series.between(float(series.t_s[0]), float(series.t_s[-1]))
                self._joules[key] = self._joules.get(key, 0.0) + joules
