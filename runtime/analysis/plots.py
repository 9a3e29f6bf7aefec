"""The report's figures, one function per PNG. Figures are built without pyplot (no global
state, no display needed), with units on every axis, a legend and a title that names the
backend, policy, workload and seed."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter

from edgeprefill.runtime.analysis.metrics import pooled_latencies
from edgeprefill.runtime.analysis.rundata import RunData

DPI = 110
CLASS_STYLE = {"foreground": "-", "background": "--"}


def _plain_log(axis: Any) -> None:
    """Log scale with plain numbers on the decades and no crowded minor labels."""
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    return path


def _target_ms(run: RunData) -> float | None:
    params = run.summary["policy"].get("params", {})
    for key in ("itl_ms", "target_ms"):
        if params.get(key):
            return float(params[key])
    return None


def timeline(run: RunData, path: Path) -> Path:
    """Foreground token gaps over time, with the prefill budget and the prompt tokens each
    iteration carried beneath: a stall is a spike above, and a wide bar below explains it."""
    fig = Figure(figsize=(11, 7.5))
    top, mid, low = fig.subplots(3, 1, sharex=True, height_ratios=[2.2, 1, 1.3])
    _token_gaps(top, run)
    its = [i for i in run.iterations if i.get("error") is None]
    t = np.array([i["t_start_s"] for i in its])
    _budgets(mid, t, its)
    _prompt_tokens(low, t, its)
    fig.suptitle(f"Timeline: {run.title}", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def _token_gaps(ax: Axes, run: RunData) -> None:
    for rec in run.requests:
        if rec["class"] == "foreground" and len(rec["token_times_s"]) > 1:
            t = np.asarray(rec["token_times_s"])
            ax.plot(t[1:], np.diff(t) * 1000, ".", ms=2.5, color="tab:blue")
    ax.plot([], [], ".", color="tab:blue", label="foreground inter-token latency")
    target = _target_ms(run)
    if target:
        ax.axhline(target, color="tab:red", lw=1, ls=":", label=f"target {target:.0f} ms")
    ax.set_yscale("log")
    _plain_log(ax.yaxis)
    ax.set_ylabel("ITL (ms, log)")
    ax.legend(loc="upper right", fontsize=8)


def _budgets(ax: Axes, t: np.ndarray, its: list[dict[str, Any]]) -> None:
    budget = np.array([np.nan if i["budget"] is None else i["budget"] for i in its], float)
    ax.step(t, budget, where="post", color="tab:purple", lw=1, label="prefill budget")
    uncapped = np.isnan(budget)
    if uncapped.any():
        ymax = np.nanmax(budget) if (~uncapped).any() else 1.0
        ax.fill_between(
            t,
            0,
            ymax,
            where=uncapped,
            step="post",
            color="tab:purple",
            alpha=0.12,
            label="no cap (whole batch)",
        )
    ax.set_ylabel("budget (tokens)")
    ax.legend(loc="upper right", fontsize=8)


def _prompt_tokens(ax: Axes, t: np.ndarray, its: list[dict[str, Any]]) -> None:
    width = np.array([max(i["duration_s"], 1e-3) for i in its])
    background = np.array([i.get("n_prefill_background", 0) for i in its])
    foreground = np.array([i.get("n_prefill_foreground", 0) for i in its])
    ax.bar(t, background, width, align="edge", color="tab:orange", label="background prompt tokens")
    ax.bar(
        t,
        foreground,
        width,
        align="edge",
        bottom=background,
        color="tab:green",
        label="foreground prompt tokens",
    )
    ax.set_ylabel("tokens / iteration")
    ax.set_xlabel("time since run start (s)")
    ax.legend(loc="upper right", fontsize=8)


def _latencies(run: RunData, cls: str) -> dict[str, np.ndarray]:
    pooled = pooled_latencies(r for r in run.requests if r["class"] == cls)
    return {k: np.sort(np.asarray(v)) for k, v in pooled.items()}


def _names(runs: list[RunData]) -> str:
    """Backends, policies, workloads and seeds of several runs, for a figure's title."""

    def joined(values: set[str]) -> str:
        return ", ".join(sorted(values))

    s = [r.summary for r in runs]
    backends = {x["backend"]["name"] + (" (SIMULATED)" if x.get("simulated") else "") for x in s}
    workloads = joined({x["workload"]["name"] for x in s})
    seeds = joined({str(x.get("seed")) for x in s})
    return f"{joined(backends)} | {joined({r.policy for r in runs})} | {workloads} | seeds {seeds}"


def latency_cdfs(runs: list[RunData], path: Path) -> Path:
    """TTFT, ITL and E2E distributions per class and run: the tail a mean hides."""
    fig = Figure(figsize=(13, 4.6))
    axes = fig.subplots(1, 3)
    panels = (
        ("ttft", "TTFT (s)", 1.0),
        ("itl", "ITL (ms)", 1000.0),
        ("e2el", "E2E latency (s)", 1.0),
    )
    colors = {r.label: f"C{i % 10}" for i, r in enumerate(runs)}
    for ax, (key, xlabel, scale) in zip(axes, panels, strict=True):
        for run in runs:
            for cls, style in CLASS_STYLE.items():
                v = _latencies(run, cls).get(key)
                if v is None or not len(v):
                    continue
                y = np.arange(1, len(v) + 1) / len(v)
                ax.step(
                    v * scale,
                    y,
                    where="post",
                    ls=style,
                    color=colors[run.label],
                    label=f"{run.label} {cls}",
                )
        ax.set_xscale("log")
        _plain_log(ax.xaxis)
        ax.set_xlabel(xlabel + ", log")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"Latency CDFs (solid: foreground, dashed: background) | {_names(runs)}",
        fontsize=11,
    )
    fig.tight_layout()
    return _save(fig, path)


P99_PANELS = (
    ("foreground", "p99_ttft_ms", "foreground P99 TTFT (ms)"),
    ("foreground", "p99_itl_ms", "foreground P99 ITL (ms)"),
    ("foreground", "p99_e2el_ms", "foreground P99 E2E (ms)"),
    ("background", "p99_e2el_ms", "background P99 E2E (ms)"),
)


def p99_bars(runs: list[RunData], path: Path) -> Path:
    """P99 latencies per policy (the mean over its seeds; the dots are the seeds)."""
    by_policy: dict[str, list[RunData]] = defaultdict(list)
    for r in runs:
        by_policy[r.policy].append(r)
    names = list(by_policy)
    fig = Figure(figsize=(4 + 2.2 * len(P99_PANELS), 4.8))
    axes = fig.subplots(1, len(P99_PANELS))
    for ax, (cls, key, label) in zip(axes, P99_PANELS, strict=True):
        for i, name in enumerate(names):
            vals = [r.summary[cls].get(key) for r in by_policy[name]]
            vals = [v for v in vals if v is not None]
            if not vals:
                continue
            ax.bar(i, np.mean(vals), color=f"C{i % 10}", label=name)
            ax.plot([i] * len(vals), vals, "k.", ms=4)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"P99 per policy (bar: mean over seeds) | {_names(runs)}", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


Series = tuple[np.ndarray, np.ndarray]  # (times, values)


def _gpu_reading(sample: dict[str, Any], key: str, index: int) -> Any:
    gpus = sample.get("gpu", {}).get("gpus", [])
    return next((g[key] for g in gpus if g["index"] == index), None)


def _telemetry_series(samples: list[dict[str, Any]]) -> dict[str, dict[str, Series]]:
    """Panel -> line label -> (times, values) for what the run's telemetry holds."""
    out: dict[str, dict[str, Series]] = defaultdict(dict)

    def series(label: str, panel: str, pick: Callable[[dict[str, Any]], Any]) -> None:
        pts = [(s["t_s"], pick(s)) for s in samples]
        pts = [(t, v) for t, v in pts if v is not None]
        if pts:
            times, values = zip(*pts, strict=True)
            out[panel][label] = (np.array(times), np.array(values))

    series("CPU", "temperature (°C)", lambda s: s.get("cpu_temp", {}).get("c"))
    live = any(s.get("cpu_freq", {}).get("live") for s in samples)
    clock = "CPU mean" if live else "CPU (static: the platform reports no live clock)"
    series(clock, "clock (MHz)", lambda s: s.get("cpu_freq", {}).get("mean_mhz"))
    series("CPU load", "CPU load (%)", lambda s: s.get("cpu_load", {}).get("percent"))
    gpus = {g["index"] for s in samples for g in s.get("gpu", {}).get("gpus", [])}
    for idx in sorted(gpus):
        series(f"GPU{idx}", "temperature (°C)", partial(_gpu_reading, key="temp_c", index=idx))
        series(f"GPU{idx} SM", "clock (MHz)", partial(_gpu_reading, key="sm_mhz", index=idx))
        series(f"GPU{idx}", "power (W)", partial(_gpu_reading, key="power_avg_w", index=idx))
    rapl = [s for s in samples if "rapl" in s]
    if len(rapl) > 1:
        t = np.array([s["t_s"] for s in rapl])
        e = np.array([sum(s["rapl"]["energy_j"].values()) for s in rapl])
        out["power (W)"]["CPU package (RAPL)"] = (t[1:], np.diff(e) / np.diff(t))
    return out


def telemetry(run: RunData, path: Path) -> Path | None:
    """Temperature, clocks, load and power over the run; None when nothing was measured."""
    panels = _telemetry_series(run.telemetry)
    if not panels:
        return None
    fig = Figure(figsize=(11, 2.4 * len(panels) + 1))
    axes = np.atleast_1d(fig.subplots(len(panels), 1, sharex=True))
    for ax, (panel, lines) in zip(axes, panels.items(), strict=True):
        for label, (t, v) in lines.items():
            ax.plot(t, v, lw=1, label=label)
        ax.set_ylabel(panel)
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    for interval in run.summary.get("telemetry", {}).get("throttle_intervals", []):
        for ax in axes:
            ax.axvspan(interval["start_s"], interval["end_s"], color="tab:red", alpha=0.15)
    axes[-1].set_xlabel("time since run start (s)")
    fig.suptitle(f"Telemetry (red: throttling): {run.title}", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)
