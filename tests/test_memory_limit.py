"""A KV cache larger than the memory available is refused before llama.cpp allocates it,
with the numbers and the fix; one that fits is predicted to the byte llama.cpp reports."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import psutil
import pytest

from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from edgeprefill.backends.llamacpp.memory import KvFootprint, check_fits
from edgeprefill.backends.llamacpp.native import LlamaContext, LlamaModel, captured_log
from edgeprefill.runtime.core.errors import UserError

pytestmark = pytest.mark.slow
DEFAULT = Path(__file__).parents[1] / "workloads" / "assistant_plus_indexer.yaml"


def reported_kv_bytes(lines: list[str]) -> float:
    """What llama.cpp says it allocated for KV (sum over its caches)."""
    sizes = [re.search(r"llama_kv_cache: size =\s*([\d.]+) MiB", line) for line in lines]
    return sum(float(m.group(1)) for m in sizes if m) * (1 << 20)


@pytest.mark.parametrize(
    "n_ctx,n_seq,n_ubatch,unified",
    [(4096, 4, 512, False), (2048, 3, 256, False), (8192, 4, 512, True)],
)
def test_the_prediction_is_what_llama_cpp_allocates(model_path, n_ctx, n_seq, n_ubatch, unified):
    model = LlamaModel(model_path)
    try:
        footprint = KvFootprint.measure(model)
        assert footprint.full_bytes > 0 and footprint.window_bytes > 0  # Gemma 3: both kinds
        with captured_log() as lines:
            ctx = LlamaContext(
                model,
                n_ctx=n_ctx,
                n_batch=2048,
                n_ubatch=n_ubatch,
                n_seq_max=n_seq,
                n_threads=1,
                kv_unified=unified,
            )
            ctx.close()
        need = footprint.bytes_for(n_ctx, n_seq, n_ubatch, model.n_swa, unified)
        assert need == pytest.approx(reported_kv_bytes(lines), rel=0.01)
    finally:
        model.close()


def test_a_cache_over_available_memory_is_refused_with_the_numbers_and_the_fix(
    model_path, monkeypatch
):
    # psutil is the thin layer that reads the OS: pretend 1 GiB is free.
    free = namedtuple("vmem", "available")(1 << 30)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    with pytest.raises(UserError) as e:
        LlamaCppBackend(LlamaCppConfig(model=model_path, n_ctx=32768, n_seq_max=64))
    message = str(e.value)
    assert "KV cache needs" in message and "x 64 sequences" in message
    assert "1.0 GiB of memory is available" in message and "--n-ctx" in message
    # What it suggests does fit.
    fits = int(message.split("--n-ctx ")[1].split()[0])
    be = LlamaCppBackend(LlamaCppConfig(model=model_path, n_ctx=fits, n_seq_max=64))
    be.close()


def test_the_suggested_context_fits_at_any_micro_batch_the_probe_may_choose(monkeypatch):
    """Checked before the probe at the smallest micro-batch, the suggestion must still fit
    once the probe picks the largest: the sliding-window ring grows with it (a suggestion
    made at the smallest was refused again at 512 on a CI machine)."""
    free = namedtuple("vmem", "available")(1 << 30)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    footprint = KvFootprint(full_bytes=3072.0, window_bytes=15360.0)  # Gemma 3 270M, per cell
    with pytest.raises(UserError) as e:
        check_fits(footprint, 32768, 64, 1, 512, False, largest_ubatch=2048)
    fits = int(str(e.value).split("--n-ctx ")[1].split()[0])
    for n_ubatch in (1, 64, 512, 2048):
        check_fits(footprint, fits, 64, n_ubatch, 512, False)


def test_the_command_line_refuses_it_in_one_line(tmp_path, model_path):
    """Sized from this machine's memory: enough sequences at the trained context that their
    KV cache needs more than all of it."""
    import math

    model = LlamaModel(model_path)
    try:
        per_seq = KvFootprint.measure(model).bytes_for(32768, 1, 512, model.n_swa, False)
    finally:
        model.close()
    n_seq = math.floor(psutil.virtual_memory().total / per_seq) + 1
    if n_seq > 256:  # llama.cpp's most sequences
        pytest.skip("even the largest cache llama.cpp allows fits in this machine's memory")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgeprefill.runtime.cli.main",
            "run",
            str(DEFAULT),
            "--n-ctx",
            "32768",
            "--n-seq-max",
            str(n_seq),
            "--n-batch",
            "2048",
            "--no-progress",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("edgeprefill: error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr  # (and the probe's notice)
    assert "the KV cache needs" in errors[0] and f"x {n_seq} sequences" in errors[0]
