"""A workload's expected work, estimated from its file alone (before any model loads), so
the backend can choose its once-per-run settings for it (see `core.load`)."""

from __future__ import annotations

import math
import statistics

from edgeprefill.runtime.core.load import ExpectedLoad, RequestShape
from edgeprefill.runtime.traffic.workload import (
    AboutPrompt,
    ClosedLoopArrivals,
    DocumentsPrompt,
    Range,
    Stream,
    SyntheticPrompt,
    TextPrompt,
    TraceArrivals,
    Workload,
)

BYTES_PER_TOKEN = 4.0  # English text in the tokenizers of the models tried
# A document's pieces end at paragraph breaks, so they hold less than `chunk_tokens`: this
# repository's README went into pieces 80% full on average (16,323 tokens in 5 of 4,096).
PIECE_FILL = 0.85


def expected_load(workload: Workload) -> ExpectedLoad:
    streams = workload.streams
    shapes = {n: _shape(s) for n, s in streams.items() if not isinstance(s.prompt, AboutPrompt)}
    for name, s in streams.items():
        if isinstance(s.prompt, AboutPrompt):  # the document, then the question
            document = shapes[s.prompt.stream].prompt_tokens
            shapes[name] = _shape(s, document + _mean(s.prompt.question))
    return ExpectedLoad(tuple(shapes[n] for n in streams))


def _mean(r: Range) -> float:
    return (r.min + r.max) / 2


def _shape(stream: Stream, prompt: float | None = None) -> RequestShape:
    a, p = stream.arrivals, stream.prompt
    output = _mean(stream.output_tokens)
    if isinstance(p, DocumentsPrompt):
        per_file = [f.stat().st_size / BYTES_PER_TOKEN for f in p.files]
        # Each file is split on its own: a file's last piece is short.
        pieces = max(1, sum(math.ceil(t / (p.chunk_tokens * PIECE_FILL)) for t in per_file))
        return RequestShape(pieces, sum(per_file) / pieces, output)
    if prompt is None:
        assert isinstance(p, TextPrompt | SyntheticPrompt)  # a question's length is given
        prompt = _mean(p.tokens)
    if isinstance(a, ClosedLoopArrivals) and a.conversation:
        # Turn k resends the k turns before it, question and answer: the mean over turns.
        prompt += (a.turns - 1) / 2 * (prompt + output)
    if isinstance(a, TraceArrivals) and a.rows:  # a row's own lengths replace the ranges
        rows = a.rows
        prompt = statistics.fmean(r.get("prompt_tokens", prompt) for r in rows)
        output = statistics.fmean(r.get("output_tokens", output) for r in rows)
    return RequestShape(stream.expected_count, prompt, output)
