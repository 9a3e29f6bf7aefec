"""`edgeprefill report`: PNG figures and one HTML page for one or more runs.

The page needs nothing but the PNGs beside it (no scripts, no web fonts), so a report
folder can be zipped, mailed or opened offline.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgeprefill.runtime.analysis import plots
from edgeprefill.runtime.analysis.rundata import RunData, find_runs
from edgeprefill.runtime.core.errors import UserError

# (header, the cell's text from a run's summary)
COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("completed", lambda s: f"{s['completed']}/{s['completed'] + s['failed']}"),
    ("fg mean TTFT (s)", lambda s: _ms_to_s(s["foreground"].get("mean_ttft_ms"))),
    ("fg P99 TTFT (s)", lambda s: _ms_to_s(s["foreground"].get("p99_ttft_ms"))),
    ("fg mean ITL (ms)", lambda s: _num(s["foreground"].get("mean_itl_ms"))),
    ("fg P99 ITL (ms)", lambda s: _num(s["foreground"].get("p99_itl_ms"))),
    ("bg prefill tok/s", lambda s: _num(s["background"].get("span_prefill_tok_s"))),
    ("bg makespan (s)", lambda s: _num(s["background"].get("makespan_s"))),
    ("energy J/output token", lambda s: _energy(s)),
)


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _ms_to_s(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1000:.2f}"


def _energy(s: dict[str, Any]) -> str:
    e = s.get("energy") or {}
    whole = e.get("whole_run")
    if not whole:
        return "unavailable"
    per = whole["j_per_output_token"].get("all")
    sources = ", ".join(v for v in e["sources"].values() if isinstance(v, str))
    return f"{per:.3g} ({sources})" if per is not None else "n/a"


def _slug(run: RunData, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9]+", "-", f"{run.policy}-seed{run.summary.get('seed')}").strip("-")
    slug, n = base, 2
    while slug in taken:
        slug, n = f"{base}-{n}", n + 1
    taken.add(slug)
    return slug


def write_report(paths: list[Path], out: Path) -> Path:
    """Figures and report.html for the runs under `paths`; returns the page's path."""
    runs, reports = find_runs(paths)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write the report to {out}: {e.strerror}") from None
    esc = html.escape
    body: list[str] = []
    figures: list[tuple[str, Path]] = [("Latency CDFs", plots.latency_cdfs(runs, out / "cdfs.png"))]
    if len(runs) > 1:
        figures.append(("P99 per policy", plots.p99_bars(runs, out / "p99.png")))

    rows = "".join(
        f"<tr><td>{esc(r.label)}</td><td>{esc(r.summary['workload']['name'])}</td>"
        f"<td>{esc(r.summary['backend']['name'])}{' (simulated)' if r.summary.get('simulated') else ''}</td>"
        + "".join(f"<td>{esc(f(r.summary))}</td>" for _, f in COLUMNS)
        + "</tr>"
        for r in runs
    )
    head = "".join(f"<th>{esc(c)}</th>" for c, _ in COLUMNS)
    body.append(
        f"<h2>Runs</h2><table><tr><th>run</th><th>workload</th><th>backend</th>{head}</tr>"
        f"{rows}</table>"
    )
    for rep in reports:
        body.append(_comparison_html(rep))
    for title, png in figures:
        body.append(f'<h2>{esc(title)}</h2><img src="{esc(png.name)}" alt="{esc(title)}">')
    taken: set[str] = set()
    for run in runs:
        slug = _slug(run, taken)
        body.append(f"<h2>{esc(run.title)}</h2><p>{esc(str(run.path))}</p>")
        png = plots.timeline(run, out / f"timeline-{slug}.png")
        body.append(f'<img src="{esc(png.name)}" alt="timeline {esc(run.label)}">')
        tel = plots.telemetry(run, out / f"telemetry-{slug}.png")
        if tel is not None:
            body.append(f'<img src="{esc(tel.name)}" alt="telemetry {esc(run.label)}">')
        else:
            body.append(f"<p>No telemetry plotted: {esc(_why_no_telemetry(run))}</p>")
    page = out / "report.html"
    page.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>edgeprefill report</title>"
        "<style>body{font-family:sans-serif;max-width:1400px;margin:auto}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
        "padding:3px 6px;text-align:right}img{max-width:100%;display:block;margin:8px 0}"
        "</style></head><body><h1>edgeprefill report</h1>" + "".join(body) + "</body></html>\n"
    )
    return page


def _why_no_telemetry(run: RunData) -> str:
    tel = run.summary.get("telemetry") or {}
    if "unavailable" in tel:
        return str(tel["unavailable"])
    reasons = [
        f"{name}: {s.get('reason')}"
        for name, s in tel.get("sensors", {}).items()
        if not s.get("available")
    ]
    return "; ".join(reasons) or "no telemetry.jsonl in the run folder"


def _comparison_html(rep: dict[str, Any]) -> str:
    e = html.escape
    if "metrics" not in rep:  # a sweep: one comparison per burst rate
        return "".join(
            _comparison_html({"file": f"{rep['file']} (burst {rate})", **r})
            for rate, r in rep.get("per_rate", {}).items()
        )
    policies = list(rep["metrics"])
    labels = list(next(iter(rep["metrics"].values())))
    rows = "".join(
        f"<tr><td>{e(label)}</td>"
        + "".join(f"<td>{e(_num(rep['metrics'][p][label]))}</td>" for p in policies)
        + "</tr>"
        for label in labels
    )
    sim = " (SIMULATED)" if rep.get("simulated") else ""
    checks = f"outputs agree: {rep.get('outputs_agree')}, reconciled: {rep.get('reconciled')}"
    return (
        f"<h2>Comparison{sim}: {e(str(rep.get('workload')))}, seeds {e(str(rep.get('seeds')))}"
        f"</h2><p>{e(rep['file'])}; {e(checks)}</p><table><tr><th>mean over seeds</th>"
        + "".join(f"<th>{e(p)}</th>" for p in policies)
        + f"</tr>{rows}</table>"
    )
