"""`edgeprefill`: the command line.

Bad input of any kind ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import click
import cloup

from edgeprefill.runtime.cli.flags import as_flags
from edgeprefill.runtime.cli.options import PATH, Decorator, device_options, run_options
from edgeprefill.runtime.cli.serving import server_options, server_settings
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.policies import DEFAULT_POLICY, baseline_policies, policy_usage
from edgeprefill.runtime.runner.devices import open_device
from edgeprefill.runtime.runner.devices.kind import option


@cloup.group()
def cli() -> None:
    """Interleave foreground chat and background document prefill on one local model."""


@cli.command()
@click.argument("workload", type=click.Path(path_type=Path))
@cloup.option_group(
    "Run",
    option(
        "--policy policy_spec",
        DEFAULT_POLICY,
        f"prefill budget policy: {policy_usage()}",
    ),
    option("--out", help="results folder [default: results/WORKLOAD-POLICY-TIME]", type=PATH),
    option("--seed", help="override the workload's seed", type=click.IntRange(min=0)),
)
@device_options()
def run(workload: Path, policy_spec: str, out: Path | None, seed: int | None, **o: Any) -> None:
    """Run WORKLOAD (a YAML file) and write summary.json, requests.jsonl, iterations.jsonl."""
    from edgeprefill.runtime.cli.console import format_summary
    from edgeprefill.runtime.policies import parse_policy
    from edgeprefill.runtime.runner.session import run_workload
    from edgeprefill.runtime.traffic.expected import expected_load
    from edgeprefill.runtime.traffic.workload import load_workload

    spec = load_workload(workload)
    parse_policy(policy_spec)  # a bad spec fails before the model loads
    if out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        out = Path("results") / f"{spec.name}-{policy_spec.replace(':', '_')}-{stamp}"
    options = run_options(o)  # bad values fail before the model loads
    with open_device(o, expected_load(spec)) as (make_backend, profile):
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
        sys.exit(128 + (result.outcome.signal or signal.SIGINT))  # as a shell reports it


@cli.command()
@server_options()
@device_options()
def serve(**o: Any) -> None:
    """An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models,
    /v1/documents, /health, /metrics) in which chats go ahead of background documents.
    If the engine fails, every request in flight ends with the reason, the results are
    written and the command exits with 1, for a supervisor to restart it."""
    from edgeprefill.runtime.policies import parse_policy
    from edgeprefill.runtime.server.serve import build, quiet_openmp_spin
    from edgeprefill.runtime.server.serve import serve as run_server

    parse_policy(o["policy_spec"])
    if o["backend"] == "sim":
        raise click.UsageError(
            "--backend sim cannot serve: its clock is virtual (iteration times come from the "
            "cost model); serve with --backend llamacpp or vllm, or replay a workload with "
            "`edgeprefill run --backend sim`"
        )
    if o["backend"] == "llamacpp":
        quiet_openmp_spin()  # before llama.cpp (and libgomp with it) loads
    options = run_options(o, progress=False)
    with open_device(o) as (make_backend, profile), make_backend() as backend:
        name = o["served_model_name"] or Path(backend.describe()["model"]).stem
        served = build(
            backend,
            o["policy_spec"],
            profile=profile,
            limits=options.limits,
            results=o["results"],
            telemetry=options.telemetry,
            options=server_settings(o, name),
        )
        signum = run_server(served, o["host"], o["port"], o["cancel_on_shutdown"])
        failure = served.runtime.failure
    # Raised here, once the device is closed: its scratch KV folder is removed first.
    if signum is not None:
        signal.raise_signal(signum)
    if failure is not None:
        where = f" (results in {o['results']})" if o["results"] else ""
        raise click.ClickException(f"{failure}; the server stopped{where}")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@option("--out", help="cost-model file [default: RUN_DIR/cost_model.json]", type=PATH)
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


def comparison_options(policies: str, seeds: int, out: str) -> Decorator:
    """The options `compare` and `sweep` share."""
    options: list[Decorator] = [
        click.argument("workload", type=click.Path(path_type=Path)),
        cloup.option_group(
            "Comparison",
            option("--policies", policies, "comma-separated policy specs"),
            option(
                "--baselines",
                help="policies to take ratios against [default: every one given of "
                f"{', '.join(baseline_policies())}]",
            ),
            option(
                "--seeds",
                seeds,
                "paired trials: the workload's seed, seed+1, ...",
                type=click.IntRange(min=1),
            ),
            option(
                "--out",
                help=f"folder for every run and the report [default: results/{out}-TIME]",
                type=PATH,
            ),
        ),
        device_options(batching="exact"),
    ]

    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        return functools.reduce(lambda g, opt: opt(g), reversed(options), f)

    return apply


@cli.command()
@comparison_options("static:64,ppas,dlfp,cadence", seeds=3, out="compare")
def compare(**o: Any) -> None:
    """Run every policy on the same arrivals and prompts for each seed and compare them."""
    _compare(None, o)


@cli.command()
@option("--burst-rates", "0.5,1.5", "comma-separated rates (req/s) for every burst phase")
@comparison_options("unlimited,static:256,ppas,cadence", seeds=1, out="sweep")
def sweep(burst_rates: str, **o: Any) -> None:
    """P-PAS's load sweep: compare policies on WORKLOAD (phased arrivals) at each burst rate;
    report per rate and the geometric mean of the per-rate ratios (P-PAS eq. 1-2)."""
    try:
        rates = [float(r) for r in burst_rates.split(",") if r.strip()]
    except ValueError:
        raise UserError(f"--burst-rates must be numbers, got {burst_rates!r}") from None
    if not rates or min(rates) <= 0:
        raise UserError(f"--burst-rates must be positive, got {burst_rates!r}")
    _compare(rates, o)


def _compare(rates: list[float] | None, o: dict[str, Any]) -> None:
    """`compare` (rates None) or `sweep` (a comparison at each burst rate); on the
    simulator given several cost models, one on each, in a folder of its own."""
    models = o.get("cost_model") or ()
    if len(models) > 1:
        _compare_on_each(rates, o, models)
        return
    _compare_one(rates, o)


def _compare_on_each(
    rates: list[float] | None, o: dict[str, Any], models: tuple[Path, ...]
) -> None:
    """A slower device in the loop: the same comparison on every cost model given (each
    checked before any runs), reported one after another."""
    from edgeprefill.runtime.runner.calibration import load_profile

    for model in models:
        load_profile(model)
    kind = "compare" if rates is None else "sweep"
    out = o["out"] or Path("results") / f"{kind}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    labels: list[str] = []
    for model in models:
        label = model.parent.name if model.stem == "cost_model" else model.stem
        labels.append(label if label not in labels else f"{label}-{len(labels)}")
    for label, model in zip(labels, models, strict=True):
        click.echo(f"== cost model {model} ({out / label})")
        _compare_one(rates, {**o, "cost_model": (model,), "out": out / label})


def _compare_one(rates: list[float] | None, o: dict[str, Any]) -> None:
    import json

    from edgeprefill.runtime.analysis.compare import format_report, format_sweep
    from edgeprefill.runtime.runner.comparison import (
        Comparison,
        ComparisonInterrupted,
        run_comparison,
        run_sweep,
    )
    from edgeprefill.runtime.traffic.expected import expected_load
    from edgeprefill.runtime.traffic.workload import load_workload

    workload = o.pop("workload")
    spec = load_workload(workload)
    names, bases = _policy_lists(o.pop("policies"), o.pop("baselines"))
    seeds, out = o.pop("seeds"), o.pop("out")
    kind = "compare" if rates is None else "sweep"
    out = out or Path("results") / f"{kind}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    options = run_options(o, progress=None if rates is None else False)
    path = out / ("comparison.json" if rates is None else "sweep.json")
    with open_device(o, expected_load(spec)) as (make_backend, profile):
        c = Comparison(
            spec,
            workload,
            names,
            bases,
            seeds,
            make_backend,
            profile,
            out,
            options,
            simulated=o["backend"] == "sim",
        )
        try:
            if rates is None:
                report, checks = run_comparison(c)
                text = format_report(report, checks)
            else:
                report = run_sweep(c, rates)
                text = format_sweep(report)
        except ComparisonInterrupted as e:
            stopped = {"interrupted": True, "stopped_during": e.where, "finished_runs": e.finished}
            path.write_text(json.dumps(stopped, indent=2) + "\n")
            click.echo(
                f"{kind} {e}: the {len(e.finished)} finished runs and the interrupted one are "
                f"in {out} ({path.name} says which)",
                err=True,
            )
            sys.exit(128 + e.signum)  # as a shell reports it
    path.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(text)
    click.echo(f"{'comparison' if rates is None else 'sweep'}: {path}")


@cli.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@option(
    "--out",
    help="report folder [default: RUN_DIR/report for one folder, else results/report-TIME]",
    type=PATH,
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
        else [n for n in names if n.split(":")[0] in baseline_policies()]
    )
    unknown = [b for b in bases if b not in names]
    if unknown:
        raise UserError(f"--baselines {', '.join(unknown)} not among --policies {policies}")
    return names, bases


class _ConsoleHandler(logging.StreamHandler[TextIO]):
    """Warnings to whatever stderr is now (a caller may have redirected it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("edgeprefill: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def main() -> None:
    log = logging.getLogger("edgeprefill")
    if not any(isinstance(h, _ConsoleHandler) for h in log.handlers):
        log.addHandler(_ConsoleHandler())
    log.setLevel(logging.INFO)
    try:
        cli.main(standalone_mode=False)
    except UserError as e:
        # one line, whatever a library's message held
        click.echo(f"edgeprefill: error: {' '.join(as_flags(str(e)).split())}", err=True)
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
