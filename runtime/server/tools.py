"""Tool calls in a format any model can follow: the tools are described in the system text,
and the answer is sampled under a JSON schema that admits only calls to them, with their
arguments' own schemas (or, with tool_choice "auto", a reply instead), so even a small
model without a tool-aware template returns a valid call. Earlier calls and their results
go back into the conversation in the same JSON. This is llama.cpp's former "generic" tool
format; the server answers in OpenAI's shape (`tool_calls`, `finish_reason: "tool_calls"`).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from edgeprefill.runtime.core.request import OutputFormat
from edgeprefill.runtime.server.schema import ChatRequest, Message, NamedTool, Tool

CALLS, REPLY = "tool_calls", "response"


@dataclass(frozen=True)
class ToolUse:
    """The tools a chat may call, and how: "auto" (a call or a reply), "required" (at
    least one call) or one named function; one call an answer unless `parallel`."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool

    @classmethod
    def of(cls, body: ChatRequest) -> ToolUse | None:
        if not body.calls_tools:
            return None
        assert body.tools is not None
        choice = body.tool_choice or "auto"
        if isinstance(choice, NamedTool):
            named = choice.function.name
            tools = tuple(t for t in body.tools if t.function.name == named)
            return cls(tools, "required", body.parallel_tool_calls)
        return cls(tuple(body.tools), choice, body.parallel_tool_calls)

    def output_format(self) -> OutputFormat:
        calls = {
            "type": "object",
            "properties": {CALLS: self._calls()},
            "required": [CALLS],
            "additionalProperties": False,
        }
        if self.choice == "required":
            return OutputFormat(json.dumps(calls, sort_keys=True))
        reply = {
            "type": "object",
            "properties": {REPLY: {"type": "string"}},
            "required": [REPLY],
            "additionalProperties": False,
        }
        return OutputFormat(json.dumps({"anyOf": [calls, reply]}, sort_keys=True))

    def _calls(self) -> dict[str, Any]:
        one_of_them = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": t.function.parameters,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        item = one_of_them[0] if len(one_of_them) == 1 else {"anyOf": one_of_them}
        return {
            "type": "array",
            "items": item,
            "minItems": 1,
            **({} if self.parallel else {"maxItems": 1}),
        }

    def instructions(self) -> str:
        """What the system text adds: the tools, and the JSON an answer is."""
        listed = "\n".join(
            json.dumps(
                {
                    "name": t.function.name,
                    "description": t.function.description,
                    "parameters": t.function.parameters,
                }
            )
            for t in self.tools
        )
        call = f'{{"{CALLS}": [{{"name": "<tool name>", "arguments": {{<its arguments>}}}}]}}'
        how = f"To call a tool, answer with only this JSON: {call}."
        if self.choice != "required":
            how += f' To answer the user yourself, answer with only {{"{REPLY}": "<your answer>"}}.'
        return f"You can call these tools:\n{listed}\n\n{how}"

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer's reply text and its calls, in OpenAI's form. An answer cut by
        max_tokens keeps the calls it completed (a small model asked for parallel calls
        can go on calling until its tokens run out); a cut reply is the text as it stands."""
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            parsed = {CALLS: _complete_calls(text)}
            if not parsed[CALLS]:
                return text, []
        if REPLY in parsed:
            return str(parsed[REPLY]), []
        calls = [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for c in parsed[CALLS]
        ]
        return None, calls


def _complete_calls(text: str) -> list[dict[str, Any]]:
    """The calls an answer cut short had written whole: it followed the grammar, so it is
    `{"tool_calls": [` then call objects separated by commas."""
    if not text.startswith("{") or not text[1:].lstrip().startswith(f'"{CALLS}"'):
        return []
    pos, decoder = text.find("[") + 1, json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    if pos == 0:
        return []
    while True:
        while pos < len(text) and text[pos] in " ,":
            pos += 1
        try:
            call, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return calls
        calls.append(call)


def conversation(messages: list[Message], tool_use: ToolUse | None) -> list[dict[str, str]]:
    """The messages as the chat template takes them ({role, content}): a developer message
    is a system one; an assistant's earlier calls and the tools' results are written in
    the JSON the model answers in (a tool result as a user turn, which every template
    knows); the tools' description joins the system text."""
    out: list[dict[str, str]] = []
    for m in messages:
        text = m.text()
        if m.role == "tool":
            result = {"tool_call_id": m.tool_call_id, "content": text}
            out.append({"role": "user", "content": json.dumps({"tool_result": result})})
        elif m.role == "assistant" and m.tool_calls:
            calls = [
                {"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                for c in m.tool_calls
            ]
            out.append(
                {
                    "role": "assistant",
                    "content": (text + "\n" if text else "") + json.dumps({CALLS: calls}),
                }
            )
        else:
            out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    if tool_use is not None:
        if out and out[0]["role"] == "system":
            out[0] = {
                "role": "system",
                "content": out[0]["content"] + "\n\n" + tool_use.instructions(),
            }
        else:
            out.insert(0, {"role": "system", "content": tool_use.instructions()})
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
