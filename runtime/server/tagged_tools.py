"""Tool calls in the form of the model's own chat template, where the template describes
the tools itself and reads calls written between <tool_call> tags (Hermes 2 Pro, Qwen 2.5
and 3: llama.cpp's server detects this form by the same tag). The template renders the
tools, the earlier calls and the tools' results as the model was trained to read them.
The answer is held to a grammar: each call a `<tool_call>` block holding JSON that fits one
of the tools; with tool_choice "auto", or else any text that does not open with the tag (a
reply). llama-server's grammar for this form is lazy, starting at the tag; this one is
whole from the first token, so no token can reach the grammar unchecked."""

from __future__ import annotations

import json
import re
from typing import Any

from edgeprefill.runtime.core.request import OutputFormat
from edgeprefill.runtime.server.tools import TemplateTools, openai_call

TAG = "tool_call"
_CALL = re.compile(rf"<{TAG}>\s*(.*?)\s*</{TAG}>", re.DOTALL)


class TaggedTools(TemplateTools):
    """Calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks."""

    opening = f"<{TAG}>"

    def output_format(self) -> OutputFormat:
        return OutputFormat(
            json.dumps(self.call_schema()),  # keys in order: the name before the arguments
            tag=TAG,
            repeat=self.parallel,
            or_text=self.choice != "required",
        )

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The text outside the calls' blocks, and the calls. An answer cut by max_tokens
        keeps the calls it completed; one with no whole call is text as it stands."""
        calls = []
        for block in _CALL.finditer(text):
            try:
                call = json.loads(block.group(1))
            except json.JSONDecodeError:
                return text, []
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            calls.append(openai_call(call["name"], call.get("arguments", {})))
        if not calls:
            return text, []
        reply = _CALL.sub("", text).split(f"<{TAG}>")[0].strip()  # a cut block is dropped
        return reply or None, calls
