"""Paired comparison of policies on the same arrivals and prompts.

For every seed each policy runs the identical request trace. Per metric we report the mean
over seeds, and against each baseline the geometric mean of the per-seed ratios (P-PAS eq.
1-2, with seeds in place of rates) and a paired 95% Student-t interval of the per-seed
relative change (DLFP section 4.3). Output agreement (greedy token ids per request) and
request/token reconciliation are checked and reported, not assumed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np
from scipy import stats

from edgeprefill.backends.base import Backend
from edgeprefill.runtime.calibrate import DeviceProfile
from edgeprefill.runtime.errors import UserError
from edgeprefill.runtime.session import RunOptions, run_workload
from edgeprefill.runtime.workload import Workload

# (class, summary key, label, lower is better)
METRICS: list[tuple[str, str, str, bool]] = [
    ("foreground", "mean_ttft_ms", "fg mean TTFT ms", True),
    ("foreground", "p99_ttft_ms", "fg P99 TTFT ms", True),
    ("foreground", "mean_itl_ms", "fg mean ITL ms", True),
    ("foreground", "p99_itl_ms", "fg P99 ITL ms", True),
    ("foreground", "mean_e2el_ms", "fg mean E2E ms", True),
    ("foreground", "p99_e2el_ms", "fg P99 E2E ms", True),
    ("background", "mean_ttft_ms", "bg mean TTFT ms", True),
    ("background", "p99_e2el_ms", "bg P99 E2E ms", True),
    ("background", "span_prefill_tok_s", "bg prefill tok/s", False),
    ("background", "makespan_s", "bg makespan s", True),
    ("", "makespan_s", "makespan s", True),
]


def metric(summary: dict[str, Any], cls: str, key: str) -> float | None:
    value = summary[cls][key] if cls else summary[key]
    return None if value is None else float(value)


def paired(policy: Sequence[float], baseline: Sequence[float]) -> dict[str, Any]:
    """Geometric-mean ratio and a paired 95% t-interval of the relative change."""
    pairs = [(p, b) for p, b in zip(policy, baseline, strict=True) if p is not None and b and p > 0]
    if not pairs:
        return {"n": 0, "geomean_ratio": None, "change_mean": None, "change_ci95": None}
    ratios = np.array([p / b for p, b in pairs])
    change = ratios - 1.0
    out: dict[str, Any] = {
        "n": len(pairs),
        "ratios": [float(r) for r in ratios],
        "geomean_ratio": float(math.exp(np.mean(np.log(ratios)))),
        "change_mean": float(change.mean()),
        "change_ci95": None,
    }
    if len(pairs) >= 2:
        half = float(
            stats.t.ppf(0.975, len(pairs) - 1) * change.std(ddof=1) / math.sqrt(len(pairs))
        )
        out["change_ci95"] = [out["change_mean"] - half, out["change_mean"] + half]
    return out


def outputs_agree(runs: dict[str, list[dict[str, Any]]]) -> tuple[bool, list[str]]:
    """Per seed: do all policies produce the same token ids for every request?"""
    problems: list[str] = []
    reference_name, reference = next(iter(runs.items()))
    ref = {r["id"]: r["output_token_ids"] for r in reference}
    for name, records in runs.items():
        for r in records:
            if r["error"] is None and ref.get(r["id"]) != r["output_token_ids"]:
                problems.append(f"{r['id']}: {name} differs from {reference_name}")
    return not problems, problems


def token_agreement(runs: dict[str, list[dict[str, Any]]]) -> tuple[int, int, int, int]:
    """Against the first policy: (equal tokens, tokens compared, identical requests,
    requests compared), tokens compared position by position."""
    reference = {r["id"]: r["output_token_ids"] for r in next(iter(runs.values()))}
    equal = compared = same = n = 0
    for records in list(runs.values())[1:]:
        for r in records:
            ref = reference.get(r["id"])
            if r["error"] is not None or ref is None:
                continue
            out = r["output_token_ids"]
            equal += sum(a == b for a, b in zip(out, ref, strict=False))
            compared += max(len(out), len(ref))
            same += out == ref
            n += 1
    return equal, compared, same, n


def batching_exact(summary: dict[str, Any]) -> tuple[bool, str]:
    """Whether a run's batch shapes were all measured bit-identical, and why not."""
    batching = summary.get("backend", {}).get("batching")
    if batching is None:  # a backend without batch-dependent kernels (the simulator)
        return True, ""
    return bool(batching["exact"]), str(batching["reason"])


def build_report(
    summaries: dict[str, list[dict[str, Any]]], baselines: list[str]
) -> dict[str, Any]:
    """`summaries[policy][i]` is the summary of seed i."""
    table = {
        p: {label: _mean([metric(s, c, k) for s in runs]) for c, k, label, _ in METRICS}
        for p, runs in summaries.items()
    }
    ratios: dict[str, dict[str, dict[str, Any]]] = {}
    for base in baselines:
        for p, runs in summaries.items():
            if p == base:
                continue
            ratios.setdefault(base, {})[p] = {
                label: paired(
                    [metric(s, c, k) for s in runs], [metric(s, c, k) for s in summaries[base]]
                )
                for c, k, label, _ in METRICS
            }
    return {"metrics": table, "vs_baseline": ratios}


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def format_report(report: dict[str, Any], checks: list[str]) -> str:
    policies = list(report["metrics"])
    width = max(16, *(len(p) + 2 for p in policies))
    title = " edgeprefill compare" + (" (SIMULATED)" if report.get("simulated") else "") + " "
    lines = [f"{title:=^80}", f"Mean over seeds {report.get('seeds')}:"]
    lines.append(f"{'':<18}" + "".join(f"{p:>{width}}" for p in policies))
    for _, _, label, _ in METRICS:
        row = [report["metrics"][p][label] for p in policies]
        lines.append(
            f"{label:<18}" + "".join(f"{'n/a' if v is None else f'{v:.1f}':>{width}}" for v in row)
        )
    for base, per_policy in report["vs_baseline"].items():
        lines.append(f"\nAgainst {base}: geometric-mean ratio [paired 95% CI of the change]")
        for p, per_metric in per_policy.items():
            lines.append(f"  {p}")
            for _, _, label, lower in METRICS:
                r = per_metric[label]
                if r["geomean_ratio"] is None:
                    continue
                ci = r["change_ci95"]
                ci_text = "n<2" if ci is None else f"{ci[0]:+.1%} .. {ci[1]:+.1%}"
                better = (r["geomean_ratio"] < 1) == lower
                lines.append(
                    f"    {label:<18} x{r['geomean_ratio']:.3f} [{ci_text}]"
                    f"{'  better' if better and r['geomean_ratio'] != 1 else ''}"
                )
    lines.append("")
    lines += checks
    return "\n".join(lines)


def run_comparison(
    spec: Workload,
    path: Path,
    names: list[str],
    baselines: list[str],
    seeds: int,
    make_backend: Callable[[], Backend],
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
            click.echo(f"seed {seed}: {name}", err=True)
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
    from edgeprefill.runtime.workload import PhasedArrivals

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
    make_backend: Callable[[], Backend],
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
                value = float(math.exp(np.mean(np.log(ratios)))) if ratios else None
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


def format_sweep(report: dict[str, Any]) -> str:
    lines = []
    for rate, rep in report["per_rate"].items():
        lines.append(
            format_report(rep, rep["checks"]).replace(
                "edgeprefill compare", f"burst {rate} req/s", 1
            )
        )
    lines.append("\nGeometric mean over burst rates of the policy/baseline ratio (P-PAS eq. 1-2):")
    for base, per_policy in report["geomean_ratio_over_rates"].items():
        for p, per_metric in per_policy.items():
            cells = ", ".join(f"{k} x{v:.3f}" for k, v in per_metric.items() if v is not None)
            lines.append(f"  {p} / {base}: {cells}")
    return "\n".join(lines)
