"""Every Python example in the README and docs/ runs as written: the library's against the
bundled model (in a folder holding the `notes.txt` they read), the clients' against a real
`serve` (its address, key and model name put in for the README's placeholders, and a
document read first where an example asks about one)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import KEY, serving

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
EXAMPLES = [
    pytest.param(code, id=f"{page.name}-{i}")
    for page in PAGES
    for i, code in enumerate(BLOCK.findall(page.read_text()))
]
SERVER = "http://127.0.0.1:8080/v1"


def test_the_docs_have_examples_of_both_kinds():
    assert sum(SERVER in e.values[0] for e in EXAMPLES) >= 2
    assert sum("Runtime(" in e.values[0] for e in EXAMPLES) >= 2


@pytest.mark.parametrize("code", EXAMPLES)
def test_an_example_runs(code, make_backend, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EDGEPREFILL_API_KEY", KEY)
    (tmp_path / "notes.txt").write_text("The meeting moved to room 4. " * 20)
    if SERVER not in code and "client." not in code:
        exec(compile(code, "example", "exec"), {})
        return
    with serving(make_backend) as (base, _):
        code = code.replace(SERVER, f"{base}/v1")
        code = re.sub(r'model="[^"]*"', 'model="tiny"', code)
        if "doc-…" in code:
            doc = _read_document(base)
            code = code.replace("doc-…", doc)
        prelude = (
            f"from openai import OpenAI\nclient = OpenAI(base_url={base + '/v1'!r}, api_key=KEY)\n"
        )
        scope = {"KEY": KEY}
        exec(compile(("" if "OpenAI(" in code else prelude) + code, "example", "exec"), scope)


def _read_document(base: str) -> str:
    """A document given to /v1/documents and read to its end: its id."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as http:
        doc = http.post("/v1/documents", json={"text": "The meeting moved to room 4."}).json()
        while http.get(f"/v1/documents/{doc['id']}").json()["status"] not in ("finished", "failed"):
            time.sleep(0.1)
    return doc["id"]
