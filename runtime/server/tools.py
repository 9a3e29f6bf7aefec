"""How a chat calls tools: the tools offered, the client's choice among them, and what
each form of calls shares. Two forms: `json_tools` (a JSON object any model can be held
to, the tools described in the system text) and `tagged_tools` (the model's own template's
form, where the template knows tools). The server answers in OpenAI's shape either way:
`tool_calls`, `finish_reason: "tool_calls"`."""

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
                    "arguments": t.function.parameters,
                },
                "required": ["name", "arguments"],
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
