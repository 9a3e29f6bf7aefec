"""llama-server as users run it today against edgeprefill's policies, back to back on one
machine, several seeds, and how close each policy comes to what the device allows.

    benchmarks/build_llamacpp_tools.sh        # once: llama-server from the vendored source
    .venv/bin/python benchmarks/versus_server.py run --out results/versus     # ~1 h on 2 cores
    .venv/bin/python benchmarks/versus_server.py table results/versus         # tables again

`run` replays each workload's trace (the same arrivals, prompt tokens and output lengths for
one seed) through every configuration: llama-server at its defaults and at tuned `-b`/`-ub`
settings (`benchmarks/llama_server.py`), and `edgeprefill run` with its default policy and
the papers' policies. Within a seed the configurations run back to back, their order
rotated from seed to seed, because this shared machine's speed drifts by up to 1.45x within
an hour: only ratios within a seed are compared (geometric mean over seeds and a paired 95%
interval, as `edgeprefill compare`). The same chats with no documents (`chat_only.yaml`)
run beside the default workload, the reference for the chats' TTFT. Finished runs are kept,
so an interrupted `run` resumes where it stopped. It ends by writing `versus.md` (the
tables) and `edgeprefill report`'s plots for each workload's first seed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeprefill.runtime.analysis.compare import metric, paired
from edgeprefill.runtime.analysis.rundata import load_run
from edgeprefill.runtime.runner.calibration import profile_from_run

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "build/llamacpp-tools/build/bin"
WORKLOADS = ("workloads/assistant_plus_indexer.yaml", "workloads/assistant_bursty.yaml")
CHAT_ONLY = "workloads/chat_only.yaml"  # the default workload's chats, alone
# llama-server: its defaults (4 slots, -b 2048 -ub 512), then what a user tuning it for a
# responsive chat would try: smaller batches, so a document's chunk delays a chat less.
SERVER = {
    "server-default": "",
    "server-b256": "-b 256 -ub 256",
    "server-b64": "-b 64 -ub 64",
}
DEFAULT = "edgeprefill"  # `edgeprefill run` with no --policy
POLICIES = {DEFAULT: None, "dlfp": "dlfp", "ppas": "ppas"}
TARGET_ITL_S = 0.100  # the foreground ITL target the frontier is drawn at


@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # "server" or "edgeprefill"
    arg: str | None  # server options, or the policy (None: the default)


CONFIGS = [Config(n, "server", a) for n, a in SERVER.items()] + [
    Config(n, "edgeprefill", p) for n, p in POLICIES.items()
]


def run_one(
    cfg: Config, workload: str, seed: int, out: Path, tools: Path, threads: int | None = None
) -> None:
    """One replay into `out` (skipped when its summary exists: runs resume); `threads`:
    compute threads for either kind [default: each one's own]."""
    if (out / "summary.json").exists():
        return
    if cfg.kind == "server":
        cmd = [sys.executable, str(ROOT / "benchmarks/llama_server.py"), workload]
        cmd += ["--tools", str(tools), "--seed", str(seed), "--out", str(out)]
        cmd += ["--server-args", cfg.arg or ""]
        cmd += ["--threads", str(threads)] if threads else []
    else:
        cmd = [sys.executable, "-m", "edgeprefill.runtime.cli", "run", "--backend", "llamacpp"]
        cmd += [workload, "--seed", str(seed), "--out", str(out)]
        cmd += ["--policy", cfg.arg] if cfg.arg else []
        cmd += ["--threads", str(threads)] if threads else []
    print(f"[{workload} seed {seed}] {cfg.name}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f"{cfg.name}.log").open("w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)


def run(
    out: Path, seeds: int, tools: Path, threads: int | None = None, only: list[str] | None = None
) -> None:
    """`only`: the configurations to run (names) [default: all]."""
    configs = [c for c in CONFIGS if only is None or c.name in only]
    if any(c.kind == "server" for c in configs) and not (tools / "llama-server").exists():
        print(
            f"error: no llama-server in {tools}: run benchmarks/build_llamacpp_tools.sh first",
            file=sys.stderr,
        )
        sys.exit(2)
    for seed in range(seeds):
        for workload in WORKLOADS:
            turn = seed % len(configs)
            for cfg in configs[turn:] + configs[:turn]:
                where = out / Path(workload).stem / f"seed{seed}" / cfg.name
                run_one(cfg, workload, seed, where, tools, threads)
        chats = Config(DEFAULT, "edgeprefill", None)
        where = out / "chat_only" / f"seed{seed}" / DEFAULT
        run_one(chats, CHAT_ONLY, seed, where, tools, threads)
    (out / "versus.md").write_text(tables(out))
    for workload in WORKLOADS:
        first = out / Path(workload).stem / "seed0"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "edgeprefill.runtime.cli",
                "report",
                str(first),
                "--out",
                str(out / "report" / Path(workload).stem),
            ],
            cwd=ROOT,
            check=True,
        )
    print(f"tables: {out / 'versus.md'}")


# --- the tables ---------------------------------------------------------------------------
# (label, class, summary key, lower is better, format)
COLUMNS = [
    ("fg P99 ITL ms", "foreground", "p99_itl_ms", True, "{:.0f}"),
    ("fg median ITL ms", "foreground", "median_itl_ms", True, "{:.0f}"),
    ("fg mean TTFT ms", "foreground", "mean_ttft_ms", True, "{:.0f}"),
    ("fg P95 TTFT ms", "foreground", "p95_ttft_ms", True, "{:.0f}"),
    ("bg prefill tok/s", "background", "span_prefill_tok_s", False, "{:.0f}"),
    ("bg makespan s", "background", "makespan_s", True, "{:.1f}"),
]


def load(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def frontier_share(run_dir: Path, target_s: float = TARGET_ITL_S) -> float | None:
    """The background prompt tokens a run computed while chats decoded, as a share of the
    most any policy could have computed in the same time at `target_s` (issue 15, 3b).

    The bound comes from the run's own measured costs (its iterations fitted as
    `edgeprefill calibrate` does): with k decodes, an iteration of `target_s` (less the
    host's median time between iterations) holds the decodes' cost plus at most n prompt
    tokens of a chunk at the documents' token-weighted mean depth; the frontier computes
    n/target_s tokens per second while that composition lasts. Summed over every iteration
    in which a chat decoded while some document had arrived and not finished its prompt,
    and no chat's prompt was computed (that time belongs to a chat's first token, which
    the frontier of documents against decodes does not price)."""
    run = load_run(run_dir)
    its, reqs = run.iterations, run.requests
    docs = [r for r in reqs if r["class"] == "background" and r["token_times_s"]]
    if not docs:
        return None
    lengths = [r["prompt_tokens"] for r in docs]
    depth = sum(n * n / 2 for n in lengths) / sum(lengths)
    reading = [(r["arrival_s"], r["token_times_s"][0]) for r in docs]
    chats = [r for r in reqs if r["class"] == "foreground" and r["token_times_s"]]
    # A chat's decode attends to its prompt and half its output, on average.
    if not chats:
        return None
    chat_ctx = float(np.mean([r["prompt_tokens"] + len(r["token_times_s"]) / 2 for r in chats]))
    model = profile_from_run(run_dir).cost
    chatting = [
        i
        for i in its
        if i["n_decode_foreground"]
        and not i["n_prefill_foreground"]
        and not i.get("error")
        and any(a <= i["t_start_s"] < b for a, b in reading)
    ]
    hosts = [i["host_s"] for i in chatting if i["host_s"] is not None]
    room = target_s - (float(np.median(hosts)) if hosts else 0.0)
    done = bound = 0.0
    for i in chatting:
        ctx = int(i["n_decode"] * chat_ctx)
        n = model.max_prefill(room, i["n_decode"], ctx, int(depth))
        wall = i["duration_s"] + (i["host_s"] or 0.0)
        bound += n * wall / target_s
        done += i["n_prefill_background"]
    return done / bound if bound else None


def host_share(run_dir: Path) -> float | None:
    """Host time (planning, bookkeeping, and the backend's own work in its call: filling
    the batch, sampling) as a share of iteration time (3a); an idle wait is not host time.
    Runs recorded before 2 Dec 2026 (2065126) left the backend's part out."""
    host = device = 0.0
    for i in load_run(run_dir).iterations:
        if i["host_s"] is not None:
            host += i["host_s"]
            device += i["duration_s"]
    return host / (host + device) if device else None


def tables(out: Path) -> str:
    lines: list[str] = []
    names = [c.name for c in CONFIGS]
    for workload in WORKLOADS:
        stem = Path(workload).stem
        seeds = sorted(p for p in (out / stem).glob("seed*") if p.is_dir())
        runs = {s.name: {n: load(s / n) for n in names} for s in seeds}
        lines += [f"### `{workload}`", ""]
        lines += per_seed_table(runs, stem, out)
        lines += [""] + ratio_table(runs) + [""]
    return "\n".join(lines) + "\n"


def per_seed_table(runs: dict[str, dict[str, Any]], stem: str, out: Path) -> list[str]:
    head = ["seed", "run", *[c[0] for c in COLUMNS], "done", "frontier share", "host share"]
    if stem == "assistant_plus_indexer":
        head.insert(-3, "TTFT / chat_only")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for seed, by_name in runs.items():
        alone = load(out / "chat_only" / seed / DEFAULT)
        for name, s in by_name.items():
            if s is None:
                continue
            cells = [seed[4:], name]
            for _, cls, key, _, fmt in COLUMNS:
                v = metric(s, cls, key)
                cells.append("-" if v is None else fmt.format(v))
            if "TTFT / chat_only" in head:
                cells.append(ttft_vs_alone(s, alone))
            acc = s["accounting"]
            cells.append(
                f"{acc['completed']}/{acc['submitted']}"
                + ("" if acc["reconciled"] else " (not reconciled)")
            )
            share = host = None
            if s["backend"].get("name") != "llama-server":
                share = frontier_share(out / stem / seed / name)
                host = host_share(out / stem / seed / name)
            cells.append("-" if share is None else f"{share:.2f}")
            cells.append("-" if host is None else f"{host:.1%}")
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def ttft_vs_alone(s: dict[str, Any], alone: dict[str, Any] | None) -> str:
    if alone is None:
        return "-"
    fg, ref = s["foreground"], alone["foreground"]
    return f"x{fg['mean_ttft_ms'] / ref['mean_ttft_ms']:.2f} / x{fg['p95_ttft_ms'] / ref['p95_ttft_ms']:.2f}"


def ratio_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Each edgeprefill configuration against each llama-server one, paired by seed; a
    pair not run in any seed (`run --only`) has no row."""
    head = ["edgeprefill", "against", *[c[0] for c in COLUMNS]]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    seeds = list(runs)
    for ours in POLICIES:
        for theirs in SERVER:
            if not any(runs[s][ours] and runs[s][theirs] for s in seeds):
                continue
            cells = [ours, theirs]
            for _, cls, key, _, _ in COLUMNS:
                a = [metric(runs[s][ours], cls, key) if runs[s][ours] else None for s in seeds]
                b = [metric(runs[s][theirs], cls, key) if runs[s][theirs] else None for s in seeds]
                cells.append(ratio_cell(a, b))
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def ratio_cell(ours: list[float | None], theirs: list[float | None]) -> str:
    """The geometric-mean ratio over seeds, with its paired 95% interval of the change."""
    p = paired(ours, theirs)
    if not p["n"]:
        return "-"
    ci = p["change_ci95"]
    span = f" [{ci[0]:+.0%} .. {ci[1]:+.0%}]" if ci else ""
    return f"x{p['geomean_ratio']:.3f}{span}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run what is missing, then write the tables and plots")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--seeds", type=int, default=3)
    r.add_argument("--tools", type=Path, default=TOOLS, help="folder with llama-server")
    r.add_argument("--threads", type=int, default=None, help="compute threads for every run")
    r.add_argument("--only", default=None, help="comma-separated configurations to run")
    t = sub.add_parser("table", help="print the tables of a finished (or partial) run")
    t.add_argument("out", type=Path)
    args = ap.parse_args()
    if args.command == "run":
        only = args.only.split(",") if args.only else None
        run(args.out, args.seeds, args.tools, args.threads, only)
    else:
        print(tables(args.out), end="")


if __name__ == "__main__":
    main()
