"""`--backend sim`: the simulated backend over a cost model from `edgeprefill calibrate`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.load import ExpectedLoad
from edgeprefill.runtime.runner.devices.kind import DEVICES, DeviceKind, Opened, Options, option


@contextmanager
def open_sim(o: Options, load: ExpectedLoad | None) -> Iterator[Opened]:
    from edgeprefill.backends.sim import SimBackend
    from edgeprefill.runtime.core.contract import Capacity
    from edgeprefill.runtime.runner.calibration import load_profile, load_residuals

    (path,) = o["cost_model"]  # one a device; `compare` opens one for each it was given
    profile = load_profile(path)
    if o["n_ubatch"] is not None and not 1 <= o["n_ubatch"] <= o["n_batch"]:
        raise UserError(
            f"`n_ubatch` must be between 1 and `n_batch` ({o['n_batch']}), got {o['n_ubatch']}"
        )
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
    noise = load_residuals(path) if o["sim_noise"] == "measured" else ()
    # Every run draws the same noise sequence: paired runs meet the same stalls.
    yield (lambda: SimBackend(profile.cost, capacity, residuals=noise)), profile


# The commands that take several cost models, one comparison on each.
SEVERAL = ("compare", "sweep")


def check(o: Options) -> None:
    if not o["cost_model"]:
        raise UserError(
            "--backend sim needs --cost-model FILE (write one with `edgeprefill calibrate RUN_DIR`)"
        )
    command = getattr(click.get_current_context(silent=True), "info_name", None)
    if len(o["cost_model"]) > 1 and command not in SEVERAL:
        raise UserError(
            f"--cost-model was given {len(o['cost_model'])} times: `{command}` simulates one "
            "device; only `compare` and `sweep` take several (a comparison on each)"
        )
    if o["thermal_aware"]:
        raise UserError("--thermal-aware needs telemetry from a real device, not --backend sim")


SIM = DEVICES.register("sim")(
    DeviceKind(
        "sim",
        "the simulated backend (needs --cost-model)",
        open_sim,
        "Simulated backend",
        options=(
            option(
                "--cost-model",
                help="the simulated backend's cost model (from `edgeprefill calibrate`); "
                "`compare` and `sweep` take it repeated, and compare the policies on each",
                type=click.Path(path_type=Path),
                multiple=True,
            ),
            option(
                "--sim-noise",
                "none",
                "add to each iteration one of the calibrated run's residuals (measured minus "
                "predicted time), drawn at random",
                type=click.Choice(["none", "measured"]),
            ),
        ),
        ignores={
            "model": "the cost model stands for the model",
            "calibration": "policies default from the cost model",
        },
        check=check,
    )
)
