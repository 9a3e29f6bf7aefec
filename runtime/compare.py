"""Paired comparison of policies on the same arrivals and prompts.

For every seed each policy runs the identical request trace. Per metric we report the mean
over seeds, and against each baseline the geometric mean of the per-seed ratios (P-PAS eq.
1-2, with seeds in place of rates) and a paired 95% Student-t interval of the per-seed
relative change (DLFP section 4.3). Output agreement (greedy token ids per request) and
request/token reconciliation are checked and reported, not assumed.
"""

from __future__ import annotations

import math
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


def paired(policy: Sequence[float], baseline: Sequence[float]) -> dict[str, Any]:
    """Geometric-mean ratio and a paired 95% t-interval of the relative change."""
    pairs = [(p, b) for p, b in zip(policy, baseline) if p is not None and b and p > 0]
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
        half = float(stats.t.ppf(0.975, len(pairs) - 1) * change.std(ddof=1) / math.sqrt(len(pairs)))
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


def build_report(summaries: dict[str, list[dict[str, Any]]], baselines: list[str]) -> dict[str, Any]:
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
                label: paired([metric(s, c, k) for s in runs],
                              [metric(s, c, k) for s in summaries[base]])
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
        lines.append(f"{label:<18}" + "".join(
            f"{'n/a' if v is None else f'{v:.1f}':>{width}}" for v in row))
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
                lines.append(f"    {label:<18} x{r['geomean_ratio']:.3f} [{ci_text}]"
                             f"{'  better' if better and r['geomean_ratio'] != 1 else ''}")
    lines.append("")
    lines += checks
    return "\n".join(lines)
