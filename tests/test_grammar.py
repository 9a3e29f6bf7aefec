"""Output formats as grammars: a schema's cost is bounded before its grammar is built, and
strings cannot hold raw control characters (JSON parsers refuse them)."""

from __future__ import annotations

import json

import pytest

from edgeprefill.backends.llamacpp.grammar import output_grammar
from edgeprefill.runtime.core.request import OutputFormat


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 10**9},
        {"type": "array", "items": {"type": "string"}, "minItems": 10**6},
        {"type": "string", "pattern": "^(ab{60000}){60000}$"},
        {"anyOf": [{"type": "string", "maxLength": 9_000}] * 20},  # each small, many
    ],
)
def test_a_schema_that_would_cost_the_server_gigabytes_is_refused_first(schema):
    with pytest.raises(ValueError, match="add up to more than"):
        output_grammar(OutputFormat(json.dumps(schema)))


def test_any_object_keeps_control_characters_out_of_strings():
    grammar = output_grammar(OutputFormat())
    (char,) = [line for line in grammar.splitlines() if line.startswith("char ::=")]
    assert "\\x00-\\x1F" in char


def test_a_remote_reference_is_not_fetched():
    schema = {"$ref": "https://example.com/schema.json"}
    with pytest.raises(ValueError, match="cannot be enforced"):
        output_grammar(OutputFormat(json.dumps(schema)))


@pytest.mark.slow
def test_a_greedy_answer_under_a_grammar_is_the_one_the_whole_vocabularys_pass_gives(
    make_backend, monkeypatch
):
    """Where the grammar rejects the likeliest token, a greedy sampler checks the next
    likeliest in order instead of filtering the 262k-token vocabulary: the same tokens,
    with a bias and a penalty in the chain too."""
    from edgeprefill.backends.llamacpp import native
    from edgeprefill.runtime import Runtime
    from edgeprefill.runtime.core.request import SamplingParams

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    fmt = OutputFormat(json.dumps(schema))
    be = make_backend(n_seq_max=2)
    prompt = be.tokenizer.encode("Ada, 36, as JSON:", add_bos=True, special=False)
    samplings = [
        SamplingParams(output_format=fmt),
        SamplingParams(output_format=fmt, logit_bias=((236782, -5.0),), frequency_penalty=0.5),
    ]
    found = []
    likeliest = native._GrammarCheck._likeliest_allowed

    def counted(self):
        found.append(likeliest(self))
        return found[-1]

    def answers() -> list[list[int]]:
        with Runtime(be, "static:64") as rt:
            handles = [rt.submit(prompt, max_tokens=40, sampling=s) for s in samplings]
            return [h.result(timeout=300).output for h in handles]

    monkeypatch.setattr(native._GrammarCheck, "_likeliest_allowed", counted)
    fast = answers()
    assert any(t is not None for t in found)  # the block search answered
    monkeypatch.setattr(native._GrammarCheck, "_likeliest_allowed", lambda self: None)
    assert answers() == fast
    for output in fast:
        json.loads(be.tokenizer.decode(output))  # within 40 tokens, the grammar ended it


@pytest.mark.slow
def test_the_first_characters_leave_exactly_the_tokens_the_whole_vocabularys_pass_leaves(
    make_backend,
):
    """At each state of a walk through a JSON schema's grammar (the opening brace, keys'
    names, strings, an array, the end), the tokens checked after their first characters
    are allowed are exactly the tokens the grammar allows of the whole vocabulary."""
    import ctypes

    import llama_cpp as lc
    import numpy as np

    from edgeprefill.backends.llamacpp.first_chars import FirstChars
    from edgeprefill.backends.llamacpp.native import _TOKEN_DATA, _GrammarCheck

    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 6},
            "tags": {"type": "array", "items": {"enum": ["ñandú", "b"]}, "maxItems": 2},
        },
        "required": ["title", "tags"],
        "additionalProperties": False,
    }
    vocab = make_backend().model.vocab
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    grammar = output_grammar(OutputFormat(json.dumps(schema)))
    check = _GrammarCheck(vocab, n_vocab, grammar, True, FirstChars(vocab, n_vocab))
    rng = np.random.default_rng(0)

    def allowed(filtered: bool) -> np.ndarray:
        data = np.zeros(n_vocab, _TOKEN_DATA)
        data["id"], data["logit"] = np.arange(n_vocab), 1.0
        array = _GrammarCheck._array(data)
        if filtered:
            check._filter(data, array)
        else:
            lc.llama_sampler_apply(check.ptr, ctypes.byref(array))
        return np.isfinite(data["logit"])

    try:
        for _ in range(40):
            whole = allowed(filtered=False)
            assert np.array_equal(allowed(filtered=True), whole)
            if not whole.any() or lc.llama_vocab_is_eog(vocab, int(np.flatnonzero(whole)[0])):
                break
            lc.llama_sampler_accept(check.ptr, int(rng.choice(np.flatnonzero(whole))))
    finally:
        check.close()
