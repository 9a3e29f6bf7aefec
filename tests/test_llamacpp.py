"""The llama.cpp backend on the real bundled model."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from edgeprefill.backends.llamacpp.native import cpu_has_amx
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.request import Request, Status
from edgeprefill.runtime.policies import StaticPolicy, UnlimitedPolicy
from edgeprefill.runtime.traffic.prompts import PromptBuilder
from edgeprefill.runtime.traffic.workload import Range, SyntheticPrompt, TextPrompt
from tests.helpers import drain

pytestmark = pytest.mark.slow


def text_prompt(tokenizer, n: int, seed: int, **kw) -> list[int]:
    spec = TextPrompt(source="text", tokens=Range(min=n, max=n), **kw)
    return PromptBuilder(tokenizer).build(spec, n, np.random.default_rng(seed))


def high_level_greedy(model_path, prompt: list[int], max_tokens: int, monkeypatch) -> list[int]:
    """llama-cpp-python's own single-sequence `Llama`, greedy."""
    params = llama_cpp.llama_cpp.llama_model_default_params

    def no_amx_repack():  # the same AMX workaround as our backend (see native.LlamaModel)
        p = params()
        p.use_extra_bufts = not cpu_has_amx()
        return p

    with monkeypatch.context() as m:
        m.setattr(llama_cpp.llama_cpp, "llama_model_default_params", no_amx_repack)
        llm = llama_cpp.Llama(str(model_path), n_ctx=2048, n_batch=512, n_threads=2, verbose=False)
    out: list[int] = []
    try:
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(token)
            if llm.token_eos() == token or llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
                break
            if len(out) == max_tokens:
                break
    finally:
        llm.close()
    return out


def test_greedy_output_equals_high_level_llama(make_backend, model_path, monkeypatch):
    be = make_backend()
    prompts = [
        text_prompt(be.tokenizer, 120, seed=1, system="You are a helpful assistant."),
        text_prompt(be.tokenizer, 300, seed=2, instruction="Summarize the text above."),
        be.tokenizer.encode("The capital of France is", add_bos=True, special=True),
    ]
    for i, prompt in enumerate(prompts):
        req = Request(f"r{i}", "foreground", 0.0, prompt, max_tokens=24)
        drain(Engine(be, StaticPolicy(64)), [req])
        expected = high_level_greedy(model_path, prompt, 24, monkeypatch)
        assert req.output == expected, f"prompt {i} diverged"
        assert req.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "budget", ["min_chunk", 64, 512, None], ids=["min_chunk", "64", "512", "unlimited"]
)
def test_sequences_decoded_together_equal_each_decoded_alone(make_backend, budget):
    be = make_backend(n_seq_max=4, n_batch=1024)  # the four prompts need more than one batch
    if budget == "min_chunk":  # the smallest budget that keeps pieces exact on this CPU
        budget = be.capacity.min_chunk
    tok = be.tokenizer

    def requests():
        specs = [
            ("chat0", "foreground", 150),
            ("chat1", "foreground", 90),
            ("doc0", "background", 700),
            ("doc1", "background", 500),
        ]
        return [
            Request(rid, cls, 0.0, text_prompt(tok, n, seed=i), max_tokens=20, ignore_eos=True)
            for i, (rid, cls, n) in enumerate(specs)
        ]

    alone = {}
    for req in requests():
        drain(Engine(be, UnlimitedPolicy()), [req])
        alone[req.id] = req.output
    together = requests()
    policy = UnlimitedPolicy() if budget is None else StaticPolicy(budget)
    iterations = drain(Engine(be, policy), together)
    assert max(it.plan.n_decode for it in iterations) >= 2  # really decoded together
    assert any(it.plan.n_decode and it.plan.n_prefill for it in iterations)  # and mixed
    for req in together:
        assert req.output == alone[req.id], f"{req.id} changed when batched (budget {budget})"
        assert len(req.output) == 20


def test_kv_cells_are_released_after_more_requests_than_sequences(make_backend):
    be = make_backend(n_seq_max=2)
    tok = be.tokenizer
    reqs = [
        Request(
            f"r{i}",
            "foreground" if i % 2 else "background",
            0.0,
            text_prompt(tok, 60 + 10 * i, seed=i),
            max_tokens=4 + i,
        )
        for i in range(5)
    ]
    engine = Engine(be, StaticPolicy(64))
    seen_seqs = set()
    for r in reqs:
        engine.add(r)
    while engine.has_work:
        it = engine.iterate()
        assert it is not None
        seen_seqs |= {r.seq_id for r in engine.scheduler.running}
        parked = engine.scheduler.parked
        for seq in range(2):  # cells are held by running sequences that computed some, or
            held = be.seq_pos_max(seq) >= 0  # by parked ones, for a prompt that continues them
            computed = [r for r in engine.scheduler.running if r.seq_id == seq and r.num_computed]
            assert held == bool(computed) or seq in parked
    assert all(r.status is Status.FINISHED for r in reqs)
    assert seen_seqs == {0, 1}
    assert len(parked) == 2 and engine.scheduler.kv_free == be.capacity.n_ctx
    assert be._samplers == {}  # each request's own, freed when it ended
    while parked:  # released when another request needs them
        parked.evict()
    assert [be.seq_pos_max(s) for s in range(2)] == [-1, -1]


def test_a_prompt_that_never_fits_fails_and_the_rest_complete(make_backend):
    be = make_backend(n_ctx=256, n_seq_max=2)
    tok = be.tokenizer
    big = Request("big", "background", 0.0, text_prompt(tok, 300, seed=1), max_tokens=8)
    small = Request("small", "foreground", 0.0, text_prompt(tok, 50, seed=2), max_tokens=8)
    drain(Engine(be, StaticPolicy(64)), [big, small])
    assert big.status is Status.FAILED
    assert big.error.startswith("prompt of 300 tokens plus 8 output tokens needs 307 KV cells")
    assert small.status is Status.FINISHED and len(small.output) >= 1


def test_prompts_have_exact_lengths_and_are_deterministic(make_backend):
    be = make_backend()
    tok = be.tokenizer
    bos = tok.encode("", add_bos=True, special=True)
    for n in (40, 333, 2500):
        a = text_prompt(tok, n, seed=5, system="Be brief.", instruction="Summarize.")
        assert len(a) == n and a[: len(bos)] == bos
        assert a == text_prompt(tok, n, seed=5, system="Be brief.", instruction="Summarize.")
        assert a != text_prompt(tok, n, seed=6, system="Be brief.", instruction="Summarize.")
    synth = PromptBuilder(tok).build(
        SyntheticPrompt(source="synthetic", tokens=Range(min=500, max=500)),
        500,
        np.random.default_rng(0),
    )
    assert len(synth) == 500 and synth[0] == bos[0]
    assert all(tok.is_normal(t) for t in synth[1:])
    # real prose: the text decodes back to words, not byte soup
    words = tok.decode(a).split()
    assert len(words) > 1000 and sum(w.isalpha() for w in words) / len(words) > 0.8


def test_sampling_with_temperature_is_seeded(make_backend):
    be = make_backend()
    prompt = text_prompt(be.tokenizer, 80, seed=3)
    from edgeprefill.runtime.core.request import SamplingParams

    def sample(seed):
        r = Request(
            "s",
            "foreground",
            0.0,
            prompt,
            max_tokens=16,
            ignore_eos=True,
            sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=seed),
        )
        drain(Engine(be, StaticPolicy(64)), [r])
        return r.output

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_greedy_and_seeded_requests_decoding_together_each_get_their_own_row(make_backend):
    """Greedy rows are read from llama.cpp's outputs together, a seeded one by its sampler:
    beside each other (one decode group) each gets the tokens it gets alone."""
    from edgeprefill.runtime.core.request import SamplingParams

    be = make_backend()
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7)

    def requests():
        return [
            Request(
                name,
                "foreground",
                0.0,
                text_prompt(be.tokenizer, n, seed=n),
                16,
                ignore_eos=True,
                sampling=sampling,
            )
            for name, n, sampling in (
                ("g1", 60, SamplingParams()),
                ("s", 70, seeded),
                ("g2", 80, SamplingParams()),
            )
        ]

    together = requests()
    drain(Engine(be, StaticPolicy(256)), together)
    for r in requests():
        drain(Engine(be, StaticPolicy(256)), [r])
        assert r.output == next(t.output for t in together if t.id == r.id), r.id
    assert together[0].output != together[2].output


def test_eight_sequences_decoding_at_once_equal_each_alone(make_backend):
    be = make_backend(n_seq_max=8, n_ctx=512)
    tok = be.tokenizer

    def requests():
        return [
            Request(
                f"r{i}",
                "foreground",
                0.0,
                text_prompt(tok, 40 + 7 * i, seed=50 + i),
                max_tokens=12,
                ignore_eos=True,
            )
            for i in range(8)
        ]

    alone = {}
    for req in requests():
        drain(Engine(be, UnlimitedPolicy()), [req])
        alone[req.id] = req.output
    together = requests()
    iterations = drain(Engine(be, UnlimitedPolicy()), together)
    assert max(it.plan.n_decode for it in iterations) == 8
    assert {r.id: r.output for r in together} == alone


def test_arrival_traces_are_byte_identical_across_backends(make_backend):
    from edgeprefill.backends.sim import SimTokenizer
    from edgeprefill.runtime.traffic.build import build_requests, format_trace
    from edgeprefill.runtime.traffic.workload import load_workload

    root = Path(__file__).parents[1] / "workloads"
    be = make_backend()
    for name in ("assistant_plus_indexer", "many_users_sim", "ppas_bursty"):
        wl = load_workload(root / f"{name}.yaml")
        real = format_trace(build_requests(wl, be.tokenizer))
        assert real == format_trace(build_requests(wl, SimTokenizer())), name


def test_the_probe_is_measured_once_then_read_from_the_cache(make_backend, tmp_path):
    first = make_backend(probe_cache=tmp_path)
    assert first.probe.source == "measured" and first.probe.path.parent.parent == tmp_path
    again = make_backend(probe_cache=tmp_path)
    assert again.probe.source == "cache" and again.describe()["probe"]["source"] == "cache"
    assert [f.to_dict() for f in again.probe.facts] == [f.to_dict() for f in first.probe.facts]
    assert again.settings == first.settings


def test_end_of_generation_tokens_are_the_ones_llama_cpp_names(make_backend):
    """The tokenizer reads the set once at load (asking per sampled token cost a ctypes
    call between two device calls); a request stops at exactly these tokens."""
    be = make_backend()
    vocab, tok = be.model.vocab, be.tokenizer
    named = {t for t in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    assert llama_cpp.llama_vocab_eos(vocab) in named
    assert {t for t in range(tok.vocab_size) if tok.is_eog(t)} == named


def test_the_tokenizer_refuses_to_work_after_its_backend_is_closed(make_backend):
    be = make_backend()
    tok = be.tokenizer
    assert tok.encode("Hello", add_bos=True, special=True)
    be.close()
    for use in (
        lambda: tok.encode("Hello", add_bos=True, special=True),
        lambda: tok.decode([100]),
        lambda: tok.is_eog(1),
        lambda: tok.chat_parts(None),
    ):
        with pytest.raises(RuntimeError, match="closed with its backend"):
            use()


def test_errors_raised_to_python_callers_name_parameters_not_flags(model_path):
    from edgeprefill.backends.llamacpp import LlamaCppConfig
    from edgeprefill.runtime.core.errors import UserError
    from edgeprefill.runtime.policies import parse_policy

    for make, fragment in (
        (lambda: LlamaCppConfig(model=model_path, n_ctx=0), "`n_ctx` must be at least 1"),
        (lambda: LlamaCppConfig(model=model_path, n_ubatch=4096), "`n_ubatch` must be between"),
        (lambda: parse_policy("static:0"), "`policy` 'static:0': tokens must be at least 1"),
    ):
        with pytest.raises(UserError) as err:
            make()
        assert fragment in str(err.value) and "--" not in str(err.value)


def test_batch_fills_what_llama_decode_reads_and_refuses_an_overflow():
    """The batch arrays llama.cpp reads: each slice's tokens, positions and sequence, logits
    only where a token is sampled; a batch over its size is refused before llama.cpp would
    abort the process."""
    from edgeprefill.backends.llamacpp.native import LlamaBatch
    from edgeprefill.runtime.core.contract import SeqWork
    from edgeprefill.runtime.core.request import SamplingParams

    batch = LlamaBatch(8)
    greedy = SamplingParams()
    work = [
        SeqWork(2, [7], 40, greedy),
        SeqWork(0, [1, 2, 3], 0, None),
        SeqWork(1, [4, 5], 9, greedy),
    ]
    assert batch.fill(work) == [(2, 0), (1, 5)]
    n = batch.n_filled
    assert n == 6
    assert list(batch.token[:n]) == [7, 1, 2, 3, 4, 5]
    assert list(batch.pos[:n]) == [40, 0, 1, 2, 9, 10]
    assert list(batch.seq[:n]) == [2, 0, 0, 0, 1, 1]
    assert list(batch.logits[:n]) == [1, 0, 0, 0, 0, 1]
    view = batch.view(1, 3)
    assert view.n_tokens == 3 and view.token[0] == 1 and view.seq_id[2][0] == 0
    with pytest.raises(ValueError, match="more than 8 tokens"):
        batch.fill([SeqWork(0, list(range(5)), 0, None), SeqWork(1, list(range(4)), 0, greedy)])
