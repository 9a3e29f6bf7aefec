"""Where the time goes under `edgeprefill serve` beside `edgeprefill run` on one trace: each
process's threads (CPU time, and time runnable but waiting for a core, from
/proc/PID/task/*/stat and schedstat), the replay client's own CPU, and the iterations by
shape from each one's iterations.jsonl. Rounds rotate the order; each seed is a round's
trace. The machine's steal time (a VM's lost cycles, /proc/stat) is read around each.

    .venv/bin/python benchmarks/serve_account.py workloads/assistant_plus_indexer.yaml \
        --out results/serve-account [--seeds 0 1 2] [--rounds 1] [--threads 2] \
        [--engine-args ""] [--other before=/tmp/before-ep] [--client raw]

`--other` also serves another version of the code; `--client NAME` also serves this one to
another of `http_replay.py`'s clients (`raw`: a socket and a thread a request, a `recv`
and a time stamp a chunk; `one-thread`: the same reads, every request in one thread).

Threads are named by role, not by name (Python 3.11 gives its threads no OS name): the main
thread is the server's event loop; the `--threads` busiest others are llama.cpp's compute
threads (the engine thread among them: it runs the graph's first share); the rest "other".
In `run` the main thread is the engine and computes. Prints one table; writes account.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from http_replay import CLIENTS, Endpoint, ServeProcess, server_delivery
from llama_server import trace, write_results

from edgeprefill.runtime.traffic.workload import load_workload

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def steal_s() -> float:
    """CPU time the hypervisor gave to others, all cores together, since boot."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) * TICK_S


def thread_stats(pid: int) -> dict[int, dict[str, float]]:
    """tid -> CPU s, s runnable but not running, s alive, and context switches (voluntary:
    it slept, on the GIL, a lock or I/O; involuntary: another thread took its core)."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    stats = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            _, wait_ns, _ = map(int, (task / "schedstat").read_text().split())
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        stats[int(task.name)] = {
            "cpu_s": (int(fields[11]) + int(fields[12])) * TICK_S,
            "waiting_s": wait_ns / 1e9,
            "alive_s": uptime - int(fields[19]) * TICK_S,
            "voluntary": int(status["voluntary_ctxt_switches"]),
            "involuntary": int(status["nonvoluntary_ctxt_switches"]),
        }
    return stats


class Sampler:
    """The newest stats of every thread a process ever had, read twice a second until
    `stop` (threads that end keep their last reading)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, dict[str, float]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

        self.cpu_s = 0.0  # this sampler's own CPU time, for the client's account

    def _run(self) -> None:
        while not self._done.wait(0.5):
            self._read()
        self.cpu_s = time.thread_time()

    def _read(self) -> None:
        try:
            self.seen.update(thread_stats(self.pid))
        except FileNotFoundError:
            pass  # it exited: the last reading stands

    def stop(self) -> dict[int, dict[str, float]]:
        self._read()
        self._done.set()
        self._thread.join()
        return self.seen


def roles(
    seen: dict[int, dict[str, float]], pid: int, n_compute: int, main_computes: bool
) -> dict[str, dict[str, float]]:
    """Sum the threads' stats by role: compute, loop (the server's main thread), other.
    "sleeping_s" is a thread's time neither on a core nor waiting for one."""
    others = sorted((t for t in seen if t != pid), key=lambda t: -seen[t]["cpu_s"])
    compute = ([pid] if main_computes else []) + others[: n_compute - int(main_computes)]
    by_role: dict[str, list[int]] = {"compute": compute}
    if not main_computes:
        by_role["loop"] = [pid]
    by_role["other"] = [t for t in seen if t not in compute and t != pid]
    keys = ("cpu_s", "waiting_s", "alive_s", "voluntary", "involuntary")
    out = {}
    for role, tids in by_role.items():
        total = {k: sum(seen[t][k] for t in tids) for k in keys}
        total["sleeping_s"] = total["alive_s"] - total["cpu_s"] - total["waiting_s"]
        out[role] = {"threads": len(tids), **total}
    return out


def iteration_shapes(path: Path) -> dict[str, Any]:
    """Device time, host time and the median decode-only iteration by rows (1-4)."""
    its = [json.loads(line) for line in path.read_text().splitlines()]
    decode_only: dict[int, list[float]] = {}
    for it in its:
        if it["rows_prefill"] == 0 and 1 <= it["rows_decode"] <= 4:
            decode_only.setdefault(it["rows_decode"], []).append(it["duration_s"])
    mixed = [it for it in its if it["rows_prefill"] > 0]
    return {
        "iterations": len(its),
        "device_s": sum(it["duration_s"] for it in its),
        "host_s": sum(it["host_s"] for it in its),
        "decode_only_median_ms": {
            rows: 1e3 * statistics.median(d) for rows, d in sorted(decode_only.items())
        },
        "prompt_tok_per_device_s": sum(it["rows_prefill"] for it in mixed)
        / max(1e-9, sum(it["duration_s"] for it in mixed)),
    }


def outcome(summary: dict[str, Any]) -> dict[str, float]:
    fg, bg = summary["foreground"], summary["background"]
    return {
        "fg_p99_itl_ms": fg["p99_itl_ms"],
        "fg_median_itl_ms": fg["median_itl_ms"],
        "fg_mean_ttft_ms": fg["mean_ttft_ms"],
        "bg_makespan_s": bg["makespan_s"],
        "completed": summary["completed"],
    }


def account_run(workload: Path, seed: int, threads: int, out: Path, args: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "edgeprefill.runtime.cli.main", "run", "--backend", "llamacpp"]
    cmd += [str(workload), "--seed", str(seed), "--threads", str(threads), "--out", str(out)]
    cmd += shlex.split(args)
    with (out.parent / f"{out.name}.log").open("w") as log:
        proc = subprocess.Popen([*cmd, "--no-progress", "--no-telemetry"], stdout=log, stderr=log)
        sampler = Sampler(proc.pid)
        proc.wait()
    seen = sampler.stop()
    summary = json.loads((out / "summary.json").read_text())
    return {
        "mode": "run",
        "threads": roles(seen, proc.pid, threads, main_computes=True),
        "iterations": iteration_shapes(out / "iterations.jsonl"),
        **outcome(summary),
    }


def account_serve(
    workload: Path, seed: int, threads: int, out: Path, args: str, client: type[Endpoint] = Endpoint
) -> dict[str, Any]:
    requests = trace(load_workload(workload), seed, out)
    server_dir = out / "server"
    options = f"--results {server_dir} --threads {threads} --no-progress --no-telemetry {args}"
    server = ServeProcess(options, out / "server.log")
    sampler = Sampler(server.proc.pid)
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        duration = client(server.url).replay(requests)
        delivery = server_delivery(server.url)
        after = resource.getrusage(resource.RUSAGE_SELF)
        seen = sampler.stop()
    finally:
        server.close()
    client_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    client_s -= sampler.cpu_s  # the sampler thread's own reading
    meta = {"backend": {"name": "edgeprefill-serve", "token_delivery": delivery}}
    write_results(out, requests, duration, meta, "edgeprefill serve")
    summary = json.loads((out / "summary.json").read_text())
    tokens = sum(len(r.output) for r in requests)
    return {
        "mode": "serve",
        "threads": roles(seen, server.proc.pid, threads, main_computes=False),
        "client": {"cpu_s": client_s, "us_per_token": 1e6 * client_s / max(1, tokens)},
        "iterations": iteration_shapes(server_dir / "iterations.jsonl"),
        "delivery": delivery,
        **outcome(summary),
    }


def row(r: dict[str, Any]) -> list[str]:
    t, it = r["threads"], r["iterations"]
    loop = t.get("loop", {"cpu_s": 0.0, "waiting_s": 0.0})
    client = r.get("client", {}).get("us_per_token")
    delivery = r.get("delivery") or {}
    shapes = "/".join(f"{v:.1f}" for v in it["decode_only_median_ms"].values())
    return [
        r["mode"],
        f"{r['fg_p99_itl_ms']:.0f}",
        f"{r['fg_median_itl_ms']:.0f}",
        f"{r['fg_mean_ttft_ms']:.0f}",
        f"{r['bg_makespan_s']:.1f}",
        shapes,
        f"{it['prompt_tok_per_device_s']:.0f}",
        f"{it['device_s']:.1f}",
        f"{it['host_s']:.1f}",
        f"{t['compute']['cpu_s']:.1f}",
        f"{t['compute']['waiting_s']:.1f}",
        f"{t['compute']['sleeping_s']:.1f}",
        f"{t['compute']['voluntary']:.0f}",
        f"{t['compute']['involuntary']:.0f}",
        f"{loop['cpu_s']:.1f}",
        f"{loop['waiting_s']:.2f}",
        f"{t['other']['cpu_s']:.1f}",
        "-" if client is None else f"{client:.0f}",
        "-"
        if not delivery.get("within_1ms")
        else f"{delivery['p99_ms_at_most']:g} / {delivery['within_1ms']:.2%}",
        f"{r['steal_s']:.1f}",
    ]


HEAD = [
    "mode",
    "fg P99 ITL ms",
    "fg median ITL ms",
    "fg mean TTFT ms",
    "bg makespan s",
    "decode-only ms (1/2/3/4 rows)",
    "prompt tok/device s",
    "device s",
    "host s",
    "compute CPU s",
    "compute runnable s",
    "compute sleeping s",
    "compute voluntary switches",
    "compute involuntary switches",
    "loop CPU s",
    "loop runnable s",
    "other CPU s",
    "client us/token",
    "delivery P99 ms <= / within 1 ms",
    "steal s",
]


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| round | " + " | ".join(HEAD) + " |", "|" + "---|" * (len(HEAD) + 1)]
    lines += [f"| {r['round']} | " + " | ".join(row(r)) + " |" for r in results]
    return "\n".join(lines) + "\n"


def ratios(results: list[dict[str, Any]]) -> str:
    """Each mode against `run` of the same round, and their geometric mean over rounds."""
    keys = ("fg_p99_itl_ms", "fg_mean_ttft_ms", "bg_makespan_s")
    runs = {r["round"]: r for r in results if r["mode"] == "run"}
    by_mode: dict[str, list[list[float]]] = {}
    for r in results:
        if r["mode"] != "run" and r["round"] in runs:
            by_mode.setdefault(r["mode"], []).append([r[k] / runs[r["round"]][k] for k in keys])
    lines = ["| mode / run | rounds | P99 ITL | mean TTFT | makespan |", "|---|---|---|---|---|"]
    for mode, rows in by_mode.items():
        means = [statistics.geometric_mean(col) for col in zip(*rows, strict=True)]
        lines.append(f"| {mode} | {len(rows)} | " + " | ".join(f"x{m:.3f}" for m in means) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--rounds", type=int, default=1, help="per seed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--engine-args", default="", help="options for both, e.g. '--n-seq-max 40 --n-ctx 4096'"
    )
    ap.add_argument(
        "--other",
        metavar="NAME=PATH",
        action="append",
        default=[],
        help="also serve the edgeprefill package found at PATH (a PYTHONPATH), as NAME",
    )
    ap.add_argument(
        "--client",
        choices=sorted(set(CLIENTS) - {"httpx"}),
        action="append",
        default=[],
        help="also serve this code to this one of http_replay's clients, named after it",
    )
    args = ap.parse_args()
    modes = [("run", ""), ("serve", ""), *(tuple(o.split("=", 1)) for o in args.other)]
    modes += [(name, "") for name in args.client]
    results = []
    rounds = [(seed, r) for r in range(args.rounds) for seed in args.seeds]
    for i, (seed, r) in enumerate(rounds):
        for mode, path in modes[i % len(modes) :] + modes[: i % len(modes)]:
            out = args.out / f"{mode}-s{seed}-{r}"
            out.mkdir(parents=True, exist_ok=True)
            os.environ["PYTHONPATH"] = path
            account = account_run if mode == "run" else account_serve
            extra = {"client": CLIENTS[mode]} if mode in args.client else {}
            stolen = steal_s()
            res = account(args.workload, seed, args.threads, out, args.engine_args, **extra)
            res["steal_s"] = steal_s() - stolen
            results.append({"round": f"{seed}/{r}", **res, "mode": mode})
            (args.out / "account.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(results) + "\n" + ratios(results), end="")


if __name__ == "__main__":
    main()
