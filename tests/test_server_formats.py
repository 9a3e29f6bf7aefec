"""What assistants' clients ask of a chat beyond text, through `serve` on the real model
with the `openai` client: JSON that fits a schema (strict or not) and any JSON object,
enforced while sampling, streamed too; logit_bias, penalties, top-k and min-p that change
the answer; log-probabilities; fields this server does not honour yet refused with a 400 that names them; and
an answer in the bundled model's plain transcript that ends with its turn. Tools: see
test_server_tools.py."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from tests.server_helpers import KEY, serving

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person called Ada as JSON."}]


@pytest.fixture
def server(make_backend):
    """The `openai` client of a real `serve`, and its runtime (for its tokenizer)."""
    from openai import OpenAI

    with serving(make_backend) as (base, runtime):
        yield OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0), runtime


def _chat(client, **kw):
    return client.chat.completions.create(
        model="tiny", messages=kw.pop("messages", ASK), max_tokens=kw.pop("max_tokens", 96), **kw
    )


def test_json_schema_answers_parse_and_fit_the_schema_streamed_or_not(server):
    client, _ = server
    for strict in (True, False):
        schema = {"name": "person", "schema": PERSON, "strict": strict}
        fmt = {"type": "json_schema", "json_schema": schema}
        reply = _chat(client, response_format=fmt, temperature=0.7, seed=1)
        assert reply.choices[0].finish_reason == "stop"  # the grammar ended it
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    stream = _chat(client, response_format=fmt, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    reply = _chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_logit_bias_and_penalties_change_the_greedy_answer(server):
    client, runtime = server
    plain = _chat(client, temperature=0, max_tokens=16).choices[0].message.content
    first = runtime.backend.tokenizer.encode(plain, add_bos=False, special=False)[0]
    biased = _chat(client, temperature=0, max_tokens=16, logit_bias={str(first): -100})
    assert not biased.choices[0].message.content.startswith(plain[:4])
    # A prompt the model goes on repeating: a penalty makes it write something else (the
    # presence penalty's fixed 2 does not outweigh " one" here; it shares their sampler).
    loop = {"model": "tiny", "prompt": "one, one, one, one, one, one,", "max_tokens": 24}
    repeated = client.completions.create(**loop, temperature=0).choices[0].text
    assert repeated.count("one") >= 8
    text = client.completions.create(**loop, temperature=0, frequency_penalty=2.0)
    assert text.choices[0].text.count("one") < 8
    text = client.completions.create(**loop, temperature=0, extra_body={"repeat_penalty": 5.0})
    assert text.choices[0].text.count("one") < 8
    for extra in ({"top_k": 1}, {"min_p": 1.0}):  # greedy in effect: the same answer
        same = _chat(client, temperature=0.8, seed=3, max_tokens=16, extra_body=extra)
        assert same.choices[0].message.content == plain, extra


def test_logprobs_are_the_sampled_tokens_own_with_the_likeliest_streamed_or_not(server):
    client, _ = server
    reply = _chat(client, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(e.token for e in content).startswith(reply.choices[0].message.content)
    for e in content:
        top = [t.logprob for t in e.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and sum(map(math.exp, top)) <= 1
        # Greedy: the token sampled is the likeliest.
        assert e.top_logprobs[0].token == e.token and e.logprob == top[0] < 0
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    stream = _chat(client, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3, stream=True)
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert _chat(client, temperature=0, max_tokens=2).choices[0].logprobs is None  # not asked
    done = client.completions.create(
        model="tiny", prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    ).choices[0]
    lp = done.logprobs
    assert "".join(lp.tokens).startswith(done.text) and len(lp.token_logprobs) == len(lp.tokens)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(
        len(alts) <= 2 and max(alts.values()) == p
        for alts, p in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )


REFUSED = [
    ({"top_logprobs": 2}, None),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "tools": [{"type": "function", "function": {"name": "f"}}]}, None),
    ({"functions": [{"name": "f"}]}, None),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}}}, None),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
]


def test_what_this_server_cannot_honour_is_refused_by_name(server):
    from openai import BadRequestError

    client, _ = server
    for extra, param in REFUSED:
        with pytest.raises(BadRequestError) as e:
            _chat(client, max_tokens=4, extra_body=extra)
        error = e.value.body
        assert error["message"] and (param is None or error["param"] == param), (extra, error)


def test_a_plain_transcript_answer_ends_with_its_turn(server):
    """The bundled model has no chat template: its answer would go on into invented
    "User:" lines; it stops where the next turn would begin."""
    client, _ = server
    hi = [{"role": "user", "content": "Hi, how are you today?"}]
    reply = _chat(client, temperature=0, max_tokens=200, messages=hi)
    assert "\nUser:" not in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    # `ignore_eos` runs past it, as past a template's end-of-turn token (greedy, this
    # answer writes the marker within its first tokens).
    beyond = _chat(
        client, temperature=0, max_tokens=40, messages=hi, extra_body={"ignore_eos": True}
    )
    assert "\nUser:" in beyond.choices[0].message.content
    assert beyond.choices[0].finish_reason == "length" and beyond.usage.completion_tokens == 40
