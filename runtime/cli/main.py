"""`edgeprefill`: the command line.

Bad input of any kind ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.policies import DEFAULT_POLICY
from edgeprefill.runtime.runner.device import open_device, run_options


@click.group()
def cli() -> None:
    """Interleave foreground chat and background document prefill on one local model."""


class _Size(click.ParamType):
    """A size in bytes: 512MiB, 2GiB, 1.5G (binary units), or a plain number of bytes."""

    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        import humanfriendly

        try:
            return int(humanfriendly.parse_size(str(value), binary=True))
        except humanfriendly.InvalidSize:
            self.fail(f"{value!r} is not a size: write it as 512MiB, 2GiB or bytes", param, ctx)


SIZE = _Size()


def device_options(batching: str = "auto") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The backend and device options `run`, `compare` and `sweep` share; `batching` is
    the command's default batching mode."""
    options = [
        click.option(
            "--backend",
            type=click.Choice(["llamacpp", "vllm", "sim"]),
            default="llamacpp",
            show_default=True,
            help="vllm: the same policies inside vLLM's scheduler (GPU, or its CPU build); "
            "sim: the simulated backend (needs --cost-model)",
        ),
        click.option(
            "--model",
            type=click.Path(path_type=Path),
            default=None,
            help="llamacpp: a GGUF file; vllm: a Hugging Face model folder [default: the "
            "bundled Gemma 3 270M Q4_K_M, converted once for vLLM]",
        ),
        click.option(
            "--dtype",
            default="auto",
            show_default=True,
            help="vllm: weight and activation dtype (auto, float32, bfloat16, float16)",
        ),
        click.option(
            "--tensor-parallel-size",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="vllm: GPUs one model is split across",
        ),
        click.option(
            "--enforce-eager/--no-enforce-eager",
            default=False,
            show_default=True,
            help="vllm: skip torch.compile and CUDA graphs (starts in seconds, steps slower)",
        ),
        click.option(
            "--kv-cache/--no-kv-cache",
            default=True,
            show_default=True,
            help="keep documents' KV state once read (llamacpp: in memory, then on disk; "
            "vllm: its automatic prefix caching) for prompts that start with them",
        ),
        click.option(
            "--kv-cache-dir",
            type=click.Path(path_type=Path),
            default=None,
            help="llamacpp: folder for saved KV states, kept across runs [default: one of "
            "this command's own, deleted at its end, each run starting empty]",
        ),
        click.option(
            "--kv-cache-ram",
            type=SIZE,
            default="1GiB",
            show_default=True,
            help="llamacpp: memory for saved KV states (e.g. 512MiB, 2GiB)",
        ),
        click.option(
            "--kv-cache-disk",
            type=SIZE,
            default="4GiB",
            show_default=True,
            help="llamacpp: disk for saved KV states, least recently used deleted first",
        ),
        click.option(
            "--kv-cache-gib",
            type=float,
            default=None,
            help="vllm: memory for the KV cache [default: vLLM's share of the device]",
        ),
        click.option(
            "--cost-model",
            type=click.Path(path_type=Path),
            default=None,
            help="the simulated backend's cost model (from `edgeprefill calibrate`)",
        ),
        click.option(
            "--sim-noise",
            type=click.Choice(["none", "measured"]),
            default="none",
            show_default=True,
            help="sim: add to each iteration one of the calibrated run's residuals (measured "
            "minus predicted time), drawn at random",
        ),
        click.option(
            "--calibration",
            default="probe",
            show_default=True,
            help="device profile for policy defaults: probe (a few iterations at "
            "startup), none, or a cost-model file",
        ),
        click.option(
            "--n-ctx",
            type=int,
            default=16384,
            show_default=True,
            help="KV cells per sequence (the longest prompt + output)",
        ),
        click.option(
            "--kv-unified/--no-kv-unified",
            default=False,
            show_default=True,
            help="one KV pool of --n-ctx cells shared by all sequences",
        ),
        click.option(
            "--n-batch",
            type=int,
            default=2048,
            show_default=True,
            help="most tokens in one iteration",
        ),
        click.option(
            "--batching",
            type=click.Choice(["auto", "exact", "fast"]),
            default=batching,
            show_default=True,
            help="exact: only batch shapes the device probe measured bit-identical to "
            "decoding each sequence alone; fast: the fastest shapes it measured; auto: exact "
            "where that costs under 3%% on this CPU, else fast",
        ),
        click.option(
            "--n-ubatch",
            type=int,
            default=None,
            help="most tokens llama.cpp computes in one graph [default: the device probe's "
            "fastest]",
        ),
        click.option(
            "--flash-attn/--no-flash-attn",
            default=None,
            help="llama.cpp's flash attention [default: the device probe's choice]",
        ),
        click.option(
            "--max-decode-group",
            type=int,
            default=None,
            help="most decode tokens in one llama_decode pass [default: exact batching: the "
            "largest group the device probe measured bit-identical; fast: all]",
        ),
        click.option(
            "--reprobe",
            is_flag=True,
            default=False,
            help="measure the device probe again instead of reading it from the cache",
        ),
        click.option(
            "--n-seq-max",
            type=int,
            default=16,
            show_default=True,
            help="sequences decoded together",
        ),
        click.option(
            "--max-background",
            type=int,
            default=None,
            help="sequences background work may hold [default: half of --n-seq-max]",
        ),
        click.option(
            "--foreground-kv",
            type=int,
            default=None,
            help="KV cells background work must leave free [default: --n-ctx / 8]",
        ),
        click.option(
            "--threads", type=int, default=0, help="CPU threads [default: physical cores]"
        ),
        click.option("--progress/--no-progress", default=True, show_default=True),
        click.option(
            "--telemetry/--no-telemetry",
            default=True,
            show_default=True,
            help="sample temperature, clocks, power and energy beside the run",
        ),
        click.option(
            "--telemetry-period",
            type=float,
            default=0.2,
            show_default=True,
            help="seconds between telemetry samples",
        ),
        click.option(
            "--tdp-watts",
            type=float,
            default=None,
            help="estimate CPU energy as TDP x CPU load where no RAPL counter can be read "
            "(labelled estimated)",
        ),
        click.option(
            "--thermal-aware/--no-thermal-aware",
            default=False,
            show_default=True,
            help="scale the background budget down while the device throttles, runs hot or "
            "is on battery",
        ),
        click.option(
            "--thermal-factor",
            type=float,
            default=0.5,
            show_default=True,
            help="background budget multiplier while --thermal-aware's condition holds",
        ),
        click.option(
            "--thermal-max-temp",
            type=float,
            default=90.0,
            show_default=True,
            help="CPU/GPU temperature (C) at which --thermal-aware scales down",
        ),
        click.option(
            "--thermal-battery/--no-thermal-battery",
            default=True,
            show_default=True,
            help="whether running on battery counts for --thermal-aware",
        ),
    ]

    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        return functools.reduce(lambda g, opt: opt(g), reversed(options), f)

    return apply


@cli.command()
@click.argument("workload", type=click.Path(path_type=Path))
@click.option(
    "--policy",
    "policy_spec",
    default=DEFAULT_POLICY,
    show_default=True,
    help="prefill budget policy: static:N, unlimited, ppas[:nth=,bmax=,bcap=], "
    "dlfp[:target_ms=,...], cadence[:itl_ms=,tail_pct=]",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="results folder [default: results/WORKLOAD-POLICY-TIME]",
)
@click.option("--seed", type=int, default=None, help="override the workload's seed")
@device_options()
def run(workload: Path, policy_spec: str, out: Path | None, seed: int | None, **o: Any) -> None:
    """Run WORKLOAD (a YAML file) and write summary.json, requests.jsonl, iterations.jsonl."""
    from edgeprefill.runtime.cli.console import format_summary
    from edgeprefill.runtime.policies import parse_policy
    from edgeprefill.runtime.runner.session import run_workload
    from edgeprefill.runtime.traffic.expected import expected_work
    from edgeprefill.runtime.traffic.workload import load_workload

    spec = load_workload(workload)
    parse_policy(policy_spec)  # a bad spec fails before the model loads
    if out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        out = Path("results") / f"{spec.name}-{policy_spec.replace(':', '_')}-{stamp}"
    options = run_options(o)  # bad values fail before the model loads
    with open_device(o, expected_work(spec)) as (make_backend, profile):
        result = run_workload(
            spec,
            workload,
            make_backend(),
            policy_spec,
            out,
            profile=profile,
            seed=seed,
            options=options,
        )
    click.echo(format_summary(result.summary))
    click.echo(f"results: {out}")
    if result.outcome.interrupted:
        click.echo("run interrupted: finished requests were kept, the rest marked failed", err=True)
        sys.exit(130)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="cost-model file [default: RUN_DIR/cost_model.json]",
)
def calibrate(run_dir: Path, out: Path | None) -> None:
    """Fit the iteration cost model to RUN_DIR's iterations.jsonl, for the simulated
    backend (`--backend sim --cost-model FILE`) or as a run's `--calibration FILE`."""
    from edgeprefill.runtime.runner.calibration import profile_from_run, save_profile

    profile = profile_from_run(run_dir)
    out = out or run_dir / "cost_model.json"
    save_profile(profile, out)
    c = profile.cost
    click.echo(
        f"fitted {c.n_samples} iterations: {c.per_pass_s * 1e3:.2f} ms per pass + "
        f"{c.per_sampled_s * 1e3:.2f} ms per sampled row + {c.per_prefill_s * 1e3:.3f} ms per prompt "
        f"token + {c.per_kctx_s * 1e3:.3f} ms per 1k attended cells (rmse "
        f"{(c.rmse_s or 0) * 1e3:.1f} ms); target {profile.target_s * 1e3:.0f} ms -> chunk "
        f"{profile.chunk_for()}"
    )
    click.echo(f"cost model: {out}")


@cli.command()
@click.argument("workload", type=click.Path(path_type=Path))
@click.option(
    "--policies",
    default="static:64,ppas,dlfp,cadence",
    show_default=True,
    help="comma-separated policy specs",
)
@click.option(
    "--baselines",
    default=None,
    help="policies to take ratios against [default: every static/unlimited/ppas/dlfp given]",
)
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="paired trials: the workload's seed, seed+1, ...",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="folder for every run and comparison.json [default: results/compare-TIME]",
)
@device_options(batching="exact")
def compare(
    workload: Path, policies: str, baselines: str | None, seeds: int, out: Path | None, **o: Any
) -> None:
    """Run every policy on the same arrivals and prompts for each seed and compare them."""
    import json

    from edgeprefill.runtime.analysis.compare import format_report
    from edgeprefill.runtime.runner.comparison import run_comparison
    from edgeprefill.runtime.traffic.expected import expected_work
    from edgeprefill.runtime.traffic.workload import load_workload

    spec = load_workload(workload)
    names, bases = _policy_lists(policies, baselines)
    if out is None:
        out = Path("results") / f"compare-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    options = run_options(o)
    with open_device(o, expected_work(spec)) as (make_backend, profile):
        report, checks = run_comparison(
            spec,
            workload,
            names,
            bases,
            seeds,
            make_backend,
            profile,
            out,
            options=options,
            simulated=o["backend"] == "sim",
        )
    (out / "comparison.json").write_text(json.dumps(report, indent=2) + "\n")
    click.echo(format_report(report, checks))
    click.echo(f"comparison: {out / 'comparison.json'}")


@cli.command()
@click.argument("workload", type=click.Path(path_type=Path))
@click.option(
    "--burst-rates",
    default="0.5,1.5",
    show_default=True,
    help="comma-separated rates (req/s) for every burst phase",
)
@click.option("--policies", default="unlimited,static:256,ppas,cadence", show_default=True)
@click.option("--baselines", default=None, help="[default: every static/unlimited/ppas/dlfp]")
@click.option("--seeds", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="[default: results/sweep-TIME]"
)
@device_options(batching="exact")
def sweep(
    workload: Path,
    burst_rates: str,
    policies: str,
    baselines: str | None,
    seeds: int,
    out: Path | None,
    **o: Any,
) -> None:
    """P-PAS's load sweep: compare policies on WORKLOAD (phased arrivals) at each burst rate;
    report per rate and the geometric mean of the per-rate ratios (P-PAS eq. 1-2)."""
    import json

    from edgeprefill.runtime.analysis.compare import format_sweep
    from edgeprefill.runtime.runner.comparison import run_sweep
    from edgeprefill.runtime.traffic.expected import expected_work
    from edgeprefill.runtime.traffic.workload import load_workload

    spec = load_workload(workload)
    try:
        rates = [float(r) for r in burst_rates.split(",") if r.strip()]
    except ValueError:
        raise UserError(f"--burst-rates must be numbers, got {burst_rates!r}") from None
    if not rates or min(rates) <= 0:
        raise UserError(f"--burst-rates must be positive, got {burst_rates!r}")
    names, bases = _policy_lists(policies, baselines)
    out = out or Path("results") / f"sweep-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    options = run_options(o, progress=False)
    with open_device(o, expected_work(spec)) as (make_backend, profile):
        report = run_sweep(
            spec,
            workload,
            rates,
            names,
            bases,
            seeds,
            make_backend,
            profile,
            out,
            options=options,
            simulated=o["backend"] == "sim",
        )
    (out / "sweep.json").write_text(json.dumps(report, indent=2) + "\n")
    click.echo(format_sweep(report))
    click.echo(f"sweep: {out / 'sweep.json'}")


@cli.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="report folder [default: RUN_DIR/report for one folder, else results/report-TIME]",
)
def report(run_dirs: tuple[Path, ...], out: Path | None) -> None:
    """PNG figures and an HTML page for RUN_DIRS: run folders, or compare/sweep folders
    (every run in them, with the comparison)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(
            "reports need matplotlib, which is not installed: pip install 'edgeprefill[report]'"
        ) from None
    from edgeprefill.runtime.analysis.report import write_report

    if out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        out = run_dirs[0] / "report" if len(run_dirs) == 1 else Path("results") / f"report-{stamp}"
    page = write_report(list(run_dirs), out)
    click.echo(f"report: {page}")


def _policy_lists(policies: str, baselines: str | None) -> tuple[list[str], list[str]]:
    from edgeprefill.runtime.policies import parse_policy

    names = [p.strip() for p in policies.split(",") if p.strip()]
    for name in names:
        parse_policy(name)
    if len(set(names)) != len(names) or len(names) < 2:
        raise UserError(f"--policies needs two or more different policies, got {policies!r}")
    bases = (
        [b.strip() for b in baselines.split(",")]
        if baselines
        else [n for n in names if n.split(":")[0] in ("static", "ppas", "dlfp", "unlimited")]
    )
    unknown = [b for b in bases if b not in names]
    if unknown:
        raise UserError(f"--baselines {', '.join(unknown)} not among --policies {policies}")
    return names, bases


# Library messages name parameters as Python does, in backquotes; a command-line user gets
# the flag that sets each.
FLAGS = {
    "model": "--model",
    "policy": "--policy",
    "n_ctx": "--n-ctx",
    "n_batch": "--n-batch",
    "n_ubatch": "--n-ubatch",
    "n_seq_max": "--n-seq-max",
    "n_threads": "--threads",
    "max_decode_group": "--max-decode-group",
}


def as_flags(message: str) -> str:
    return re.sub(r"`(\w+)`", lambda m: FLAGS.get(m[1], m[0]), message)


def main() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("edgeprefill: %(message)s"))
    logging.getLogger("edgeprefill").addHandler(handler)
    logging.getLogger("edgeprefill").setLevel(logging.INFO)
    try:
        cli.main(standalone_mode=False)
    except UserError as e:
        click.echo(f"edgeprefill: error: {as_flags(str(e))}", err=True)
        sys.exit(2)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.format_message(), err=True)
        sys.exit(2)
    except click.UsageError as e:
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
        click.echo(f"edgeprefill: error: {e.format_message()}{hint}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"edgeprefill: error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("edgeprefill: aborted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
