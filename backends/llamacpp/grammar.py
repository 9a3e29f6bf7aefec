"""Output formats as llama.cpp grammars (GBNF), converted by llama-cpp-python's own
JSON-Schema converter (a port of llama.cpp's `json_schema_to_grammar`, which llama-server
uses for `response_format`).

"Any JSON object" is the schema `{"type": "object"}`, not llama.cpp's generic JSON grammar:
that one allows unbounded whitespace, and a small model given it can fill every token with
newlines until `max_tokens` (llama-server's `json_object` answers were cut so); the
converter's rules allow one space between tokens.

The converter's string characters (`[^"\\]`) let a string hold raw control characters
(a newline), which no JSON parser takes; its rule is replaced by llama.cpp's current one,
which leaves them to escapes.
"""

from __future__ import annotations

import json
from functools import lru_cache

from llama_cpp.llama_grammar import json_schema_to_gbnf

from edgeprefill.runtime.core.request import OutputFormat

ANY_OBJECT = json.dumps({"type": "object"})
LOOSE_CHAR = 'char ::= [^"\\\\] |'
JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'


@lru_cache(maxsize=64)
def output_grammar(output_format: OutputFormat) -> str:
    """The GBNF whose root rule the output must match. ValueError naming the problem where
    the schema cannot be turned into one."""
    schema = output_format.schema or ANY_OBJECT
    try:
        return json_schema_to_gbnf(schema).replace(LOOSE_CHAR, JSON_CHAR)
    except (
        ValueError,
        KeyError,
        TypeError,
        AssertionError,
        NotImplementedError,
        RecursionError,
    ) as e:
        raise ValueError(f"the JSON schema cannot be enforced: {e}") from None
