"""Tool calls through `serve` on the bundled model (no tool-aware template: the tools'
JSON format, sampled under their schemas) with the `openai` client: what an agent relies on
is a call to a tool it offered, with arguments that parse and fit that tool's schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server_helpers import KEY, serving

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture
def client(make_backend):
    from openai import OpenAI

    with serving(make_backend) as (base, _):
        yield OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


def test_an_answer_cut_short_keeps_the_calls_it_completed():
    from edgeprefill.runtime.server.json_tools import JsonTools
    from edgeprefill.runtime.server.schema import Tool

    tools = JsonTools((Tool.model_validate(WEATHER),), "required", parallel=True)
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    content, calls = tools.answer(f'{{"tool_calls": [{call}, {call}, {{"name": "get_w')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert tools.answer('{"tool_calls"') == ('{"tool_calls"', [])
    assert tools.answer('{"response": "It is sunny') == ('{"response": "It is sunny', [])
    assert tools.answer('{"response": "Sunny."}') == ("Sunny.", [])


def valid_call(call, names) -> dict:
    """A call to one of the tools `names`, whose arguments parse and fit its schema."""
    assert call.type == "function" and call.function.name in names and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def required_and_named_calls_are_valid(client) -> None:
    """With "required", valid calls to the tools offered; with one tool named and no
    parallel calls, one valid call to it."""
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=64
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        valid_call(call, {"get_weather", "get_time"})
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        parallel_tool_calls=False,
        max_tokens=64,
    )
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1
    valid_call(calls[0], {"get_time"})


def test_a_required_call_and_a_named_call_are_valid_calls(client):
    required_and_named_calls_are_valid(client)


def test_a_streamed_call_arrives_as_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=64,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_weather"])


def test_a_tool_result_goes_back_and_the_model_answers(client):
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=64
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."},
    ]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=96, temperature=0
    )
    message = reply.choices[0].message
    # "auto": a reply or another call, in either case well formed.
    assert isinstance(message.content, str) or message.tool_calls
    for again in message.tool_calls or []:
        valid_call(again, {"get_weather"})
