"""Tools in the model's own chat template's form: the bundled model's weights under Qwen
2.5's chat template (tests/data/qwen2.5_tools.jinja), which describes the tools itself and
reads calls between <tool_call> tags. The prompt is the template's rendering (tools,
earlier calls and results included); a required call is a valid call to an offered tool
through the `openai` client; an answer's blocks read back as OpenAI calls."""

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

TEMPLATE = Path(__file__).parent / "data" / "qwen2.5_tools.jinja"
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


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    """The bundled GGUF with a chat template that knows tools (gguf's own metadata tool)."""
    from edgeprefill.backends.bundled_model import default_model_path

    out = tmp_path_factory.mktemp("tagged") / "tagged.gguf"
    script = "gguf.scripts.gguf_new_metadata"
    args = [sys.executable, "-m", script, "--chat-template-file", str(TEMPLATE)]
    subprocess.run([*args, str(default_model_path()), str(out)], check=True, capture_output=True)
    return out


@pytest.fixture
def client(make_backend):
    from openai import OpenAI

    with serving(make_backend) as (base, _):
        yield OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


def _tools(*tools):
    from edgeprefill.runtime.server.schema import Tool
    from edgeprefill.runtime.server.tagged_tools import TaggedTools

    return TaggedTools(tuple(Tool.model_validate(t) for t in tools), "auto", parallel=True)


def test_the_template_renders_the_tools_the_call_and_its_result(make_backend):
    from edgeprefill.runtime.api.chat_prompt import encode_chat
    from edgeprefill.runtime.server.schema import Message
    from edgeprefill.runtime.server.tagged_tools import TaggedTools

    tok = make_backend().tokenizer
    assert tok.tagged_tool_calls()
    messages = TaggedTools.conversation([Message.model_validate(m) for m in CALLED], None)
    tools = _tools(WEATHER).template_tools()
    text = tok.decode(encode_chat(tok, messages, tools=tools))
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="chat template"):
        tok.render_chat([])  # the template reads messages[0]


def test_blocks_read_back_as_calls_and_the_rest_as_the_reply():
    tools = _tools(WEATHER, TIME)
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = tools.answer(f'Let me look.\n{block}\n{block}\n<tool_call>\n{{"na')
    assert content == "Let me look." and len(calls) == 2
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert tools.answer("It is sunny.") == ("It is sunny.", [])
    assert tools.answer("<tool_call>\nnot json\n</tool_call>")[1] == []


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


def test_with_auto_the_answer_is_a_reply_or_a_valid_call_and_a_reply_streams(client):
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=24
    )
    message = reply.choices[0].message
    assert message.content or message.tool_calls
    assert not (message.content or "").lstrip().startswith("<tool_call>")
    for call in message.tool_calls or []:
        valid_call(call, {"get_weather"})
    if message.tool_calls:
        return
    chunks = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=24, stream=True
    )
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1  # as it is sampled, not held to the end
    assert not "".join(texts).lstrip().startswith("<tool_call>")
