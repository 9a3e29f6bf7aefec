"""Log-probabilities as both backends report them: llama.cpp's read from a logits row,
vLLM's mapped from its own ranked entries, in one shape."""

from __future__ import annotations

import numpy as np
import pytest

from edgeprefill.backends.llamacpp.logprobs import token_logprob


def test_a_tokens_logprob_is_its_log_softmax_and_the_top_are_the_likeliest_in_order():
    logits = np.random.default_rng(0).normal(0, 4, 262_144).astype(np.float32)
    exact = logits.astype(np.float64) - logits.max()
    exact -= np.log(np.exp(exact).sum())
    got = token_logprob(logits, 7, 5)
    assert got.logprob == pytest.approx(exact[7], abs=1e-4)
    order = np.argsort(-exact)[:5]
    assert [t for t, _ in got.top] == order.tolist()
    assert [lp for _, lp in got.top] == pytest.approx(exact[order].tolist(), abs=1e-4)
    assert token_logprob(logits, 7, 0).top == ()


def test_vllms_entries_map_to_the_sampled_token_and_the_k_best_ranked():
    Logprob = pytest.importorskip("vllm.logprobs").Logprob
    from edgeprefill.backends.vllm.engine import _logprob

    # vLLM lists the sampled token (rank 5 here) beside the 2 best.
    entry = {9: Logprob(-3.0, 5, None), 1: Logprob(-0.5, 1, None), 4: Logprob(-1.5, 2, None)}
    got = _logprob(9, entry, 2)
    assert got.logprob == -3.0 and got.top == ((1, -0.5), (4, -1.5))
    assert _logprob(1, {1: Logprob(-0.5, 1, None)}, 0).top == ()
