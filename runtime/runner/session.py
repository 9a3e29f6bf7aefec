"""One run of a workload on an open backend: requests, engine, results, summary.

Shared by `edgeprefill run` and `edgeprefill compare`, so a comparison runs exactly what a
single run does.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from edgeprefill.runtime.core.contract import Backend
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.driver import Driver, SchedulingBackend
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.core.scheduler import BackgroundLimits
from edgeprefill.runtime.policies import parse_policy
from edgeprefill.runtime.replay.loop import RunOutcome, run_requests
from edgeprefill.runtime.replay.progress import LiveProgress
from edgeprefill.runtime.results.writer import RunWriter, run_meta
from edgeprefill.runtime.runner.drivers import open_driver
from edgeprefill.runtime.traffic.build import build_requests, format_trace
from edgeprefill.runtime.traffic.workload import Workload
from edgeprefill.thermal.energy import energy_summary
from edgeprefill.thermal.guard import ThermalGuard, ThermalSettings
from edgeprefill.thermal.sampler import TelemetrySampler
from edgeprefill.thermal.telemetry import TelemetryConfig, default_sensors, summarize


@dataclass(frozen=True)
class RunOptions:
    """How a run is carried out, beyond its workload, backend and policy."""

    limits: BackgroundLimits | None = None
    progress: bool = True
    telemetry: TelemetryConfig | None = field(default_factory=TelemetryConfig)  # None: off
    thermal: ThermalSettings | None = None  # the thermal-/battery-aware background budget
    # Each run starts with no saved prompt prefixes, so runs of one comparison (and repeated
    # runs) compute the same work; False: start from what earlier runs kept.
    fresh_kv_cache: bool = True


@dataclass(frozen=True)
class RunResult:
    summary: dict[str, Any]
    outcome: RunOutcome
    requests: list[Request]
    out: Path


def run_workload(
    workload: Workload,
    workload_path: Path,
    backend: Backend | SchedulingBackend,
    policy_spec: str,
    out: Path,
    *,
    profile: DeviceProfile | None = None,
    seed: int | None = None,
    options: RunOptions | None = None,
) -> RunResult:
    o = options or RunOptions()
    policy = parse_policy(policy_spec)
    requests = build_requests(workload, backend.tokenizer, seed)
    _check_sampling(backend, requests, workload_path)
    engine = open_driver(backend, policy, o.limits, profile)
    cache = getattr(backend, "prefix_cache", None)
    if cache is not None and o.fresh_kv_cache:
        cache.clear()
    describe = backend.describe()
    simulated = bool(describe.get("simulated", False))
    if o.thermal is not None and (o.telemetry is None or simulated):
        raise UserError(
            "--thermal-aware needs telemetry from a real device: drop --no-telemetry, "
            "and use a real backend rather than --backend sim"
        )
    started = datetime.now(UTC)
    with ExitStack() as stack:
        writer = stack.enter_context(RunWriter(out))
        (out / "arrivals.jsonl").write_text(format_trace(requests))
        config = None if simulated else o.telemetry
        sampler = None
        if config is not None:
            sampler = stack.enter_context(_sampler(config, engine, out))
            if o.thermal is not None:
                engine.guard = ThermalGuard(sampler.latest, o.thermal)
        show = stack.enter_context(LiveProgress(requests, enabled=o.progress))
        outcome = run_requests(engine, requests, writer, show)
        telemetry = _telemetry(sampler, config, writer, simulated)
        meta = run_meta(
            describe,
            policy,
            policy_spec,
            {"name": workload.name, "path": str(workload_path)},
            thermal_aware=None if o.thermal is None else asdict(o.thermal),
            seed=workload.seed if seed is None else seed,
            start_time=started.isoformat(),
            calibration=profile.describe() if profile is not None else None,
            kv_cache=None if cache is None else cache.describe(),
        )
        summary = writer.summary(meta, outcome.duration_s, outcome.interrupted, outcome.not_arrived)
        summary.update(telemetry)
        writer.write_summary(summary)
    return RunResult(summary, outcome, requests, out)


def _check_sampling(
    backend: Backend | SchedulingBackend, requests: list[Request], path: Path
) -> None:
    """Each output format the workload asks for can be enforced here, before anything runs
    (a schema llama.cpp cannot turn into a grammar, a backend without formats)."""
    formats = {r.sampling.output_format: r.sampling for r in requests}
    for fmt, sampling in formats.items():
        if fmt is None:
            continue
        try:
            backend.check_sampling(sampling)
        except ValueError as e:
            raise UserError(f"{path}: json_schema: {e}") from None


def _sampler(config: TelemetryConfig, engine: Driver, out: Path) -> TelemetrySampler:
    return TelemetrySampler(
        default_sensors(config), engine.clock.now, out / "telemetry.jsonl", config.period_s
    )


def _telemetry(
    sampler: TelemetrySampler | None,
    config: TelemetryConfig | None,
    writer: RunWriter,
    simulated: bool,
) -> dict[str, Any]:
    """The run's telemetry and energy for summary.json, or why there are none."""
    if sampler is not None and config is not None:
        sampler.stop()
        return summarize(sampler, config, writer.spans, writer.records)
    why = "simulated backend (virtual clock)" if simulated else "--no-telemetry"
    return {
        "telemetry": {"unavailable": why},
        "energy": energy_summary([], [], [], reasons={"cpu": why, "gpu": why}),
    }
