"""vLLM's AsyncScheduler variant (the GPU default), forced on the CPU build. In a module of
its own: two vLLM engines cannot live in one process, and closing one tears down the
parallel state the other uses."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs its CPU build)")

from edgeprefill.backends.vllm.backend import VllmBackend  # noqa: E402
from tests.test_vllm import Recording, drain, requests  # noqa: E402
from tests.vllm_model import tiny_settings, write_tiny_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_the_async_scheduler_variant_caps_and_times_steps_too(tmp_path, monkeypatch):
    """The GPU default is vLLM's AsyncScheduler; on the CPU build async scheduling is off,
    so the variant is forced here: the same cap and one timing per step must hold."""
    from edgeprefill.backends.vllm import backend as vb

    monkeypatch.setitem(vb.SCHEDULERS, False, vb.SCHEDULERS[True])
    folder = write_tiny_model(tmp_path / "model")
    settings = tiny_settings(folder)
    with VllmBackend(settings) as be:
        assert be.describe()["scheduler"] == "EdgeprefillAsyncScheduler"
        policy = Recording(40)
        reqs = requests(be.tokenizer)
        steps = drain(be.engine(policy), reqs)
    assert len(policy.seen) == len(steps) > 0
    for _, it in steps:
        assert it.plan.n_prefill <= 40 or not it.plan.decode
    assert all(len(r.output) == r.max_tokens for r in reqs)
