"""The documents given to /v1/documents, by id, for as long as they may be asked about.

A server stays up for days: those still being read are always kept (their number is
bounded by the document queue), finished ones up to `keep`, the least recently used
dropped first, and any one dropped on DELETE. Each holds its prompt ids, which a question by
`document_id` starts with."""

from __future__ import annotations

from collections import OrderedDict

from edgeprefill.runtime.api.handle import RequestHandle
from edgeprefill.runtime.server.errors import ApiError


class Documents:
    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._by_id: OrderedDict[str, RequestHandle] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, doc_id: str, handle: RequestHandle) -> None:
        self._by_id[doc_id] = handle
        self._prune()

    def get(self, doc_id: str) -> RequestHandle:
        handle = self._by_id.get(doc_id)
        if handle is None:
            raise ApiError(404, f"no document {doc_id!r}", "not_found_error")
        self._by_id.move_to_end(doc_id)
        return handle

    def by_arrival(self) -> list[RequestHandle]:
        return sorted(self._by_id.values(), key=lambda h: h.request.arrival_s)

    def drop(self, doc_id: str) -> None:
        self._by_id.pop(doc_id, None)

    def _prune(self) -> None:
        finished = [i for i, h in self._by_id.items() if h.done]  # oldest use first
        for doc_id in finished[: max(len(finished) - self.keep, 0)]:
            del self._by_id[doc_id]
