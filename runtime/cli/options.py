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
from edgeprefill.runtime.runner.devices.kind import option

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


PATH = click.Path(path_type=Path)


def device_group() -> Decorator:
    backends = "; ".join(f"{k.name}: {k.help}" for k in kinds())
    return cloup.option_group(
        "Device",
        option("--backend", "llamacpp", backends, type=click.Choice(DEVICES.names())),
        option(
            "--model",
            help="llamacpp: a GGUF file; vllm: a Hugging Face model folder [default: the "
            "bundled Gemma 3 270M Q4_K_M, converted once for vLLM]",
            type=PATH,
        ),
        option("--threads", 0, "CPU threads [default: physical cores]", type=int),
        option("--n-ctx", 16384, "KV cells per sequence (the longest prompt + output)", type=int),
        option("--n-batch", 2048, "most tokens in one iteration", type=int),
        option("--n-seq-max", 16, "sequences decoded together", type=int),
        option(
            "--calibration",
            "probe",
            "device profile for policy defaults: probe (a few iterations at startup), none, "
            "or a cost-model file",
        ),
    )


def batching_group(default: str) -> Decorator:
    return cloup.option_group(
        "Batching",
        option(
            "--batching",
            default,
            "exact: only batch shapes the device probe measured bit-identical to decoding "
            "each sequence alone; fast: the fastest shapes it measured; auto: exact where "
            "that costs under 3% on this CPU, else fast",
            type=click.Choice(["auto", "exact", "fast"]),
        ),
        option(
            "--n-ubatch",
            help="most tokens computed in one graph [default: the device probe's fastest]",
            type=int,
        ),
        option(
            "--kv-unified/--no-kv-unified",
            False,
            "one KV pool of --n-ctx cells shared by all sequences",
        ),
    )


ADMISSION = cloup.option_group(
    "Admission",
    option(
        "--max-background",
        help="sequences background work may hold [default: half of --n-seq-max]",
        type=int,
    ),
    option(
        "--foreground-kv",
        help="KV cells background work must leave free [default: --n-ctx / 8]",
        type=int,
    ),
)

KV_CACHE = cloup.option_group(
    "KV cache",
    option(
        "--kv-cache/--no-kv-cache",
        True,
        "keep documents' KV state once read (llamacpp: in memory, then on disk; vllm: its "
        "automatic prefix caching) for prompts that start with them",
    ),
)

TELEMETRY = cloup.option_group(
    "Telemetry",
    option("--progress/--no-progress", True),
    option(
        "--telemetry/--no-telemetry",
        True,
        "sample temperature, clocks, power and energy beside the run",
    ),
    option("--telemetry-period", 0.2, "seconds between telemetry samples", type=float),
    option(
        "--tdp-watts",
        help="estimate CPU energy as TDP x CPU load where no RAPL counter can be read "
        "(labelled estimated)",
        type=float,
    ),
)

THERMAL = cloup.option_group(
    "Thermal",
    option(
        "--thermal-aware/--no-thermal-aware",
        False,
        "scale the background budget down while the device throttles, runs hot or is on battery",
    ),
    option(
        "--thermal-factor",
        0.5,
        "background budget multiplier while --thermal-aware's condition holds",
        type=float,
    ),
    option(
        "--thermal-max-temp",
        90.0,
        "CPU/GPU temperature (C) at which --thermal-aware scales down",
        type=float,
    ),
    option(
        "--thermal-battery/--no-thermal-battery",
        True,
        "whether running on battery counts for --thermal-aware",
    ),
)


def device_options(batching: str = "auto") -> Decorator:
    """Every device option, `batching` being the command's default batching mode."""
    groups: list[Decorator] = [
        device_group(),
        batching_group(batching),
        ADMISSION,
        KV_CACHE,
        TELEMETRY,
        THERMAL,
    ]
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
