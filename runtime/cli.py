"""`edgeprefill`: the command line.

Bad input of any kind ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import click

from edgeprefill.runtime.errors import UserError


@click.group()
def cli() -> None:
    """Interleave foreground chat and background document prefill on one local model."""


@cli.command()
@click.argument("workload", type=click.Path(path_type=Path))
@click.option("--backend", type=click.Choice(["llamacpp"]), default="llamacpp", show_default=True)
@click.option("--model", type=click.Path(path_type=Path), default=None,
              help="GGUF file [default: the bundled Gemma 3 270M Q4_K_M]")
@click.option("--policy", "policy_spec", default="static:64", show_default=True,
              help="prefill budget policy: static:N (N prompt tokens per iteration) or unlimited")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="results folder [default: results/WORKLOAD-POLICY-TIME]")
@click.option("--seed", type=int, default=None, help="override the workload's seed")
@click.option("--n-ctx", type=int, default=16384, show_default=True,
              help="KV cells per sequence (the longest prompt + output)")
@click.option("--kv-unified/--no-kv-unified", default=False, show_default=True,
              help="one KV pool of --n-ctx cells shared by all sequences")
@click.option("--n-batch", type=int, default=2048, show_default=True,
              help="most tokens in one iteration")
@click.option("--n-ubatch", type=int, default=None,
              help="most tokens llama.cpp computes in one graph [default: --n-batch]")
@click.option("--n-seq-max", type=int, default=8, show_default=True,
              help="sequences decoded together")
@click.option("--max-background", type=int, default=None,
              help="sequences background work may hold [default: half of --n-seq-max]")
@click.option("--foreground-kv", type=int, default=None,
              help="KV cells background work must leave free [default: --n-ctx / 8]")
@click.option("--threads", type=int, default=0, help="CPU threads [default: physical cores]")
@click.option("--progress/--no-progress", default=True, show_default=True)
def run(workload: Path, backend: str, model: Path | None, policy_spec: str, out: Path | None,
        seed: int | None, n_ctx: int, kv_unified: bool, n_batch: int, n_ubatch: int | None, n_seq_max: int,
        max_background: int | None, foreground_kv: int | None, threads: int,
        progress: bool) -> None:
    """Run WORKLOAD (a YAML file) and write summary.json, requests.jsonl, iterations.jsonl."""
    from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
    from edgeprefill.backends.llamacpp.model_file import default_model_path
    from edgeprefill.runtime.console import LiveProgress, format_summary
    from edgeprefill.runtime.engine import Engine
    from edgeprefill.runtime.policy import parse_policy
    from edgeprefill.runtime.results import RunWriter
    from edgeprefill.runtime.scheduler import BackgroundLimits
    from edgeprefill.runtime.run import run_requests
    from edgeprefill.runtime.trace import build_requests
    from edgeprefill.runtime.workload import load_workload
    from edgeprefill.thermal.machine import describe_machine

    spec = load_workload(workload)
    policy = parse_policy(policy_spec)
    config = LlamaCppConfig(
        model=model if model is not None else default_model_path(),
        n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max, n_threads=threads,
        kv_unified=kv_unified,
    )
    started = datetime.now(timezone.utc)
    if out is None:
        stamp = started.strftime("%Y%m%d-%H%M%S")
        out = Path("results") / f"{spec.name}-{policy_spec.replace(':', '_')}-{stamp}"
    with LlamaCppBackend(config) as be:
        requests = build_requests(spec, be.tokenizer, seed)
        try:
            engine = Engine(be, policy, limits=BackgroundLimits(max_background, foreground_kv))
        except ValueError as e:
            raise UserError(f"--max-background/--foreground-kv: {e}") from None
        with RunWriter(out) as writer, LiveProgress(requests, enabled=progress) as show:
            outcome = run_requests(engine, requests, writer, show)
            meta = {
                "backend": be.describe(),
                "policy": {**policy.describe(), "spec": policy_spec},
                "workload": {"name": spec.name, "path": str(workload)},
                "seed": spec.seed if seed is None else seed,
                "start_time": started.isoformat(),
                "machine": describe_machine(),
                "simulated": False,
            }
            summary = writer.summary(meta, outcome.duration_s, outcome.interrupted,
                                     outcome.not_arrived)
            writer.write_summary(summary)
    click.echo(format_summary(summary))
    click.echo(f"results: {out}")
    if outcome.interrupted:
        click.echo("run interrupted: finished requests were kept, the rest marked failed", err=True)
        sys.exit(130)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except UserError as e:
        click.echo(f"edgeprefill: error: {e}", err=True)
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
