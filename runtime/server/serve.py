"""Run the app with uvicorn until Ctrl-C, SIGTERM or the engine's failure, then stop the
runtime."""

from __future__ import annotations

import logging
import math
import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeprefill.runtime.api.runtime import Runtime
from edgeprefill.runtime.core.contract import Backend
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.driver import SchedulingBackend
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.scheduler import BackgroundLimits
from edgeprefill.runtime.replay.signals import on_stop_signals
from edgeprefill.runtime.server.app import Routes, ServerOptions, create_app
from edgeprefill.runtime.server.connections import deadline_protocol
from edgeprefill.runtime.server.metrics import ServerMetrics
from edgeprefill.thermal.sampler import TelemetrySampler
from edgeprefill.thermal.telemetry import TelemetryConfig, default_sensors

log = logging.getLogger(__name__)

# Telemetry samples a server holds in memory (10 minutes at the default period): /metrics
# keeps a running energy total, and telemetry.jsonl, with --results, has them all.
KEEP_SAMPLES = 3000

# How long (GOMP_SPINCOUNT) llama.cpp's OpenMP compute threads spin, once a graph is done,
# before they sleep. libgomp's default, 300,000 spins, kept a compute thread on a core
# through each hand-over of tokens to the event loop: on 2 cores the loop and the clients
# then shared one, and token delivery's P99 was 3.2-4.1 ms. At 1,000 it was 1.0-1.2 ms,
# and decode-only iterations no slower (benchmarks/history.md, section AA).
SERVE_SPIN_COUNT = 1000


def quiet_openmp_spin() -> None:
    """Shorten libgomp's spin for `serve`, unless GOMP_SPINCOUNT is set already. libgomp
    reads it once, as it loads: call this before llama.cpp is first imported."""
    os.environ.setdefault("GOMP_SPINCOUNT", str(SERVE_SPIN_COUNT))


@dataclass
class Served:
    """What `serve` runs: the app, the runtime behind it and the telemetry sampler beside
    it; `close` stops both (after the HTTP server has stopped)."""

    app: Any
    runtime: Runtime
    routes: Routes
    sampler: TelemetrySampler | None = None

    def close(self, cancel: bool = False) -> None:
        try:
            self.runtime.shutdown(cancel=cancel)
        finally:
            self.routes.close()
            if self.sampler is not None:
                self.sampler.stop()


def build(
    backend: Backend | SchedulingBackend,
    policy: str,
    *,
    profile: DeviceProfile | None,
    limits: BackgroundLimits | None = None,
    results: Path | None = None,
    telemetry: TelemetryConfig | None = None,
    options: ServerOptions | None = None,
) -> Served:
    """The app, the runtime behind it and, with `telemetry`, the sensors sampled beside it
    (energy per token in /metrics where measured; telemetry.jsonl beside `results`)."""
    metrics = ServerMetrics()
    rt: Runtime | None = None

    def on_iteration(it: Any) -> None:
        assert rt is not None
        metrics.iteration(it, rt.engine.queues())

    rt = Runtime(
        backend,
        policy,
        profile=profile,
        limits=limits,
        results=results,
        on_iteration=on_iteration,
        on_end=metrics.ended,
    )
    if isinstance(rt.engine, Engine):  # the runtime's own; vLLM keeps its own KV account
        _watch_kv(metrics, rt.engine)
    sampler = None
    if telemetry is not None:
        out = None if results is None else results / "telemetry.jsonl"
        sampler = TelemetrySampler(
            default_sensors(telemetry),
            rt.engine.clock.now,
            out,
            telemetry.period_s,
            keep=KEEP_SAMPLES,
        )
        metrics.measure_energy(sampler, telemetry.tdp_w)
        sampler.start()
    options = options or ServerOptions()
    routes = Routes(rt, metrics, options)
    return Served(create_app(routes, options), rt, routes, sampler)


def _watch_kv(metrics: ServerMetrics, engine: Engine) -> None:
    """/metrics reads the engine's KV state at each scrape (plain numbers, read from the
    event loop's thread while the engine thread changes them)."""
    scheduler, n_ctx = engine.scheduler, engine.backend.capacity.n_ctx
    metrics.kv_reserved.set_function(lambda: n_ctx - scheduler.kv_free)
    if (parked := scheduler.parked) is not None:
        metrics.kv_parked.set_function(lambda: len(parked))
        metrics.kv_evicted.set_function(lambda: parked.stats.evicted)
    if (cache := engine.backend.prefix_cache) is not None:
        metrics.kv_saved_bytes.set_function(lambda: cache.describe().get("ram_bytes", 0))


def serve(served: Served, host: str, port: int, cancel_on_shutdown: bool = False) -> int | None:
    """Until Ctrl-C or SIGTERM: then no new request is taken (503); the chats in flight
    finish (or, with `cancel_on_shutdown`, end at once, marked "cancelled at shutdown") for
    up to the options' `shutdown_timeout_s`, after which uvicorn cancels them, whatever
    their clients do (a half-sent body held the exit for as long as its client liked). The
    documents still being read end at the signal, unless `finish_documents`. Returns the
    signal that stopped it, for the caller to raise once it has closed what it holds (a
    shell then sees 130 or 143, as for any program a signal stopped): the runtime has
    written its results by then. If the engine fails, its requests have ended with the
    reason: the server stops the same way, and the caller finds `runtime.failure` set."""
    import uvicorn

    runtime, options = served.runtime, served.routes.options
    received: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Queued: the event loop never blocks.
            runtime.stop(cancel=cancel_on_shutdown, cancel_background=not options.finish_documents)
            super().handle_exit(sig, frame)

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            """uvicorn's own raises the signal again as soon as the HTTP server stops: for
            SIGTERM that ended the process before the engine thread had written
            summary.json. Here the caller raises it, after `close`."""

            def take(signum: int) -> None:
                received.append(signum)
                self.handle_exit(signum, None)

            with on_stop_signals(take):
                yield

        async def on_tick(self, counter: int) -> bool:
            if runtime.failure is not None and not self.should_exit:
                log.error("stopping the server: %s", runtime.failure)
                self.should_exit = True
            return await super().on_tick(counter)

    raise_open_files_limit()
    server = Server(uvicorn_config(served, host, port))
    log.info("serving on http://%s:%d/v1 (Ctrl-C stops)", host, port)
    try:
        server.run()  # returns once open responses have ended, or were cancelled
    finally:
        # Nobody can read an answer now: end what is left, documents too unless asked.
        served.close(cancel=not options.finish_documents)
    return received[0] if received else None


def uvicorn_config(served: Served, host: str, port: int) -> Any:
    """uvicorn's settings for the app: the connections' deadlines, the bounded shutdown."""
    import uvicorn

    options = served.routes.options
    return uvicorn.Config(
        served.app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        http=deadline_protocol(options.deadlines),
        timeout_keep_alive=math.ceil(options.deadlines.idle_s),
        timeout_graceful_shutdown=math.ceil(options.shutdown_timeout_s),
    )


def raise_open_files_limit() -> None:
    """Raise the soft limit on open files to the hard one: every connection takes a file
    descriptor until its deadline closes it, and a desktop's default soft limit (1,024)
    would let a few idle clients use them all."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
