"""The statistics of a paired comparison of policies on the same arrivals and prompts
(`runner.comparison` runs them).

For every seed each policy runs the identical request trace. Per metric we report the mean
over seeds, and against each baseline the geometric mean of the per-seed ratios (P-PAS eq.
1-2, with seeds in place of rates) and a paired 95% Student-t interval of the per-seed
relative change (DLFP section 4.3). Output agreement (greedy token ids per request) and
request/token reconciliation are checked and reported, not assumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

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


def paired(policy: Sequence[float | None], baseline: Sequence[float | None]) -> dict[str, Any]:
    """Geometric-mean ratio, and a paired 95% t-interval of the relative change taken on the
    log ratios (a ratio's interval: it never reaches below -100%, as an interval of the
    changes themselves did with three seeds and a tenfold ratio)."""
    pairs = [(p, b) for p, b in zip(policy, baseline, strict=True) if p is not None and b and p > 0]
    if not pairs:
        return {"n": 0, "geomean_ratio": None, "change_mean": None, "change_ci95": None}
    ratios = np.array([p / b for p, b in pairs])
    change = ratios - 1.0
    out: dict[str, Any] = {
        "n": len(pairs),
        "ratios": [float(r) for r in ratios],
        "geomean_ratio": float(stats.gmean(ratios)),
        "change_mean": float(change.mean()),
        "change_ci95": None,
    }
    if len(pairs) >= 2:
        ci = stats.ttest_1samp(np.log(ratios), 0.0).confidence_interval(0.95)
        out["change_ci95"] = [float(np.expm1(ci.low)), float(np.expm1(ci.high))]
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
