"""The server's table of documents stays bounded over days: finished documents beyond
`keep` are forgotten, least recently used first; those still being read never are."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from edgeprefill.runtime.api.handle import RequestHandle  # noqa: E402
from edgeprefill.runtime.api.handover import Handover  # noqa: E402
from edgeprefill.runtime.core.request import Request  # noqa: E402
from edgeprefill.runtime.server.documents import Documents  # noqa: E402
from edgeprefill.runtime.server.errors import ApiError  # noqa: E402


def document(i: int, finished: bool) -> RequestHandle:
    request = Request(f"doc-{i}", "background", 0.0, [1, 2, 3], 4)
    handle = RequestHandle(request, bytes, lambda: None, lambda kept: None, Handover())
    if finished:
        handle._end()
    return handle


def test_finished_documents_past_the_bound_are_forgotten_least_recently_used_first():
    table = Documents(keep=2)
    reading = document(0, finished=False)
    table.add(reading.id, reading)
    for i in (1, 2, 3):
        table.add(f"doc-{i}", document(i, finished=True))
    assert len(table) == 3  # the one being read and the two newest finished
    with pytest.raises(ApiError):
        table.get("doc-1")
    table.get("doc-2")  # used: now the most recent
    table.add("doc-4", document(4, finished=True))
    assert {h.id for h in (table.get("doc-0"), table.get("doc-2"), table.get("doc-4"))}
    with pytest.raises(ApiError):
        table.get("doc-3")
    table.drop("doc-0")
    assert len(table) == 2
