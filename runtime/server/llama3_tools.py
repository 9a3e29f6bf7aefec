"""Tool calls in Llama 3.x's form, where the model's chat template has Llama 3.1's `ipython`
role (llama.cpp's server detects the form by the same header): the template lists the
tools and asks for a call as a bare JSON object, `{"name": ..., "parameters": {...}}`,
one a turn; a tool's result comes back in an `ipython` turn, which the template writes
for a `tool` message. The answer is held to a grammar: a call to one of the tools, with
its arguments' schema, or, with tool_choice "auto", any text that does not open with `{`
(a reply). llama-server's grammar is lazy, starting where the answer looks like a call;
this one is whole from the first token, so no token can reach the grammar unchecked."""

from __future__ import annotations

import json
from typing import Any

from edgeprefill.runtime.core.request import OutputFormat
from edgeprefill.runtime.server.tools import TemplateTools, openai_call


class Llama3Tools(TemplateTools):
    """One call as `{"name": ..., "parameters": {...}}`: the form allows one call a turn,
    so `parallel_tool_calls` allows, and gets, at most one."""

    opening = "{"
    calls_first = True
    arguments_key = "parameters"

    def output_format(self) -> OutputFormat:
        return OutputFormat(
            json.dumps(self.call_schema()),  # keys in order: the name before the parameters
            or_text=self.choice != "required",
        )

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The call, where the answer is one; else the answer is the reply as it stands
        (a call cut by max_tokens included: it has no arguments to send)."""
        if not text.startswith(self.opening):
            return text, []
        try:
            call = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        return None, [openai_call(call["name"], call.get(self.arguments_key, {}))]
