"""Running a paired comparison: every policy on the same trace per seed, and P-PAS's load
sweep over burst rates; the statistics are `analysis.compare`'s."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.driver import SchedulingBackend
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.runner.session import RunOptions, run_workload
from edgeprefill.runtime.traffic.workload import Workload

log = logging.getLogger(__name__)


class ComparisonInterrupted(Exception):
    """Ctrl-C or SIGTERM stopped one of the runs: the runs before it are whole, that one is
    written and marked interrupted, none after it started."""

    def __init__(self, where: str, signum: int, finished: list[str]) -> None:
        super().__init__(f"interrupted during {where}")
        self.where, self.signum, self.finished = where, signum, finished


@dataclass(frozen=True)
class Comparison:
    """What `compare` and `sweep` share: the workload, the policies, the paired trials and
    the device every run opens."""

    spec: Workload
    path: Path  # the workload's file, for each run's summary
    names: list[str]  # policy specs, each run on every seed
    baselines: list[str]  # the policies ratios are taken against
    seeds: int  # paired trials: the workload's seed, seed+1, ...
    make_backend: Callable[[], Backend | SchedulingBackend]
    profile: DeviceProfile | None
    out: Path
    options: RunOptions | None = None
    simulated: bool = False

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.spec.seed, self.spec.seed + self.seeds))


@dataclass
class Checks:
    """What every run of a comparison must show, tallied over its seeds."""

    agree: bool = True  # every policy produced the same tokens
    reconciled: bool = True
    exact: bool = True  # every run's batch shapes were measured bit-identical
    why: str = ""  # why not, where not
    agreement: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    problems: list[str] = field(default_factory=list)

    def add_run(self, summary: dict[str, Any]) -> None:
        self.reconciled &= bool(summary["accounting"]["reconciled"])
        exact, reason = batching_exact(summary)
        if not exact:
            self.exact, self.why = False, reason

    def add_seed(self, seed: int, records: dict[str, list[dict[str, Any]]]) -> None:
        agree, found = outputs_agree(records)
        self.agree &= agree
        self.agreement = [
            a + b for a, b in zip(self.agreement, token_agreement(records), strict=True)
        ]
        self.problems += [f"seed {seed}: {p}" for p in found[:5]]

    def lines(self, reference: str) -> list[str]:
        equal, compared, same, n = self.agreement
        if self.exact:
            agree = "yes" if self.agree else "NO"
            lines = [f"output tokens agree exactly across policies: {agree}"]
        else:
            rate = (
                f"{equal / compared:.1%} of tokens, {same}/{n} requests identical" if n else "n/a"
            )
            lines = [
                f"outputs are not expected to match across policies ({self.why}); "
                f"token agreement with {reference}: {rate}"
            ]
        reconciled = "yes" if self.reconciled else "NO"
        lines.append(f"request and token counts reconcile in every run: {reconciled}")
        return lines + (self.problems if self.exact else [])

    def report(self) -> dict[str, Any]:
        equal, compared, same, n = self.agreement
        return {
            "outputs_agree": self.agree,
            "batching_exact": self.exact,
            "token_agreement": {
                "tokens": equal / compared if compared else None,
                "requests_identical": same,
                "requests_compared": n,
            },
            "reconciled": self.reconciled,
        }


def run_comparison(c: Comparison) -> tuple[dict[str, Any], list[str]]:
    """Every policy on the same trace per seed; returns the report and its check lines."""
    summaries: dict[str, list[dict[str, Any]]] = {n: [] for n in c.names}
    checks = Checks()
    for seed in c.seed_list:
        records: dict[str, list[dict[str, Any]]] = {}
        for name in c.names:
            log.info("seed %d: %s", seed, name)
            out = c.out / f"seed{seed}" / name.replace(":", "_")
            result = run_workload(
                c.spec,
                c.path,
                c.make_backend(),
                name,
                out,
                profile=c.profile,
                seed=seed,
                options=c.options,
            )
            if result.outcome.interrupted:
                finished = [str(p.parent) for p in sorted(c.out.glob("*/*/summary.json"))]
                finished.remove(str(out))
                raise ComparisonInterrupted(
                    f"seed {seed}, {name}", result.outcome.signal or 2, finished
                )
            summaries[name].append(result.summary)
            records[name] = [r.record() for r in result.requests]
            checks.add_run(result.summary)
        checks.add_seed(seed, records)
    report = build_report(summaries, c.baselines)
    report.update(
        workload=c.spec.name,
        seeds=c.seed_list,
        policies=c.names,
        simulated=c.simulated,
        **checks.report(),
        calibration=c.profile.describe() if c.profile is not None else None,
    )
    return report, checks.lines(c.names[0])


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


def run_sweep(c: Comparison, rates: list[float]) -> dict[str, Any]:
    """`run_comparison` at every burst rate, then per baseline, policy and metric the
    geometric mean over rates of the per-rate (seed-averaged) ratio: P-PAS eq. 1-2."""
    per_rate: dict[str, Any] = {}
    for rate in rates:
        at_rate = replace(c, spec=with_burst_rate(c.spec, rate), out=c.out / f"burst{rate:g}")
        report, checks = run_comparison(at_rate)
        report["checks"] = checks
        per_rate[f"{rate:g}"] = report
    overall: dict[str, dict[str, dict[str, float | None]]] = {}
    for base in c.baselines:
        for p in c.names:
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
        "workload": c.spec.name,
        "burst_rates": rates,
        "policies": c.names,
        "seeds": c.seeds,
        "simulated": c.simulated,
        "per_rate": per_rate,
        "geomean_ratio_over_rates": overall,
        "outputs_agree": all(r["outputs_agree"] for r in per_rate.values()),
        "reconciled": all(r["reconciled"] for r in per_rate.values()),
        "calibration": c.profile.describe() if c.profile is not None else None,
    }
