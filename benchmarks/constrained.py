"""Do chats sampled under a JSON schema's grammar keep their token gaps beside documents?

Runs a workload whose chats ask for JSON (`sampling.json_schema`) as written and with the
schema left out (the same arrivals and prompts), alternating which goes first each round,
with `edgeprefill run --backend llamacpp`, and prints the chats' P99 and median gap between
tokens, the median and P99 host time per iteration that carried a chat's token, and the
ratio of the two P99 gaps (issue 59's target: within x1.1).

    .venv/bin/python benchmarks/constrained.py [--rounds 3] [--out results/constrained]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

WORKLOAD = Path("workloads/json_chats_plus_indexer.yaml")


def unconstrained(path: Path, out: Path) -> Path:
    """The workload with every stream's json_schema left out."""
    spec = yaml.safe_load(path.read_text())
    for stream in spec["streams"].values():
        stream.get("sampling", {}).pop("json_schema", None)
    target = out / f"{path.stem}-free.yaml"
    target.write_text(yaml.safe_dump(spec))
    return target


def run(workload: Path, out: Path, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "edgeprefill.runtime.cli.main", "run", str(workload)]
    command += ["--backend", "llamacpp", "--out", str(out), "--no-progress", *extra]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    fg = json.loads((out / "summary.json").read_text())["foreground"]
    its = [json.loads(line) for line in (out / "iterations.jsonl").open()]
    host = [it["host_s"] * 1e3 for it in its if it.get("n_decode_foreground") and it.get("host_s")]
    return {
        "p99_itl_ms": fg["p99_itl_ms"],
        "median_itl_ms": fg["median_itl_ms"],
        "output_tokens": fg["output_tokens"],
        "host_median_ms": float(np.median(host)),
        "host_p99_ms": float(np.percentile(host, 99)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", type=Path, default=WORKLOAD)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/constrained"))
    ap.add_argument("run_args", nargs="*", help="passed to `edgeprefill run` (after --)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    variants = {"json": args.workload, "free": unconstrained(args.workload, args.out)}
    rows = []
    for r in range(args.rounds):
        order = ["json", "free"] if r % 2 == 0 else ["free", "json"]
        got = {v: run(variants[v], args.out / f"{v}-{r}", args.run_args) for v in order}
        ratio = got["json"]["p99_itl_ms"] / got["free"]["p99_itl_ms"]
        rows.append({"round": r, **got, "p99_ratio": ratio})
        for v in order:
            g = got[v]
            print(
                f"round {r} {v:4}: P99 gap {g['p99_itl_ms']:6.1f} ms, median "
                f"{g['median_itl_ms']:5.1f} ms, {g['output_tokens']} tokens; host a chat's "
                f"iteration: median {g['host_median_ms']:.2f} ms, P99 {g['host_p99_ms']:.2f} ms"
            )
        print(f"round {r}: P99 gap json / free x{ratio:.3f}")
    (args.out / "rounds.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
