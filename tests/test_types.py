"""The type checker passes over runtime/, backends/ and thermal/ (its settings in
pyproject.toml's [tool.mypy]).

The folders install as `edgeprefill.runtime` and so on (setup.py maps them); mypy cannot
follow an editable install's import hook, so it checks them through a folder of links
named as the installed packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
LAYERS = ("runtime", "backends", "thermal")


def test_mypy_finds_no_error(tmp_path: Path) -> None:
    package = tmp_path / "edgeprefill"
    package.mkdir()
    for layer in LAYERS:
        (package / layer).symlink_to(ROOT / layer, target_is_directory=True)
    packages = [arg for layer in LAYERS for arg in ("-p", f"edgeprefill.{layer}")]
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *packages],
        cwd=tmp_path,
        # The cache keeps what it learnt of vLLM and torch (most of a first run's minute).
        env={**os.environ, "MYPYPATH": str(tmp_path), "MYPY_CACHE_DIR": str(ROOT / ".mypy_cache")},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
