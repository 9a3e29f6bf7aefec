"""`pip install edgeprefill` as a user runs it: a wheel built from the tracked files, installed
(not editable) into a fresh venv outside the checkout, then the installed `edgeprefill`
command asked for help, for the server's help, and to run a tiny simulated workload. The
editable install that `make` does hides a package missing from the wheel."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import yaml

from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.runner.calibration import save_profile

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[1]
LAYERS = ("runtime", "backends", "thermal")


def _sh(*args: str | Path, cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The fresh venv's `bin/`. Its dependencies come from this venv through a path entry
    (no download, and no editable finder: a `.pth` only adds the folder, and `.pth` files
    inside an added folder are not read); the package itself only from the wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    files = _sh("git", "ls-files", "-z", cwd=ROOT).split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((ROOT / name).read_bytes())
    _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp / "dist", source, cwd=tmp)
    fresh = tmp / "venv"
    venv.create(fresh, with_pip=True)
    bin_dir = fresh / "bin"
    wheels = (tmp / "dist").glob("*.whl")
    _sh(bin_dir / "python", "-m", "pip", "install", "--no-deps", *wheels, cwd=tmp)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = _sh(bin_dir / "python", "-c", purelib, cwd=tmp)
    (Path(site.strip()) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return bin_dir


def test_the_wheel_holds_every_module_of_the_source_tree(installed):
    wheel = next((installed.parent.parent / "dist").glob("edgeprefill-*.whl"))
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    source = {
        f"edgeprefill/{p.relative_to(ROOT).as_posix()}"
        for layer in LAYERS
        for p in (ROOT / layer).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert source - shipped == set()
    assert "edgeprefill/runtime/server/app.py" in shipped


def test_the_installed_command_helps_serves_and_runs_a_simulated_workload(installed, tmp_path):
    where = _sh(
        installed / "python",
        "-c",
        "import edgeprefill.runtime as r; print(r.__file__)",
        cwd=tmp_path,
    )
    assert str(ROOT) not in where and "site-packages" in where  # the wheel, not the checkout
    command = installed / "edgeprefill"
    assert "serve" in _sh(command, "--help", cwd=tmp_path)
    assert "--api-key" in _sh(command, "serve", "--help", cwd=tmp_path)
    cost = CostModel(per_pass_s=0.012, per_sampled_s=0.002, per_prefill_s=0.0015, per_kctx_s=1e-5)
    save_profile(DeviceProfile(cost, 0.016, 0.1, 2048, 1, "test"), tmp_path / "cost.json")
    stream = {
        "arrivals": {"process": "burst", "count": 2},
        "prompt": {"source": "text", "tokens": 40},
        "output_tokens": 3,
    }
    workload = {"name": "tiny", "seed": 1, "streams": {"chat": {"class": "foreground", **stream}}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(workload))
    run = ["run", "tiny.yaml", "--backend", "sim", "--cost-model", "cost.json", "--no-progress"]
    _sh(command, *run, "--out", "out", cwd=tmp_path)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["completed"] == 2 and summary["accounting"]["reconciled"]
