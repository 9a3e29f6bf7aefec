"""vLLM's automatic prefix caching reports what it reused in the field llama.cpp's saved
prefixes use. In a module of its own: one vLLM engine per process."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs its CPU build)")

from edgeprefill.backends.vllm.backend import VllmBackend  # noqa: E402
from edgeprefill.runtime.core.request import Request  # noqa: E402
from tests.test_vllm import Recording, drain  # noqa: E402
from tests.vllm_model import tiny_settings, write_tiny_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_a_question_about_a_read_document_reuses_vllms_cached_blocks(tmp_path):
    folder = write_tiny_model(tmp_path / "model")
    settings = tiny_settings(folder, prefix_caching=True)
    with VllmBackend(settings) as be:
        tok = be.tokenizer
        document = tok.encode(
            "the house of the river by the garden " * 60, add_bos=True, special=True
        )
        document = document[:400]
        question = tok.encode(" which garden?", add_bos=False, special=False)
        doc = Request("doc", "background", 0.0, document, 4, ignore_eos=True)
        drain(be.engine(Recording(None)), [doc])
        ask = Request("ask", "foreground", 0.0, document + question, 4, ignore_eos=True)
        steps = drain(be.engine(Recording(None)), [ask])
        computed = sum(it.plan.prefill.get("ask", 0) for _, it in steps)
        assert ask.prefix_reused_tokens >= 384  # whole 16-token blocks of the document
        assert computed == ask.prompt_len - ask.prefix_reused_tokens
        assert ask.record()["prefilled_tokens"] == computed  # tokens reconcile
        be.prefix_cache.clear()  # a new run starts empty
        again = Request("again", "foreground", 0.0, document + question, 4, ignore_eos=True)
        drain(be.engine(Recording(None)), [again])
        assert again.prefix_reused_tokens == 0
