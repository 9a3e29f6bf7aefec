"""Energy and throttling from a run's telemetry samples, tagged with where each figure came from.

Every figure names its source (`rapl:package-0`, `nvml_energy`, `nvml_power_integrated`,
`estimated:tdp=...`) or is `unavailable` with a reason: never a silent 0.

Joules per output token per class: each iteration's energy (the counters interpolated at its
start and end) is split between the classes by their share of the tokens it computed; the
energy between iterations (host time, idle waits) is spread in the same proportions, so the
classes add up to the whole. The steady-state window drops the first and last 10% of the
run's wall time: model load, the calibration probe, warm-up and the tail of a lone request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import integrate

STEADY_TRIM = 0.10


@dataclass  # not frozen: one is built every iteration (see core/plan.py)
class IterationSpan:
    """An iteration's interval and the tokens each class had computed in it."""

    t_start_s: float
    t_end_s: float
    foreground_tokens: int
    background_tokens: int


@dataclass(frozen=True)
class EnergySeries:
    """Cumulative joules over time from one source."""

    source: str
    t_s: np.ndarray
    joules: np.ndarray

    def between(self, t0: float, t1: float) -> float:
        e0, e1 = np.interp([t0, t1], self.t_s, self.joules)
        return float(e1 - e0)


def cpu_series(samples: Sequence[dict[str, Any]], tdp_w: float | None) -> EnergySeries | None:
    """RAPL package energy (packages added: they do not overlap), else a TDP estimate from
    CPU load when the user declared a TDP, else None."""
    rows = [s for s in samples if "rapl" in s]
    if len(rows) >= 2:
        names = sorted(rows[0]["rapl"]["energy_j"])
        joules = [sum(r["rapl"]["energy_j"][n] for n in names) for r in rows]
        source = "+".join(f"rapl:{n}" for n in names)
        return EnergySeries(source, np.array([r["t_s"] for r in rows]), np.array(joules))
    rows = [s for s in samples if "cpu_load" in s]
    if tdp_w is not None and len(rows) >= 2:
        t = np.array([r["t_s"] for r in rows])
        watts = tdp_w * np.array([r["cpu_load"]["percent"] for r in rows]) / 100
        estimated = integrate.cumulative_trapezoid(watts, t, initial=0)
        return EnergySeries(f"estimated:tdp={tdp_w:g}W*cpu_load", t, estimated)
    return None


def gpu_series(samples: Sequence[dict[str, Any]]) -> EnergySeries | None:
    rows = [s for s in samples if "gpu" in s and s["gpu"]["gpus"]]
    if len(rows) < 2:
        return None
    sources = sorted({g["energy_source"] for g in rows[0]["gpu"]["gpus"]})
    joules = [sum(g["energy_j"] for g in r["gpu"]["gpus"]) for r in rows]
    return EnergySeries("+".join(sources), np.array([r["t_s"] for r in rows]), np.array(joules))


def _window_block(
    series: dict[str, EnergySeries],
    window: tuple[float, float],
    spans: Sequence[IterationSpan],
    tokens_out: dict[str, int],
) -> dict[str, Any]:
    t0, t1 = window
    joules = {k: s.between(t0, t1) for k, s in series.items()}
    total = sum(joules.values())
    inside = [sp for sp in spans if t0 <= sp.t_start_s and sp.t_end_s <= t1]
    by_class = {"foreground": 0.0, "background": 0.0}
    for sp in inside:
        n = sp.foreground_tokens + sp.background_tokens
        if n == 0:
            continue
        e = sum(s.between(sp.t_start_s, sp.t_end_s) for s in series.values())
        by_class["foreground"] += e * sp.foreground_tokens / n
        by_class["background"] += e * sp.background_tokens / n
    attributed = sum(by_class.values())
    scale = total / attributed if attributed > 0 else 0.0
    n_out = sum(tokens_out.values())
    per_token: dict[str, float | None] = {"all": total / n_out if n_out else None}
    for cls, e in by_class.items():
        per_token[cls] = e * scale / tokens_out[cls] if tokens_out.get(cls) else None
    return {
        "window_s": [t0, t1],
        "joules": joules,
        "joules_total": total,
        "output_tokens": tokens_out,
        "j_per_output_token": per_token,
    }


def _tokens_out(requests: Sequence[dict[str, Any]], t0: float, t1: float) -> dict[str, int]:
    out = {"foreground": 0, "background": 0}
    for r in requests:
        out[r["class"]] += sum(1 for t in r["token_times_s"] if t0 <= t <= t1)
    return out


def energy_summary(
    samples: Sequence[dict[str, Any]],
    spans: Sequence[IterationSpan],
    requests: Sequence[dict[str, Any]],
    *,
    tdp_w: float | None = None,
    reasons: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The `energy` block of summary.json. `reasons` says why a device had no source."""
    reasons = reasons or {}
    series = {
        k: s for k, s in (("cpu", cpu_series(samples, tdp_w)), ("gpu", gpu_series(samples))) if s
    }
    sources: dict[str, Any] = {}
    for device in ("cpu", "gpu"):
        if device in series:
            sources[device] = series[device].source
        else:
            sources[device] = {"source": "unavailable", "reason": reasons.get(device, "no samples")}
    if not series:
        return {"sources": sources, "whole_run": None, "steady_state": None}
    t0 = float(min(s.t_s[0] for s in series.values()))
    t1 = float(max(s.t_s[-1] for s in series.values()))
    trim = (t1 - t0) * STEADY_TRIM
    steady = (t0 + trim, t1 - trim)
    return {
        "sources": sources,
        "whole_run": _window_block(series, (t0, t1), spans, _tokens_out(requests, t0, t1)),
        "steady_state": {
            "rule": f"run minus its first and last {STEADY_TRIM:.0%} of wall time",
            **_window_block(series, steady, spans, _tokens_out(requests, *steady)),
        },
    }


def throttle_flags(sample: dict[str, Any]) -> list[str]:
    """Why a telemetry sample says a device is throttling (empty: it is not): CPU
    thermal-throttle events, or GPU clock-event reasons that hold the clocks back."""
    out = []
    if sample.get("cpu_temp", {}).get("throttled"):
        out.append("cpu:thermal_throttle")
    for g in sample.get("gpu", {}).get("gpus", []):
        if g["throttled"]:
            out += [f"gpu{g['index']}:{n}" for n in g["clock_reason_names"] if n != "gpu_idle"]
    return out


def throttle_intervals(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Intervals in which a device reported throttling: CPU thermal-throttle events, or GPU
    clock-event reasons that hold the clocks back (power cap, thermal, hardware slowdown)."""

    intervals: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for s in samples:
        f = throttle_flags(s)
        if f and current is None:
            current = {"start_s": s["t_s"], "end_s": s["t_s"], "reasons": sorted(set(f))}
        elif f and current is not None:
            current["end_s"] = s["t_s"]
            current["reasons"] = sorted(set(current["reasons"]) | set(f))
        elif current is not None:
            current["end_s"] = s["t_s"]
            intervals.append(current)
            current = None
    if current is not None:
        intervals.append(current)
    return intervals
