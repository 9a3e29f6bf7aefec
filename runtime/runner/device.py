"""Opening the device a command names: the backend and the profile policies default from.

Both are chosen from the command line's device options (see `cli.device_options`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.work import ExpectedWork


@contextmanager
def open_device(o: dict[str, Any], work: ExpectedWork | None = None) -> Iterator[tuple[Any, Any]]:
    """The backend the options name, set up for the `work` the command will run, and the
    device profile policies default from."""
    from edgeprefill.runtime.runner.calibration import load_profile, load_residuals

    if o["backend"] == "sim":
        from edgeprefill.backends.sim import SimBackend
        from edgeprefill.runtime.core.contract import Capacity

        if o["cost_model"] is None:
            raise UserError(
                "--backend sim needs --cost-model FILE (write one with "
                "`edgeprefill calibrate RUN_DIR`)"
            )
        profile = load_profile(o["cost_model"])
        n_ctx = o["n_ctx"] * (1 if o["kv_unified"] else o["n_seq_max"])
        try:
            capacity = Capacity(
                o["n_batch"],
                n_ctx,
                o["n_seq_max"],
                o["n_ctx"],
                profile.min_chunk,
                o["n_ubatch"] or o["n_batch"],
                profile.chunk_quantum,
            )
        except ValueError as e:
            raise UserError(str(e)) from None
        noise = load_residuals(o["cost_model"]) if o["sim_noise"] == "measured" else ()
        # Every run draws the same noise sequence: paired runs meet the same stalls.
        yield (lambda: SimBackend(profile.cost, capacity, residuals=noise)), profile
        return

    if o["backend"] == "vllm":
        from edgeprefill.backends.vllm.backend import VllmBackend, VllmSettings
        from edgeprefill.backends.vllm.model_folder import default_model_folder

        settings = VllmSettings(
            model=o["model"] if o["model"] is not None else default_model_folder(),
            n_ctx=o["n_ctx"],
            n_batch=o["n_batch"],
            n_seq_max=o["n_seq_max"],
            n_threads=o["threads"] or None,
            dtype=o["dtype"],
            tensor_parallel_size=o["tensor_parallel_size"],
            enforce_eager=o["enforce_eager"],
            kv_cache_gib=o["kv_cache_gib"],
            prefix_caching=o["kv_cache"],
        )
        with VllmBackend(settings) as vb:
            yield (lambda: vb), _profile(o["calibration"], vb)
        return

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise UserError(
            "the llama.cpp backend needs llama-cpp-python, which is not installed: "
            "pip install 'edgeprefill[llamacpp]' (or use --backend sim)"
        ) from None
    from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
    from edgeprefill.backends.llamacpp.model_file import default_model_path

    # A command's saved prefixes live in a folder of its own unless one is named, so one
    # run never starts from what another left (see RunOptions.fresh_kv_cache).
    kv_dir = o["kv_cache_dir"]
    scratch = None
    if o["kv_cache"] and kv_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="kv-", dir=_scratch_parent())
        kv_dir = Path(scratch.name)
    config = LlamaCppConfig(
        model=o["model"] if o["model"] is not None else default_model_path(),
        n_ctx=o["n_ctx"],
        n_batch=o["n_batch"],
        n_seq_max=o["n_seq_max"],
        n_threads=o["threads"],
        kv_unified=o["kv_unified"],
        batching=o["batching"],
        n_ubatch=o["n_ubatch"],
        flash_attn=o["flash_attn"],
        max_decode_group=o["max_decode_group"],
        refresh_probe=o["reprobe"],
        expected_work=work,
        kv_cache=o["kv_cache"],
        kv_cache_dir=kv_dir,
        kv_cache_ram=o["kv_cache_ram"],
        kv_cache_disk=o["kv_cache_disk"],
    )
    try:
        with LlamaCppBackend(config) as be:
            yield (lambda: be), _profile(o["calibration"], be)
    finally:
        if scratch is not None:
            scratch.cleanup()


def _scratch_parent() -> Path | None:
    """The user's KV cache folder (on disk, unlike a tmpfs /tmp); else the system's."""
    from edgeprefill.backends.cache import kv_cache_dir

    folder = kv_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder


def _profile(calibration: str, backend: Any) -> Any:
    """The device profile `--calibration` names: measured now, none, or from a file."""
    from edgeprefill.runtime.runner.calibration import load_profile, probe_device

    if calibration == "probe":
        return probe_device(backend)
    if calibration == "none":
        return None
    return load_profile(Path(calibration))


def run_options(o: dict[str, Any], progress: bool | None = None) -> Any:
    """RunOptions from the command line's device options; bad values as one-line errors."""
    from edgeprefill.runtime.core.scheduler import BackgroundLimits, check_background_seqs
    from edgeprefill.runtime.runner.session import RunOptions
    from edgeprefill.thermal.guard import ThermalSettings
    from edgeprefill.thermal.telemetry import TelemetryConfig

    if o["backend"] == "vllm" and (o["max_background"], o["foreground_kv"]) != (None, None):
        raise UserError(
            "--max-background/--foreground-kv apply to the llama.cpp backend; vLLM admits "
            "requests by its own KV-cache accounting: drop them"
        )
    if o["max_background"] is not None:  # before the model loads and the device is probed
        try:
            check_background_seqs(o["max_background"], o["n_seq_max"])
        except ValueError as e:
            raise UserError(f"--max-background: {e}") from None
    if o["sim_noise"] != "none" and o["backend"] != "sim":
        raise UserError(
            "--sim-noise applies to --backend sim only (a real device brings its own): "
            f"drop it for --backend {o['backend']}"
        )
    if o["thermal_aware"] and (not o["telemetry"] or o["backend"] == "sim"):
        raise UserError(
            "--thermal-aware needs telemetry from a real device: drop --no-telemetry, and "
            "use a real backend rather than --backend sim"
        )
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
        fresh_kv_cache=o["kv_cache_dir"] is None,
    )
