"""Tool calls in a format any model can follow: the tools are described in the system text,
and the answer is sampled under a JSON schema that admits only calls to them, with their
arguments' own schemas (or, with tool_choice "auto", a reply instead), so even a small
model without a tool-aware template returns a valid call. Earlier calls and their results
go back into the conversation in the same JSON. This is llama.cpp's former "generic" tool
format; the server answers in OpenAI's shape (`tool_calls`, `finish_reason: "tool_calls"`).
"""

from __future__ import annotations

import json
from typing import Any

from edgeprefill.runtime.core.request import OutputFormat
from edgeprefill.runtime.server.schema import Message
from edgeprefill.runtime.server.tools import ToolUse, arguments, openai_call

CALLS, REPLY = "tool_calls", "response"


class JsonTools(ToolUse):
    """Calls as a JSON object, `{"tool_calls": [...]}` (or `{"response": ...}`)."""

    opening = ""  # the whole answer is the JSON

    @staticmethod
    def conversation(messages: list[Message], tool_use: ToolUse | None) -> list[dict[str, Any]]:
        """The messages as the chat template takes them ({role, content}): a developer message
        is a system one; an assistant's earlier calls and the tools' results are written in
        the JSON the model answers in (a tool result as a user turn, which every template
        knows); the tools' description joins the system text."""
        out: list[dict[str, Any]] = []
        for m in messages:
            text = m.text()
            if m.role == "tool":
                result = {"tool_call_id": m.tool_call_id, "content": text}
                out.append({"role": "user", "content": json.dumps({"tool_result": result})})
            elif m.role == "assistant" and m.tool_calls:
                calls = [
                    {"name": c.function.name, "arguments": arguments(c.function.arguments)}
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
        if isinstance(tool_use, JsonTools):
            system = [out.pop(0)["content"]] if out and out[0]["role"] == "system" else []
            text = "\n\n".join([*system, tool_use.instructions()])
            out.insert(0, {"role": "system", "content": text})
        return out

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
        return {
            "type": "array",
            "items": self.call_schema(),
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
        return None, [openai_call(c["name"], c["arguments"]) for c in parsed[CALLS]]


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
