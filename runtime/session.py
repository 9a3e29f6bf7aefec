"""One run of a workload on an open backend: requests, engine, results, summary.

Shared by `edgeprefill run` and `edgeprefill compare`, so a comparison runs exactly what a
single run does.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from edgeprefill.backends.base import Backend
from edgeprefill.runtime.calibrate import DeviceProfile
from edgeprefill.runtime.console import LiveProgress
from edgeprefill.runtime.engine import Engine
from edgeprefill.runtime.errors import UserError
from edgeprefill.runtime.policy import parse_policy
from edgeprefill.runtime.request import Request
from edgeprefill.runtime.results import RunWriter
from edgeprefill.runtime.run import RunOutcome, run_requests
from edgeprefill.runtime.scheduler import BackgroundLimits
from edgeprefill.runtime.trace import build_requests
from edgeprefill.runtime.workload import Workload
from edgeprefill.thermal.machine import describe_machine


@dataclass(frozen=True)
class RunResult:
    summary: dict[str, Any]
    outcome: RunOutcome
    requests: list[Request]
    out: Path


def run_workload(
    workload: Workload,
    workload_path: Path,
    backend: Backend,
    policy_spec: str,
    out: Path,
    *,
    profile: DeviceProfile | None = None,
    seed: int | None = None,
    limits: BackgroundLimits | None = None,
    progress: bool = True,
) -> RunResult:
    policy = parse_policy(policy_spec)
    requests = build_requests(workload, backend.tokenizer, seed)
    try:
        engine = Engine(backend, policy, limits=limits, profile=profile)
    except ValueError as e:
        raise UserError(f"--max-background/--foreground-kv: {e}") from None
    started = datetime.now(UTC)
    with RunWriter(out) as writer, LiveProgress(requests, enabled=progress) as show:
        try:
            outcome = run_requests(engine, requests, writer, show)
        except ValueError as e:  # a policy left without the parameters it needs
            raise UserError(str(e)) from None
        describe = backend.describe()
        meta = {
            "backend": describe,
            "simulated": bool(describe.get("simulated", False)),
            "policy": {**policy.describe(), "spec": policy_spec},
            "workload": {"name": workload.name, "path": str(workload_path)},
            "seed": workload.seed if seed is None else seed,
            "start_time": started.isoformat(),
            "machine": describe_machine(),
            "calibration": profile.describe() if profile is not None else None,
        }
        summary = writer.summary(meta, outcome.duration_s, outcome.interrupted, outcome.not_arrived)
        writer.write_summary(summary)
    return RunResult(summary, outcome, requests, out)
