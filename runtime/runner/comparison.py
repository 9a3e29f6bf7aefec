"""Running a paired comparison: every policy on the same trace per seed, and P-PAS's load
sweep over burst rates; the statistics are `analysis.compare`'s."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scipy import stats

from edgeprefill.runtime.analysis.compare import (
    METRICS,
    batching_exact,
    build_report,
    outputs_agree,
    token_agreement,
)
from edgeprefill.runtime.core.contract import Backend
from edgeprefill.runtime.core.driver import SchedulingBackend
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.profile import DeviceProfile
from edgeprefill.runtime.runner.session import RunOptions, run_workload
from edgeprefill.runtime.traffic.workload import Workload

log = logging.getLogger(__name__)


def run_comparison(
    spec: Workload,
    path: Path,
    names: list[str],
    baselines: list[str],
    seeds: int,
    make_backend: Callable[[], Backend | SchedulingBackend],
    profile: DeviceProfile | None,
    out: Path,
    *,
    options: RunOptions | None = None,
    simulated: bool = False,
) -> tuple[dict[str, Any], list[str]]:
    """Every policy on the same trace per seed; returns the report and its check lines."""
    summaries: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    problems: list[str] = []
    all_agree, all_reconciled, all_exact, why = True, True, True, ""
    agreement = [0, 0, 0, 0]
    for seed in range(spec.seed, spec.seed + seeds):
        records: dict[str, list[dict[str, Any]]] = {}
        for name in names:
            log.info("seed %d: %s", seed, name)
            result = run_workload(
                spec,
                path,
                make_backend(),
                name,
                out / f"seed{seed}" / name.replace(":", "_"),
                profile=profile,
                seed=seed,
                options=options,
            )
            if result.outcome.interrupted:
                raise UserError(
                    f"interrupted during seed {seed}, {name}; finished runs are in {out}"
                )
            summaries[name].append(result.summary)
            records[name] = [r.record() for r in result.requests]
            all_reconciled &= bool(result.summary["accounting"]["reconciled"])
            exact, reason = batching_exact(result.summary)
            if not exact:
                all_exact, why = False, reason
        agree, found = outputs_agree(records)
        all_agree &= agree
        agreement = [a + b for a, b in zip(agreement, token_agreement(records), strict=True)]
        problems += [f"seed {seed}: {p}" for p in found[:5]]
    equal, compared, same, n = agreement
    rate = f"{equal / compared:.1%} of tokens, {same}/{n} requests identical" if n else "n/a"
    if all_exact:
        checks = ["output tokens agree exactly across policies: " + ("yes" if all_agree else "NO")]
    else:
        checks = [
            f"outputs are not expected to match across policies ({why}); "
            f"token agreement with {names[0]}: {rate}"
        ]
    checks += [
        "request and token counts reconcile in every run: " + ("yes" if all_reconciled else "NO"),
        *(problems if all_exact else []),
    ]
    report = build_report(summaries, baselines)
    report.update(
        workload=spec.name,
        seeds=list(range(spec.seed, spec.seed + seeds)),
        policies=names,
        simulated=simulated,
        outputs_agree=all_agree,
        batching_exact=all_exact,
        token_agreement={
            "tokens": equal / compared if compared else None,
            "requests_identical": same,
            "requests_compared": n,
        },
        reconciled=all_reconciled,
        calibration=profile.describe() if profile is not None else None,
    )
    return report, checks


def with_burst_rate(spec: Workload, rate: float) -> Workload:
    """The workload with every phase faster than its stream's first (steady) phase set to
    `rate`."""
    from edgeprefill.runtime.traffic.workload import PhasedArrivals

    data = spec.model_dump(by_alias=True)
    found = False
    for name, stream in spec.streams.items():
        if isinstance(stream.arrivals, PhasedArrivals):
            phases = data["streams"][name]["arrivals"]["phases"]
            steady = phases[0]["rate_per_s"]
            for phase in phases:
                if phase["rate_per_s"] > steady:
                    phase["rate_per_s"] = rate
                    found = True
    if not found:
        raise UserError(f"workload {spec.name} has no burst phase (a phase faster than the first)")
    return Workload.model_validate(data)


def run_sweep(
    spec: Workload,
    path: Path,
    rates: list[float],
    names: list[str],
    baselines: list[str],
    seeds: int,
    make_backend: Callable[[], Backend | SchedulingBackend],
    profile: DeviceProfile | None,
    out: Path,
    *,
    options: RunOptions | None = None,
    simulated: bool = False,
) -> dict[str, Any]:
    """`run_comparison` at every burst rate, then per baseline, policy and metric the
    geometric mean over rates of the per-rate (seed-averaged) ratio: P-PAS eq. 1-2."""
    per_rate: dict[str, Any] = {}
    for rate in rates:
        report, checks = run_comparison(
            with_burst_rate(spec, rate),
            path,
            names,
            baselines,
            seeds,
            make_backend,
            profile,
            out / f"burst{rate:g}",
            options=options,
            simulated=simulated,
        )
        report["checks"] = checks
        per_rate[f"{rate:g}"] = report
    overall: dict[str, dict[str, dict[str, float | None]]] = {}
    for base in baselines:
        for p in names:
            if p == base:
                continue
            for _, _, label, _ in METRICS:
                ratios = []
                for rep in per_rate.values():
                    a, b = rep["metrics"][p][label], rep["metrics"][base][label]
                    if a and b:
                        ratios.append(a / b)
                value = float(stats.gmean(ratios)) if ratios else None
                overall.setdefault(base, {}).setdefault(p, {})[label] = value
    return {
        "workload": spec.name,
        "burst_rates": rates,
        "policies": names,
        "seeds": seeds,
        "simulated": simulated,
        "per_rate": per_rate,
        "geomean_ratio_over_rates": overall,
        "outputs_agree": all(r["outputs_agree"] for r in per_rate.values()),
        "reconciled": all(r["reconciled"] for r in per_rate.values()),
        "calibration": profile.describe() if profile is not None else None,
    }
