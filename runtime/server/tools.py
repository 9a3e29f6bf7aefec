"""How a chat calls tools: the tools offered, the client's choice among them, and what
each form of calls shares. Three forms: `json_tools` (a JSON object any model can be held
to, the tools described in the system text), and where the model's own template knows
tools, its form: `tagged_tools` (Hermes, Qwen) or `llama3_tools` (Llama 3.x). The server
answers in OpenAI's shape in each: `tool_calls`, `finish_reason: "tool_calls"`."""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from edgeprefill.runtime.core.request import OutputFormat
from edgeprefill.runtime.server.schema import ChatRequest, Message, NamedTool, Tool


@dataclass(frozen=True)
class ToolUse(ABC):
    """The tools a chat may call, and how: "auto" (a call or a reply), "required" (at
    least one call) or one named function; one call an answer unless `parallel`."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool
    # The text at which an answer's calls begin: a reply before it streams as it comes.
    opening: ClassVar[str]
    # Calls open the answer or are not in it (the form's grammar holds them to its start):
    # an opening later in a reply is the reply's text.
    calls_first: ClassVar[bool] = False
    # What a call names its arguments in this form's JSON.
    arguments_key: ClassVar[str] = "arguments"

    @classmethod
    def of(cls, body: ChatRequest) -> Self | None:
        if not body.calls_tools:
            return None
        assert body.tools is not None
        choice = body.tool_choice or "auto"
        if isinstance(choice, NamedTool):
            named = choice.function.name
            tools = tuple(t for t in body.tools if t.function.name == named)
            return cls(tools, "required", body.parallel_tool_calls)
        return cls(tuple(body.tools), choice, body.parallel_tool_calls)

    def call_schema(self) -> dict[str, Any]:
        """The JSON Schema of one call to any of the tools: its name and its arguments."""
        schemas = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    self.arguments_key: t.function.parameters,
                },
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}

    @staticmethod
    @abstractmethod
    def conversation(messages: list[Message], tool_use: ToolUse | None) -> list[dict[str, Any]]:
        """The messages as the chat template takes them, earlier calls and tools' results
        in this form (`tool_use` None: the chat offers no tools now)."""

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template's `tools` variable, where it describes them."""
        return None

    @abstractmethod
    def output_format(self) -> OutputFormat:
        """What the answer is held to while it is sampled."""

    @abstractmethod
    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole answer's reply text and its calls, in OpenAI's form."""


class TemplateTools(ToolUse):
    """A form the model's own chat template renders: the tools as its `tools` variable,
    the conversation in OpenAI's shape."""

    @staticmethod
    def conversation(messages: list[Message], tool_use: ToolUse | None) -> list[dict[str, Any]]:
        """The messages in OpenAI's shape, as tool-aware templates take them (as
        transformers and vLLM pass them): a call's arguments as an object, not JSON text."""
        out: list[dict[str, Any]] = []
        for m in messages:
            message: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
            }
            if m.role == "tool":
                message["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": arguments(c.function.arguments),
                        },
                    }
                    for c in m.tool_calls
                ]
            out.append(message)
        return out

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools]


class CallReader:
    """Reads an answer piece by piece for the tools' calls: the text before the form opens
    a call streams as it comes; from there the answer is held and read whole at its end (a
    call's arguments are known valid only once it has ended)."""

    def __init__(self, tools: ToolUse) -> None:
        self.tools = tools
        self._held = ""
        self._opened = False  # a call opened: the rest is held
        self._replying = False  # a form whose calls open the answer: this one did not

    def feed(self, text: str) -> str:
        """The next piece of the answer; returns what of it may stream now."""
        self._held += text
        if self._opened:
            return ""
        held, opening = self._held, self.tools.opening
        at = -1 if self._replying else held.find(opening)
        if at > 0 and self.tools.calls_first:  # a reply: what opens later in it is no call
            at, self._replying = -1, True
        if at >= 0:
            self._held, self._opened = held[at:], True
            return held[:at]
        safe = len(held) - (0 if self._replying else _opening_begun(held, opening))
        self._replying = self._replying or (self.tools.calls_first and safe > 0)
        self._held = held[safe:]
        return held[:safe]

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left of the reply's text, and the calls."""
        if not self._opened:
            return self._held, []
        content, calls = self.tools.answer(self._held)
        return content or "", calls


def _opening_begun(text: str, opening: str) -> int:
    """How many of the text's last characters begin `opening` (held back until the next
    piece says whether a call opens there)."""
    return max((n for n in range(1, len(opening)) if text.endswith(opening[:n])), default=0)


def openai_call(name: str, args: Any) -> dict[str, Any]:
    """One call in OpenAI's form: its arguments as JSON text, under a fresh id."""
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def arguments(text: str) -> Any:
    """A call's arguments as sent back by a client: JSON text, read (left as the text
    where it is not JSON)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
