"""`edgeprefill serve` beside `edgeprefill run` and llama-server at its defaults, the two
servers over HTTP through the same driver (`http_replay.py`'s streamed `/v1/completions`
client), on each workload's exact trace: the default and bursty workloads and
`benchmarks/chat_plus_documents.yaml` (a few chats beside ten documents, issue 40's kind of
trace) and `workloads/conversation_plus_indexer.yaml` (conversations resent whole at every
turn, where llama-server runs with its prompt cache on, as its defaults have it, and the
client resends each answer's text as the server's tokenizer reads it; first-token time by
turn). Seeds interleaved, the order rotated from seed to seed, ratios paired by seed.

    benchmarks/build_llamacpp_tools.sh            # once: llama-server from the vendored source
    .venv/bin/python benchmarks/http_versus.py results/http [--seeds 3] [--threads 2] [--table]

A run whose summary.json exists is kept (runs resume). `make results` runs it and puts its
tables in RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from http_replay import Endpoint, ServeProcess, server_delivery
from llama_server import Server, answers_tokenizer, replay, run_meta, trace, write_results
from versus_server import ratio_cell

from edgeprefill.backends.bundled_model import default_model_path
from edgeprefill.runtime.traffic.workload import load_workload

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "build/llamacpp-tools/build/bin"
WORKLOADS = (
    "workloads/assistant_plus_indexer.yaml",
    "workloads/assistant_bursty.yaml",
    "benchmarks/chat_plus_documents.yaml",
    "workloads/conversation_plus_indexer.yaml",
)
# llama-server as benchmarks/llama_server.py starts it at its defaults: 4 slots sharing one
# pool of 4 x 16384 cells.
LLAMA_SERVER_ARGS = ["-c", str(4 * 16384)]
RUN, SERVE, SERVER = "edgeprefill-run", "edgeprefill-serve", "llama-server"
CONFIGS = (RUN, SERVE, SERVER)
# (label, class, summary key, format)
COLUMNS = [
    ("fg P99 ITL ms", "foreground", "p99_itl_ms", "{:.0f}"),
    ("fg mean TTFT ms", "foreground", "mean_ttft_ms", "{:.0f}"),
    ("fg P95 TTFT ms", "foreground", "p95_ttft_ms", "{:.0f}"),
    ("bg makespan s", "background", "makespan_s", "{:.1f}"),
    ("bg prefill tok/s", "background", "span_prefill_tok_s", "{:.0f}"),
]


def run_one(name: str, workload: Path, seed: int, out: Path, tools: Path, threads: int) -> None:
    if (out / "summary.json").exists():
        return
    print(f"[{workload.stem} seed {seed}] {name}", flush=True)
    if name == RUN:
        cmd = [sys.executable, "-m", "edgeprefill.runtime.cli", "run", "--backend", "llamacpp"]
        cmd += [str(workload), "--seed", str(seed), "--out", str(out), "--threads", str(threads)]
        out.parent.mkdir(parents=True, exist_ok=True)
        with (out.parent / f"{name}.log").open("w") as log:
            subprocess.run([*cmd, "--no-progress"], stdout=log, stderr=log, check=True)
        return
    requests = trace(load_workload(workload), seed, out)
    started = datetime.now(UTC)
    conversation = any(r.continues for r in requests)
    if name == SERVER:
        args = ["-t", str(threads), *LLAMA_SERVER_ARGS]
        log = out / "server.log"
        server = Server(tools, default_model_path(), 18090, args, log, cache=conversation)
        url, label = "http://127.0.0.1:18090", "llama-server " + " ".join(server.args)
        backend: dict[str, Any] = {"name": SERVER, "args": server.args}
    else:
        args_text = f"--no-progress --threads {threads}"
        # Its own iterations.jsonl too (out/server), to see why a run was slow.
        options = f"{args_text} --results {shlex.quote(str(out / 'server'))}"
        server = ServeProcess(options, out / "server.log")  # type: ignore[assignment]
        url, label = server.url, f"edgeprefill serve {args_text}"
        backend = {"name": SERVE, "args": args_text}
    try:
        with answers_tokenizer(requests) as tokenizer:
            duration = replay(Endpoint(url, tokenizer=tokenizer), requests)  # type: ignore[arg-type]
        if name == SERVE:
            backend["token_delivery"] = server_delivery(url)
    finally:
        server.close()
    backend["driver"] = "benchmarks/http_replay.py (streamed /v1/completions)"
    write_results(out, requests, duration, run_meta(backend, label, workload, seed, started), label)


def run(out: Path, seeds: int, tools: Path, threads: int, workloads: list[str]) -> None:
    for seed in range(seeds):
        turn = seed % len(CONFIGS)
        for workload in workloads:
            for name in CONFIGS[turn:] + CONFIGS[:turn]:
                where = out / Path(workload).stem / f"seed{seed}" / name
                run_one(name, ROOT / workload, seed, where, tools, threads)


def metric(s: dict[str, Any], cls: str, key: str) -> float | None:
    value = s[cls].get(key)
    return None if value is None else float(value)


def tables(out: Path, workloads: tuple[str, ...] | list[str] = WORKLOADS) -> str:
    """Each workload's runs by seed, then serve against run and against llama-server."""
    lines: list[str] = []
    for workload in workloads:
        folder = out / Path(workload).stem
        runs = {
            s.name: {n: json.loads((s / n / "summary.json").read_text()) for n in CONFIGS}
            for s in sorted(p for p in folder.glob("seed*") if p.is_dir())
            if all((s / n / "summary.json").exists() for n in CONFIGS)
        }
        lines += [f"### `{workload}`", "", *seed_rows(runs), "", *ratio_rows(runs), ""]
        lines += turn_rows(runs)
    return "\n".join(lines)


def turn_rows(runs: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Closed-loop conversations' mean first-token time (ms) at each turn, by seed."""
    rows = [
        [seed[4:], name, *(f"{t:.0f}" for t in by_turn)]
        for seed, by_name in runs.items()
        for name, s in by_name.items()
        if (by_turn := s["foreground"].get("mean_ttft_by_turn_ms"))
    ]
    if not rows:
        return []
    head = ["seed", "run", *(f"turn {k}" for k in range(1, max(map(len, rows)) - 1))]
    lines = ["Mean first-token time (ms) by turn:", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return [*lines, *("| " + " | ".join(r) + " |" for r in rows), ""]


def seed_rows(runs: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    head = ["seed", "run", *[c[0] for c in COLUMNS], "done", "delivery P99 ms <="]
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
    return lines


def ratio_rows(runs: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Geometric means over the seeds, with the paired 95% interval of the change."""
    head = ["edgeprefill serve against", *[c[0] for c in COLUMNS]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for theirs in (RUN, SERVER):
        cells = [f"{theirs} ({len(runs)} seed{'s' * (len(runs) != 1)})"]
        for _, cls, key, _ in COLUMNS:
            ours = [metric(r[SERVE], cls, key) for r in runs.values()]
            cells.append(ratio_cell(ours, [metric(r[theirs], cls, key) for r in runs.values()]))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder of the runs (kept runs are not made again)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tools", type=Path, default=TOOLS, help="folder with llama-server")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of every run")
    ap.add_argument("--table", action="store_true", help="only print the tables of the runs")
    ap.add_argument(
        "--workload",
        action="append",
        choices=WORKLOADS,
        help="only this workload (repeatable) [default: every one]",
    )
    args = ap.parse_args()
    workloads = args.workload or list(WORKLOADS)
    if not args.table:
        run(args.out, args.seeds, args.tools, args.threads, workloads)
    print(tables(args.out, workloads), end="")


if __name__ == "__main__":
    main()
