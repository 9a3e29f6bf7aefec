"""`edgeprefill report`: figures that are really drawn and a page that shows all of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from edgeprefill.backends.sim import SimBackend
from edgeprefill.runtime.cli.main import cli
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.runner.comparison import Comparison, run_comparison
from edgeprefill.runtime.runner.session import RunOptions, run_workload
from edgeprefill.runtime.traffic.workload import load_workload
from tests.test_policies import CAP, COST

DEFAULT = Path(__file__).parents[1] / "workloads" / "assistant_plus_indexer.yaml"
PROFILE = DeviceProfile(COST, 0.024, 0.1, 2048, 8, "test")
QUIET = RunOptions(progress=False)


def sim_run(out: Path, policy: str) -> Path:
    spec = load_workload(DEFAULT)
    run_workload(spec, DEFAULT, SimBackend(COST, CAP), policy, out, profile=PROFILE, options=QUIET)
    return out


def add_telemetry(run: Path) -> None:
    """A laptop's telemetry: heating up, throttling once, the clock dropping with it."""
    summary = json.loads((run / "summary.json").read_text())
    samples = []
    for t in np.arange(0, summary["duration_s"], 0.2):
        hot = 60 < t < 70
        samples.append(
            {
                "t_s": float(t),
                "cpu_temp": {"c": 60 + t / 10, "throttled": bool(hot)},
                "cpu_freq": {"mean_mhz": 2400 if hot else 3600, "max_mhz": 3600, "live": True},
                "rapl": {"energy_j": {"package-0": 15.0 * t}},
            }
        )
    (run / "telemetry.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    summary["telemetry"] = {"throttle_intervals": [{"start_s": 60.2, "end_s": 70.0}]}
    (run / "summary.json").write_text(json.dumps(summary))


def assert_drawn(png: Path, min_w: int = 600, min_h: int = 300) -> None:
    img = imread(png)
    h, w = img.shape[:2]
    assert w >= min_w and h >= min_h, (png, img.shape)
    rgb = img[..., :3]
    inked = (rgb.mean(axis=2) < 0.9).mean()  # not white background
    assert inked > 0.02, f"{png.name} is nearly blank ({inked:.1%} inked)"
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 20  # lines, text, colours


def images_referenced(page: Path) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', page.read_text())


def test_report_of_two_runs(tmp_path):
    a = sim_run(tmp_path / "static", "static:64")
    b = sim_run(tmp_path / "cadence", "cadence")
    add_telemetry(b)
    result = CliRunner().invoke(cli, ["report", str(a), str(b), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    rep = tmp_path / "rep"
    pngs = sorted(p.name for p in rep.glob("*.png"))
    assert pngs == sorted(
        [
            "cdfs.png",
            "p99.png",
            "timeline-static-64-seed0.png",
            "timeline-cadence-seed0.png",
            "telemetry-cadence-seed0.png",
        ]
    )
    for name in pngs:
        assert_drawn(rep / name)
    page = rep / "report.html"
    assert sorted(images_referenced(page)) == pngs  # every PNG shown, none missing
    text = page.read_text()
    assert "sim (SIMULATED) | cadence | assistant_plus_indexer | seed 0" in text
    assert "No telemetry plotted: simulated backend" in text  # the static run has none


def test_a_compare_folder_becomes_the_same_report(tmp_path):
    spec = load_workload(DEFAULT)
    report, _ = run_comparison(
        Comparison(
            spec,
            DEFAULT,
            ["static:64", "cadence"],
            ["static:64"],
            2,
            lambda: SimBackend(COST, CAP),
            PROFILE,
            tmp_path / "cmp",
            options=QUIET,
            simulated=True,
        )
    )
    (tmp_path / "cmp" / "comparison.json").write_text(json.dumps(report))
    result = CliRunner().invoke(cli, ["report", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.output
    rep = tmp_path / "cmp" / "report"
    assert len(list(rep.glob("timeline-*.png"))) == 4  # two policies x two seeds
    text = (rep / "report.html").read_text()
    assert "Comparison (SIMULATED): assistant_plus_indexer, seeds [0, 1]" in text
    for name in images_referenced(rep / "report.html"):
        assert_drawn(rep / name)


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_report_on_a_folder_without_runs_is_a_clear_error(tmp_path, make):
    target = tmp_path / "x"
    if make == "empty":
        target.mkdir()
    from edgeprefill.runtime.analysis.report import write_report
    from edgeprefill.runtime.core.errors import UserError

    with pytest.raises(UserError, match="pass run, compare or sweep folders|holds no runs"):
        write_report([target], tmp_path / "rep")
