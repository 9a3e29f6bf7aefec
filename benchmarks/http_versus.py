"""`edgeprefill serve` against llama-server at its defaults, both over HTTP through the same
driver (`http_replay.py`'s streamed `/v1/completions` client), on one workload's exact trace;
seeds interleaved, the order rotated from seed to seed, ratios paired by seed.

    benchmarks/build_llamacpp_tools.sh            # once: llama-server from the vendored source
    .venv/bin/python benchmarks/http_versus.py results/http-versus [--seeds 3] [--table]

A run whose summary.json exists is kept (runs resume).
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from http_replay import Endpoint, ServeProcess, server_delivery
from llama_server import Server, replay, run_meta, trace, write_results
from versus_server import ratio_cell

from edgeprefill.backends.bundled_model import default_model_path
from edgeprefill.runtime.traffic.workload import load_workload

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "build/llamacpp-tools/build/bin"
WORKLOAD = "workloads/assistant_plus_indexer.yaml"
# llama-server as benchmarks/llama_server.py starts it at its defaults: 4 slots sharing one
# pool of 4 x 16384 cells, 2 threads.
LLAMA_SERVER_ARGS = ["-t", "2", "-c", str(4 * 16384)]
SERVE_ARGS = "--no-progress"
CONFIGS = ("llama-server", "edgeprefill-serve")
# (label, class, summary key, format)
COLUMNS = [
    ("fg P99 ITL ms", "foreground", "p99_itl_ms", "{:.0f}"),
    ("fg mean TTFT ms", "foreground", "mean_ttft_ms", "{:.0f}"),
    ("fg P95 TTFT ms", "foreground", "p95_ttft_ms", "{:.0f}"),
    ("bg makespan s", "background", "makespan_s", "{:.1f}"),
    ("bg prefill tok/s", "background", "span_prefill_tok_s", "{:.0f}"),
]


def run_one(name: str, workload: Path, seed: int, out: Path, tools: Path, port: int) -> None:
    if (out / "summary.json").exists():
        return
    print(f"[seed {seed}] {name}", flush=True)
    requests = trace(load_workload(workload), seed, out)
    started = datetime.now(UTC)
    if name == "llama-server":
        model = default_model_path()
        server = Server(tools, model, port, LLAMA_SERVER_ARGS, out / "server.log")
        url, label = f"http://127.0.0.1:{port}", "llama-server " + " ".join(LLAMA_SERVER_ARGS)
        backend: dict[str, Any] = {"name": "llama-server", "args": LLAMA_SERVER_ARGS}
    else:
        server = ServeProcess(SERVE_ARGS, out / "server.log")  # type: ignore[assignment]
        url, label = server.url, f"edgeprefill serve {SERVE_ARGS}"
        backend = {"name": "edgeprefill-serve", "args": SERVE_ARGS}
    try:
        duration = replay(Endpoint(url), requests)  # type: ignore[arg-type]
        if name == "edgeprefill-serve":
            backend["token_delivery"] = server_delivery(url)
    finally:
        server.close()
    backend["driver"] = "benchmarks/http_replay.py (streamed /v1/completions)"
    write_results(out, requests, duration, run_meta(backend, label, workload, seed, started), label)


def run(out: Path, seeds: int, tools: Path) -> None:
    for seed in range(seeds):
        order = CONFIGS if seed % 2 == 0 else CONFIGS[::-1]
        for name in order:
            run_one(name, ROOT / WORKLOAD, seed, out / f"seed{seed}" / name, tools, 18090)


def metric(s: dict[str, Any], cls: str, key: str) -> float | None:
    value = s[cls].get(key)
    return None if value is None else float(value)


def table(out: Path) -> str:
    seeds = sorted(p for p in out.glob("seed*") if p.is_dir())
    runs = {
        s.name: {n: json.loads((s / n / "summary.json").read_text()) for n in CONFIGS}
        for s in seeds
        if all((s / n / "summary.json").exists() for n in CONFIGS)
    }
    head = ["seed", "server", *[c[0] for c in COLUMNS], "done", "delivery P99 ms <="]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for seed, by_name in runs.items():
        for name, s in by_name.items():
            cells = [seed[4:], name]
            cells += [fmt.format(metric(s, c, k)) for _, c, k, fmt in COLUMNS]
            acc = s["accounting"]
            cells.append(f"{acc['completed']}/{acc['submitted']}")
            d = s["backend"].get("token_delivery")
            cells.append(
                "-" if not d or d["p99_ms_at_most"] is None else f"{d['p99_ms_at_most']:g}"
            )
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| edgeprefill serve against llama-server | " + " | ".join(c[0] for c in COLUMNS) + " |",
    ]
    lines.append("|" + "---|" * (len(COLUMNS) + 1))
    cells = [f"{len(runs)} seeds, geometric mean [paired 95% interval of the change]"]
    for _, cls, key, _ in COLUMNS:
        ours = [metric(r["edgeprefill-serve"], cls, key) for r in runs.values()]
        theirs = [metric(r["llama-server"], cls, key) for r in runs.values()]
        cells.append(ratio_cell(ours, theirs))
    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder of the runs (kept runs are not made again)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tools", type=Path, default=TOOLS, help="folder with llama-server")
    ap.add_argument("--table", action="store_true", help="only print the table of the runs")
    args = ap.parse_args()
    if not args.table:
        run(args.out, args.seeds, args.tools)
    print(table(args.out), end="")


if __name__ == "__main__":
    main()
