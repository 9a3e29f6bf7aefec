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
import re
from functools import lru_cache
from typing import Any

from llama_cpp import llama_grammar

from edgeprefill.runtime.core.request import OutputFormat

ANY_OBJECT = json.dumps({"type": "object"})
# The converter writes a length or count bound out as that many nested rules (a
# `maxLength` of 10^6 is an 8 MB grammar), so a request's schema could cost the server
# gigabytes: a schema whose bounds add up past MAX_BOUNDS is refused (~10 bytes of grammar
# each), and so is a grammar past MAX_GRAMMAR_BYTES.
MAX_BOUNDS = 100_000
BOUNDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
MAX_GRAMMAR_BYTES = 1 << 20
LOOSE_CHAR = 'char ::= [^"\\\\] |'
JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'
# llama-cpp-python's converter, untyped; its rule naming keeps added rules' names unique.
SchemaConverter: Any = llama_grammar.SchemaConverter


@lru_cache(maxsize=64)
def output_grammar(output_format: OutputFormat) -> str:
    """The GBNF whose root rule the output must match. ValueError naming the problem where
    the schema cannot be turned into one."""
    schema = json.loads(output_format.schema or ANY_OBJECT)
    _check_bounds(schema)
    try:
        grammar = _convert(schema, output_format).replace(LOOSE_CHAR, JSON_CHAR)
    except (
        ValueError,
        KeyError,
        TypeError,
        AssertionError,
        NotImplementedError,
        RecursionError,
    ) as e:
        raise ValueError(f"the JSON schema cannot be enforced: {e}") from None
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise ValueError(
            f"the JSON schema makes a grammar of {len(grammar):,} bytes, over this server's "
            f"{MAX_GRAMMAR_BYTES:,}: simplify it"
        )
    return grammar


def _convert(schema: object, output_format: OutputFormat) -> str:
    """The converter's grammar for the schema (llama-cpp-python's `json_schema_to_gbnf`,
    with the JSON under a rule of its own where a tag or a reply's text is its
    alternative)."""
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    schema = converter.resolve_refs(schema, "stdin")
    tag = output_format.tag
    if tag is None and not output_format.or_text:
        converter.visit(schema, "")  # the root rule
        return str(converter.format_grammar())
    value = converter.visit(schema, "json-answer")  # no primitive rule's name; not "root"
    if tag is None:
        opening, answer = "{", value  # a JSON object opens with its brace
    else:
        opening, one = f"<{tag}>", f'"<{tag}>\\n" {value} "\\n</{tag}>"'
        answer = f'{one} ("\\n" {one})*' if output_format.repeat else one
    if output_format.or_text:
        text = converter._add_rule("reply-text", _not_opening_with(opening))
        answer = f"({answer}) | {text}"
    converter._add_rule("root", answer)
    return str(converter.format_grammar())


def _not_opening_with(word: str) -> str:
    """GBNF for any text that does not begin with `word` (the empty text included): it
    leaves the word at some character, or ends before the word does. `word` is ASCII
    without quotes or backslashes."""
    rest = ""
    for ch in reversed(word):
        rest = f'([^{ch}] [^\\x00]* | "{ch}" {rest})?' if rest else f"([^{ch}] [^\\x00]*)?"
    return rest


def _check_bounds(schema: object) -> None:
    """ValueError where the lengths, counts and pattern repetitions of the schema add up
    past MAX_BOUNDS (walked without recursion: a schema may nest deeply)."""
    stack, total = [schema], 0
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        if not isinstance(node, dict):
            continue
        stack.extend(node.values())
        total += sum(node[k] for k in BOUNDS if isinstance(node.get(k), int | float))
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            total += sum(int(n) for m in QUANTIFIER.finditer(pattern) for n in m.groups() if n)
        if total > MAX_BOUNDS:
            raise ValueError(
                "the JSON schema's lengths, counts and pattern repetitions add up to more "
                f"than the {MAX_BOUNDS:,} this server enforces; lower them"
            )
