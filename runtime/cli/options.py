"""The options `run`, `compare` and `sweep` share, in groups by concern, and one group per
backend from what each backend registers (`runner.devices`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import cloup

from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.runner.devices import DEVICES, kinds

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def device_group() -> Decorator:
    return cloup.option_group(
        "Device",
        click.option(
            "--backend",
            type=click.Choice(DEVICES.names()),
            default="llamacpp",
            show_default=True,
            help="; ".join(f"{k.name}: {k.help}" for k in kinds()),
        ),
        click.option(
            "--model",
            type=click.Path(path_type=Path),
            default=None,
            help="llamacpp: a GGUF file; vllm: a Hugging Face model folder [default: the "
            "bundled Gemma 3 270M Q4_K_M, converted once for vLLM]",
        ),
        click.option(
            "--threads", type=int, default=0, help="CPU threads [default: physical cores]"
        ),
        click.option(
            "--n-ctx",
            type=int,
            default=16384,
            show_default=True,
            help="KV cells per sequence (the longest prompt + output)",
        ),
        click.option(
            "--n-batch",
            type=int,
            default=2048,
            show_default=True,
            help="most tokens in one iteration",
        ),
        click.option(
            "--n-seq-max",
            type=int,
            default=16,
            show_default=True,
            help="sequences decoded together",
        ),
        click.option(
            "--calibration",
            default="probe",
            show_default=True,
            help="device profile for policy defaults: probe (a few iterations at "
            "startup), none, or a cost-model file",
        ),
    )


def batching_group(default: str) -> Decorator:
    return cloup.option_group(
        "Batching",
        click.option(
            "--batching",
            type=click.Choice(["auto", "exact", "fast"]),
            default=default,
            show_default=True,
            help="exact: only batch shapes the device probe measured bit-identical to "
            "decoding each sequence alone; fast: the fastest shapes it measured; auto: exact "
            "where that costs under 3% on this CPU, else fast",
        ),
        click.option(
            "--n-ubatch",
            type=int,
            default=None,
            help="most tokens computed in one graph [default: the device probe's fastest]",
        ),
        click.option(
            "--kv-unified/--no-kv-unified",
            default=False,
            show_default=True,
            help="one KV pool of --n-ctx cells shared by all sequences",
        ),
    )


ADMISSION = cloup.option_group(
    "Admission",
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
)

KV_CACHE = cloup.option_group(
    "KV cache",
    click.option(
        "--kv-cache/--no-kv-cache",
        default=True,
        show_default=True,
        help="keep documents' KV state once read (llamacpp: in memory, then on disk; "
        "vllm: its automatic prefix caching) for prompts that start with them",
    ),
)

TELEMETRY = cloup.option_group(
    "Telemetry",
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
)

THERMAL = cloup.option_group(
    "Thermal",
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
)


def device_options(batching: str = "auto") -> Decorator:
    """Every device option, `batching` being the command's default batching mode."""
    groups = [device_group(), batching_group(batching), ADMISSION, KV_CACHE, TELEMETRY, THERMAL]
    groups += [cloup.option_group(k.title, *k.options) for k in kinds() if k.options]

    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        return functools.reduce(lambda g, group: group(g), reversed(groups), f)

    return apply


def given_options() -> set[str]:
    """The options the user set (on the command line or in the environment)."""
    ctx = click.get_current_context()
    defaults = (click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP)
    return {
        p.name
        for p in ctx.command.params
        if p.name and ctx.get_parameter_source(p.name) not in (None, *defaults)
    }


def run_options(o: dict[str, Any], progress: bool | None = None) -> Any:
    """RunOptions from the command line's device options; bad values as one-line errors,
    before any model loads."""
    from edgeprefill.runtime.cli.flags import flag
    from edgeprefill.runtime.core.scheduler import BackgroundLimits, check_background_seqs
    from edgeprefill.runtime.runner.devices import check_options
    from edgeprefill.runtime.runner.session import RunOptions
    from edgeprefill.thermal.guard import ThermalSettings
    from edgeprefill.thermal.telemetry import TelemetryConfig

    check_options(o, given_options(), flag)
    if o["max_background"] is not None:
        try:
            check_background_seqs(o["max_background"], o["n_seq_max"])
        except ValueError as e:
            raise UserError(f"--max-background: {e}") from None
    if o["thermal_aware"] and not o["telemetry"]:
        raise UserError("--thermal-aware needs telemetry: drop --no-telemetry")
    try:
        telemetry = (
            TelemetryConfig(o["telemetry_period"], o["tdp_watts"]) if o["telemetry"] else None
        )
        thermal = (
            ThermalSettings(o["thermal_factor"], o["thermal_max_temp"], o["thermal_battery"])
            if o["thermal_aware"]
            else None
        )
    except ValueError as e:
        raise UserError(f"--telemetry-period/--tdp-watts/--thermal-factor: {e}") from None
    return RunOptions(
        BackgroundLimits(o["max_background"], o["foreground_kv"]),
        o["progress"] if progress is None else progress,
        telemetry,
        thermal,
        fresh_kv_cache=o.get("kv_cache_dir") is None,
    )
