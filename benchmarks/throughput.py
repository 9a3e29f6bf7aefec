"""edgeprefill's prefill-only and decode-only iterations against llama.cpp's own
llama-batched-bench on the same shapes, model and threads, in interleaved rounds.

    benchmarks/build_llamacpp_tools.sh            # once: prints the tools' folder
    .venv/bin/python benchmarks/throughput.py --tools build/llamacpp-tools/build/bin

Shapes: one 2,048-token prompt prefilled in one iteration (prompt tokens per second), and
1, 4 and 8 sequences decoding together at a 512-token context (decode tokens per second).
llama-batched-bench runs each shape at every flash-attention and micro-batch setting below,
as a tuned user would, and its best setting is the reference. edgeprefill runs the same
shapes through its engine (plan, batch, decode, sample, bookkeeping), timed by wall clock,
so host overhead counts against it, with the settings its device probe chooses for the
work measured (one backend told it will prefill, one that it will decode, as `run` tells
the backend a workload's expected work; fast batching unless `--batching exact`). Each round runs both sides back to back, alternating
which goes first; the machine's speed drifts, so only ratios within a round are compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from llama_server import weights_layout

from edgeprefill.backends.bundled_model import default_model_path
from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from edgeprefill.backends.llamacpp.probe import plain_tokens
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.load import ExpectedLoad, RequestShape
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.policies import UnlimitedPolicy

PREFILL = 2048
PREFILL_REPEATS = 3  # one prefill is ~2.5 s: the median of three, each side, each round
DECODE_CTX = 512
DECODE_STEPS = 32
PARALLEL = (1, 4, 8)
SETTINGS = [(fa, ub) for fa in ("off", "on") for ub in (256, 512, 2048)]


def batched_bench(tools: Path, model: Path, threads: int) -> dict[str, dict[str, float]]:
    """tok/s per shape for every setting: {"fa=off ub=256": {"prefill": .., "decode1": ..}}."""
    out: dict[str, dict[str, float]] = {}
    for fa, ub in SETTINGS:
        common = [
            str(tools / "llama-batched-bench"),
            "-m",
            str(model),
            "-t",
            str(threads),
            "-b",
            "2048",
            "-ub",
            str(ub),
            "-fa",
            fa,
            "--output-format",
            "jsonl",
        ]
        common += weights_layout(common)
        prefill = [
            _jsonl(
                common + ["-c", str(PREFILL + 64), "-npp", str(PREFILL), "-ntg", "1", "-npl", "1"]
            )[0]["speed_pp"]
            for _ in range(PREFILL_REPEATS)
        ]
        shape = {"prefill": statistics.median(prefill)}
        ctx = max(PARALLEL) * (DECODE_CTX + DECODE_STEPS)
        rows = _jsonl(
            common
            + ["-c", str(ctx), "-npp", str(DECODE_CTX), "-ntg", str(DECODE_STEPS)]
            + ["-npl", ",".join(map(str, PARALLEL))]
        )
        shape |= {f"decode{r['pl']}": r["speed_tg"] for r in rows}
        out[f"fa={fa} ub={ub}"] = shape
    return out


def _jsonl(cmd: list[str]) -> list[dict[str, Any]]:
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def edgeprefill_prefill(be: LlamaCppBackend) -> dict[str, float]:
    """Prompt tok/s of a PREFILL-token prompt in one iteration (median of
    PREFILL_REPEATS), wall clock around
    `Engine.iterate` (plan, batch, decode, sample, bookkeeping)."""
    tokens = plain_tokens(be.model, PREFILL)
    rates = []
    for _ in range(PREFILL_REPEATS):
        engine = Engine(be, UnlimitedPolicy())
        engine.add(Request("p", "background", 0.0, tokens, max_tokens=1))
        t0 = time.perf_counter()
        it = engine.iterate()
        rates.append(PREFILL / (time.perf_counter() - t0))
        assert it is not None and it.plan.n_prefill == PREFILL and not engine.has_work
    return {"prefill": statistics.median(rates)}


def edgeprefill_decode(be: LlamaCppBackend) -> dict[str, float]:
    """Decode tok/s of n sequences decoding together, wall clock around each decode-only
    `Engine.iterate`."""
    tokens = plain_tokens(be.model, max(PARALLEL) * DECODE_CTX)
    out: dict[str, float] = {}
    for n in PARALLEL:
        engine = Engine(be, UnlimitedPolicy())
        for i in range(n):
            prompt = tokens[i * DECODE_CTX : (i + 1) * DECODE_CTX]
            req = Request(f"d{i}", "foreground", 0.0, prompt, DECODE_STEPS + 1, ignore_eos=True)
            engine.add(req)
        steps = []
        while engine.has_work:
            t0 = time.perf_counter()
            it = engine.iterate()
            elapsed = time.perf_counter() - t0
            if it is not None and it.plan.n_decode == n and not it.plan.prefill:
                steps.append(elapsed)
        out[f"decode{n}"] = n * len(steps) / sum(steps)
    return out


# What each measurement computes, told to the backend as `run` tells it a workload's
# expected work: its probe then picks the settings fastest for that work.
PREFILL_WORK = ExpectedLoad((RequestShape(1, PREFILL, 1),))
DECODE_WORK = ExpectedLoad((RequestShape(max(PARALLEL), 0, DECODE_STEPS),))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tools", type=Path, required=True, help="folder with llama-batched-bench")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="[default: physical cores]")
    ap.add_argument("--batching", choices=["auto", "exact", "fast"], default="fast")
    ap.add_argument("--out", type=Path, default=Path("results/throughput.json"))
    args = ap.parse_args()
    model = default_model_path()

    def backend(work: ExpectedLoad) -> LlamaCppBackend:
        return LlamaCppBackend(
            LlamaCppConfig(
                model=model,
                n_ctx=PREFILL + 64,
                n_seq_max=max(PARALLEL),
                n_threads=args.threads,
                batching=args.batching,
                expected_load=work,
            )
        )

    rounds: list[dict[str, Any]] = []
    with backend(PREFILL_WORK) as pre, backend(DECODE_WORK) as dec:
        for r in range(args.rounds):
            sides = {}
            order = ("ours", "llama") if r % 2 == 0 else ("llama", "ours")
            for side in order:
                if side == "ours":
                    sides["edgeprefill"] = edgeprefill_prefill(pre) | edgeprefill_decode(dec)
                else:
                    sides["batched_bench"] = batched_bench(args.tools, model, pre.n_threads)
            rounds.append(sides)
            print(f"round {r + 1}/{args.rounds}: {json.dumps(sides)}", flush=True)
        report = summarize(rounds, {"prefill": pre.describe(), "decode": dec.describe()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(format_table(report))
    print(f"results: {args.out}")


def summarize(rounds: list[dict[str, Any]], backends: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per shape: llama-batched-bench's best setting (by median over rounds) and the
    per-round ratio of edgeprefill to it. For decodes n_ubatch changes nothing (a pass of
    at most 8 rows is one micro-batch under every n_ubatch), so the runs at each n_ubatch
    are repeats of one setting, pooled by their median: the best of three repeats would
    pick noise."""
    table = {}
    for shape in rounds[0]["edgeprefill"]:
        side = "prefill" if shape == "prefill" else "decode"
        b = backends[side]["batching"]

        def setting(name: str, side: str = side) -> str:
            return name if side == "prefill" else name.split()[0]

        def per_round(r: dict[str, Any], shape: str = shape) -> dict[str, float]:
            groups: dict[str, list[float]] = {}
            for name, tok_s in r["batched_bench"].items():
                groups.setdefault(setting(name), []).append(tok_s[shape])
            return {k: statistics.median(v) for k, v in groups.items()}

        reference = [per_round(r) for r in rounds]
        medians = {k: statistics.median(ref[k] for ref in reference) for k in reference[0]}
        best = max(medians, key=lambda k: medians[k])
        same = setting(f"fa={'on' if b['flash_attn'] else 'off'} ub={b['n_ubatch']}")
        ours = [r["edgeprefill"][shape] for r in rounds]
        ratios = [o / ref[best] for o, ref in zip(ours, reference, strict=True)]
        table[shape] = {
            "edgeprefill_setting": same,
            "edgeprefill_tok_s": statistics.median(ours),
            "batched_bench_best": best,
            "batched_bench_tok_s": medians[best],
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "same_setting_ratio_median": statistics.median(
                o / ref[same] for o, ref in zip(ours, reference, strict=True) if same in ref
            )
            if same in medians
            else None,
        }
    return {
        "backends": {
            side: {k: d[k] for k in ("model_description", "n_threads", "batching", "expected_load")}
            | {"probe_source": d["probe"]["source"]}
            for side, d in backends.items()
        },
        "rounds": rounds,
        "table": table,
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"edgeprefill against llama-batched-bench's best setting, "
        f"{len(report['rounds'])} interleaved rounds",
        f"{'shape':<10}{'edgeprefill':>13}{'its setting':>14}{'batched-bench':>15}"
        f"{'best setting':>16}{'ratio (min..max)':>24}{'same setting':>14}",
    ]
    for shape, t in report["table"].items():
        same = t["same_setting_ratio_median"]
        lines.append(
            f"{shape:<10}{t['edgeprefill_tok_s']:>13.1f}{t['edgeprefill_setting']:>14}"
            f"{t['batched_bench_tok_s']:>15.1f}{t['batched_bench_best']:>16}"
            f"{t['ratio_median']:>10.3f} ({t['ratio_min']:.3f}..{t['ratio_max']:.3f})"
            f"{float('nan') if same is None else same:>14.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
