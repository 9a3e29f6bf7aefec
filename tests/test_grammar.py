"""Output formats as grammars: a schema's cost is bounded before its grammar is built, and
strings cannot hold raw control characters (JSON parsers refuse them)."""

from __future__ import annotations

import json

import pytest

from edgeprefill.backends.llamacpp.grammar import output_grammar
from edgeprefill.runtime.core.request import OutputFormat


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 10**9},
        {"type": "array", "items": {"type": "string"}, "minItems": 10**6},
        {"type": "string", "pattern": "^(ab{60000}){60000}$"},
        {"anyOf": [{"type": "string", "maxLength": 9_000}] * 20},  # each small, many
    ],
)
def test_a_schema_that_would_cost_the_server_gigabytes_is_refused_first(schema):
    with pytest.raises(ValueError, match="add up to more than"):
        output_grammar(OutputFormat(json.dumps(schema)))


def test_any_object_keeps_control_characters_out_of_strings():
    grammar = output_grammar(OutputFormat())
    (char,) = [line for line in grammar.splitlines() if line.startswith("char ::=")]
    assert "\\x00-\\x1F" in char


def test_a_remote_reference_is_not_fetched():
    schema = {"$ref": "https://example.com/schema.json"}
    with pytest.raises(ValueError, match="cannot be enforced"):
        output_grammar(OutputFormat(json.dumps(schema)))
