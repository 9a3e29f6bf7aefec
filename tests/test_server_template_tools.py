"""Tools in the model's own chat template's form: the bundled model's weights under a chat
template that describes the tools itself, in each form the server knows: Qwen 2.5's
(tests/data/qwen2.5_tools.jinja: calls between <tool_call> tags) and Llama 3.x's
(tests/data/llama3_tools.jinja, written after its form: a bare JSON call, results in an
ipython turn). The prompt is the template's rendering (tools, earlier calls and results
included); a required call is a valid call to an offered tool through the `openai`
client; an answer reads back as OpenAI calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_helpers import KEY, serving
from tests.test_server_tools import (
    ASK,
    TIME,
    WEATHER,
    required_and_named_calls_are_valid,
    valid_call,
)

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data"
# form: its template, what its rendering of CALLED (below) holds, and how it ends
FORMS = {
    "tagged": (
        "qwen2.5_tools.jinja",
        [
            f"<tools>\n{json.dumps(WEATHER)}\n</tools>",
            "<|im_start|>assistant\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
            "<tool_response>\nSunny, 21 C\n</tool_response>",
        ],
        "<|im_start|>assistant\n",
    ),
    "llama3": (
        "llama3_tools.jinja",
        [
            json.dumps(WEATHER),
            '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
            '"parameters": {"city": "Paris"}}<|eot_id|>',
            "<|start_header_id|>ipython<|end_header_id|>\n\nSunny, 21 C<|eot_id|>",
        ],
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALLED = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]


@pytest.fixture(scope="module", params=sorted(FORMS))
def form(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, form) -> Path:
    """The bundled GGUF with the form's chat template (gguf's own metadata tool)."""
    from edgeprefill.backends.bundled_model import default_model_path

    out = tmp_path_factory.mktemp(form) / f"{form}.gguf"
    script = "gguf.scripts.gguf_new_metadata"
    args = [sys.executable, "-m", script, "--chat-template-file", str(DATA / FORMS[form][0])]
    subprocess.run([*args, str(default_model_path()), str(out)], check=True, capture_output=True)
    return out


@pytest.fixture
def client(make_backend):
    from openai import OpenAI

    with serving(make_backend) as (base, _):
        yield OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


def _tools(form: str, *tools):
    from edgeprefill.runtime.server.app import TOOL_FORMS
    from edgeprefill.runtime.server.schema import Tool

    offered = tuple(Tool.model_validate(t) for t in tools)
    return TOOL_FORMS[form](offered, "auto", parallel=True)


def test_the_template_renders_the_tools_the_call_and_its_result(make_backend, form):
    from edgeprefill.runtime.api.chat_prompt import encode_chat
    from edgeprefill.runtime.server.schema import Message

    tok = make_backend().tokenizer
    assert tok.tool_calls_form() == form
    tools = _tools(form, WEATHER)
    messages = tools.conversation([Message.model_validate(m) for m in CALLED], None)
    text = tok.decode(encode_chat(tok, messages, tools=tools.template_tools()))
    _, parts, answer_starts = FORMS[form]
    for part in [ASK[0]["content"], *parts]:  # the user's words too: templates trim them
        assert part in text
    assert text.endswith(answer_starts)
    with pytest.raises(ValueError, match="chat template"):
        tok.render_chat([])  # the template reads messages[0]


def test_blocks_read_back_as_calls_and_the_rest_as_the_reply():
    tools = _tools("tagged", WEATHER, TIME)
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = tools.answer(f'Let me look.\n{block}\n{block}\n<tool_call>\n{{"na')
    assert content == "Let me look." and len(calls) == 2
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert tools.answer("It is sunny.") == ("It is sunny.", [])
    assert tools.answer("<tool_call>\nnot json\n</tool_call>")[1] == []


def test_a_llama3_call_reads_back_as_a_call_and_anything_else_as_the_reply():
    tools = _tools("llama3", WEATHER, TIME)
    content, calls = tools.answer('{"name": "get_time", "parameters": {"timezone": "UTC"}}')
    assert content is None and len(calls) == 1 and calls[0]["function"]["name"] == "get_time"
    assert json.loads(calls[0]["function"]["arguments"]) == {"timezone": "UTC"}
    assert tools.answer("It is sunny.") == ("It is sunny.", [])
    assert tools.answer('{"name": "get_time", "param') == ('{"name": "get_time", "param', [])
    later = 'It is {"name": "get_time", "parameters": {}}'  # the grammar checked no call here
    assert tools.answer(later) == (later, [])


@pytest.mark.parametrize(
    ("form", "pieces", "sent", "n_calls"),
    [
        (
            "tagged",
            ["Let me ", "look.\n<tool", "_call>\n", CALL, "\n</tool_call>"],
            ["Let me ", "look.\n", "", "", ""],
            1,
        ),
        ("tagged", ["It is <tool", " sunny"], ["It is ", "<tool sunny"], 0),
        ("llama3", ['{"name": "get_time", ', '"parameters": {}}'], ["", ""], 1),
        ("llama3", ["It is ", '{"name": "get_time", "parameters": {}}'], None, 0),
    ],
)
def test_a_reply_streams_as_it_comes_and_a_call_is_held_to_its_end(form, pieces, sent, n_calls):
    """In Llama 3.x's form a call opens the answer: one later in a reply is its text."""
    from edgeprefill.runtime.server.tools import CallReader

    reader = CallReader(_tools(form, WEATHER, TIME))
    assert [reader.feed(p) for p in pieces] == (sent or pieces)
    rest, calls = reader.end()
    assert rest == "" and len(calls) == n_calls


def test_a_required_a_named_and_a_streamed_call_in_the_templates_form(client):
    required_and_named_calls_are_valid(client)
    chunks = client.chat.completions.create(
        model="tiny",
        messages=CALLED + [{"role": "user", "content": "And in Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        stream=True,
    )
    deltas = [c.choices[0] for c in chunks if c.choices]
    calls = [t for d in deltas if d.delta.tool_calls for t in d.delta.tool_calls]
    assert len(calls) == 1 and deltas[-1].finish_reason == "tool_calls"
    valid_call(calls[0], {"get_weather"})


def test_with_auto_the_answer_is_a_reply_or_a_valid_call_and_a_reply_streams(client, form):
    opening = _tools(form, WEATHER).opening
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=24
    )
    message = reply.choices[0].message
    assert message.content or message.tool_calls
    assert not (message.content or "").startswith(opening)
    for call in message.tool_calls or []:
        valid_call(call, {"get_weather"})
    if message.tool_calls:
        return
    chunks = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=24, stream=True
    )
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1  # as it is sampled, not held to the end
    assert not "".join(texts).startswith(opening)
