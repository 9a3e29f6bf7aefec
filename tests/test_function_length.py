"""Issue 22's bound on the code a reader follows: no function in the runtime or the backends
runs to 60 lines (one once grew to 62 unnoticed)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
LIMIT = 60


def test_no_function_in_the_runtime_or_the_backends_reaches_60_lines():
    long = []
    for folder in ("runtime", "backends"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if lines >= LIMIT:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert long == []
