"""A workload turned into requests: arrival times, lengths, prompts, sampling seeds.

Each stream draws from its own seeded generators (one for arrivals, one for lengths, one for
prompt text), keyed by the workload seed and the stream's name, so adding a stream or
changing a prompt source never shifts another stream's arrivals.
"""

from __future__ import annotations

import json
import math
import zlib

import numpy as np

from edgeprefill.runtime.core.contract import Tokenizer
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.traffic.arrivals import arrival_times
from edgeprefill.runtime.traffic.prompts import PromptBuilder
from edgeprefill.runtime.traffic.workload import (
    AboutPrompt,
    ClosedLoopArrivals,
    DocumentsPrompt,
    Range,
    SyntheticPrompt,
    TextPrompt,
    TraceArrivals,
    Workload,
)


def _rng(seed: int, stream: str, purpose: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(stream.encode()), purpose])


def _draw(r: Range, rng: np.random.Generator) -> int:
    return int(rng.integers(r.min, r.max + 1))


def build_requests(
    workload: Workload, tokenizer: Tokenizer, seed: int | None = None
) -> list[Request]:
    """All requests of the workload, sorted by arrival time (ties by stream order); a
    closed-loop turn, which arrives only after its predecessor, sorts last. Streams that
    ask about another stream's documents are built after it."""
    seed = workload.seed if seed is None else seed
    builder = PromptBuilder(tokenizer)
    built: dict[str, list[Request]] = {}
    order = sorted(
        workload.streams, key=lambda n: isinstance(workload.streams[n].prompt, AboutPrompt)
    )
    for name in order:
        built[name] = _stream(name, workload, builder, seed, built)
    requests = [r for name in workload.streams for r in built[name]]
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def _stream(
    name: str,
    workload: Workload,
    builder: PromptBuilder,
    seed: int,
    built: dict[str, list[Request]],
) -> list[Request]:
    stream = workload.streams[name]
    spec = stream.prompt
    docs = builder.documents(spec) if isinstance(spec, DocumentsPrompt) else None
    arrivals = arrival_times(stream.arrivals, _rng(seed, name, 0), len(docs) if docs else None)
    rows = stream.arrivals.rows if isinstance(stream.arrivals, TraceArrivals) else None
    lengths = _rng(seed, name, 1)
    text = _rng(seed, name, 2)
    conversation = isinstance(stream.arrivals, ClosedLoopArrivals) and stream.arrivals.conversation
    shared = None  # prompt tokens after the shareable part (instruction, chat suffix)
    if isinstance(spec, TextPrompt | DocumentsPrompt) and stream.cls == "background":
        shared = len(builder.frame(spec)[1])
    requests = []
    for i, a in enumerate(arrivals):
        row = rows[i] if rows else {}
        source = None
        if docs:
            source, prompt = docs[i]
        elif isinstance(spec, AboutPrompt):
            n_question = int(row.get("prompt_tokens", _draw(spec.question, lengths)))
            source, prompt = _question(name, spec, workload, built, i, n_question, builder, text)
        elif conversation and a.after is not None:
            assert isinstance(spec, TextPrompt)  # the workload checked it
            prompt = builder.next_turn(spec, _draw(spec.tokens, lengths), text)
        else:
            assert isinstance(spec, TextPrompt | SyntheticPrompt)  # documents came as `docs`
            n_prompt = _draw(spec.tokens, lengths)
            prompt = builder.build(spec, int(row.get("prompt_tokens", n_prompt)), text)
        n_out = int(row.get("output_tokens", _draw(stream.output_tokens, lengths)))
        requests.append(
            Request(
                id=f"{name}-{i}",
                cls=stream.cls,
                arrival_s=math.inf if a.t_s is None else a.t_s,
                prompt=prompt,
                max_tokens=n_out,
                sampling=stream.sampling.params((seed * 1_000_003 + i) & 0xFFFFFFFF),
                ignore_eos=stream.ignore_eos,
                after=None if a.after is None else f"{name}-{a.after}",
                think_s=a.think_s,
                continues=conversation and a.after is not None,
                source=source,
                ttft_target_s=stream.ttft_target_s,
                ttft_slowdown=stream.ttft_relative,
                share_prefix=None if shared is None else len(prompt) - shared,
            )
        )
    return requests


def _question(
    name: str,
    spec: AboutPrompt,
    workload: Workload,
    built: dict[str, list[Request]],
    i: int,
    n_question: int,
    builder: PromptBuilder,
    text: np.random.Generator,
) -> tuple[str, list[int]]:
    """The `i`th question of stream `name`, about the next of the other stream's documents
    in turn (its kept prefix, then `n_question` tokens): its label and prompt."""
    about = built[spec.stream]
    if not about:
        raise UserError(f"stream {name} asks about stream {spec.stream}, which has none")
    doc = about[i % len(about)]
    other = workload.streams[spec.stream].prompt
    assert isinstance(other, TextPrompt | DocumentsPrompt)  # the workload checked it
    prefix = doc.prompt[: doc.share_prefix]
    return f"about {doc.id}", builder.question(prefix, other, n_question, text)


def format_trace(requests: list[Request]) -> str:
    """The arrival trace as JSONL: what a run was asked to do, byte-comparable across runs
    and backends (prompt ids are left out: a tokenizer's ids differ, lengths do not)."""
    lines = []
    for r in requests:
        rec: dict[str, object] = {
            "id": r.id,
            "class": r.cls,
            "arrival_s": None if math.isinf(r.arrival_s) else round(r.arrival_s, 9),
        }
        if r.after is not None:
            rec.update(after=r.after, think_s=round(r.think_s, 9))
        if r.continues:  # prompt_tokens: its new part; the conversation comes at the run
            rec["continues"] = True
        rec.update(prompt_tokens=r.prompt_len, max_tokens=r.max_tokens)
        if r.source is not None:
            rec["source"] = r.source
        lines.append(json.dumps(rec) + "\n")
    return "".join(lines)
