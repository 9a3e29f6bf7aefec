"""What a run expects to compute, estimated before it starts.

A backend can only choose some settings once, for the whole run (llama.cpp's flash
attention is fixed per context), and which is fastest depends on the work: on the CPUs
tried, flash attention made shallow decodes ~5% faster but chunks deep in long documents
12-28% slower. A chat-only run and a document indexer want different settings; this says
which kind of run is coming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestShape:
    """Requests expected alike (one stream of a workload): how many, and their mean prompt
    and output lengths in tokens."""

    count: float
    prompt_tokens: float
    output_tokens: float


@dataclass(frozen=True)
class ExpectedLoad:
    shapes: tuple[RequestShape, ...]

    @property
    def prompt_tokens(self) -> float:
        return sum(s.count * s.prompt_tokens for s in self.shapes)

    @property
    def output_tokens(self) -> float:
        return sum(s.count * s.output_tokens for s in self.shapes)

    def describe(self) -> dict[str, Any]:
        return {
            "requests": round(sum(s.count for s in self.shapes), 1),
            "prompt_tokens": round(self.prompt_tokens),
            "output_tokens": round(self.output_tokens),
        }
