"""Workload files: YAML validated strictly into frozen models.

An unknown key, a wrong type or an out-of-range value is reported as one line with the file,
the key path as written in the file, what was wrong, and what is allowed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.request import DEFAULT_TTFT_SLOWDOWN, OutputFormat, SamplingParams
from edgeprefill.runtime.traffic.trace_file import MAX_TOKENS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


class Range(_Strict):
    """An inclusive range of token counts, drawn uniformly per request; a bare integer
    `N` means exactly N."""

    min: int = Field(ge=1, le=MAX_TOKENS)
    max: int = Field(ge=1, le=MAX_TOKENS)

    @model_validator(mode="before")
    @classmethod
    def _from_int(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return {"min": value, "max": value}
        return value

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be at least min ({self.min})")
        return self


def _resolve(path: str, info: ValidationInfo) -> Path:
    """A path as written in the workload file, relative to that file's folder."""
    base = (info.context or {}).get("base_dir", Path("."))
    return (base / Path(path).expanduser()).resolve()


# Requests per stream: every request is built (prompt ids and all) before the run starts,
# so a count of 10^12 must be a one-line error, not a MemoryError.
MAX_REQUESTS = 1_000_000


class PoissonArrivals(_Strict):
    process: Literal["poisson"]
    rate_per_s: float = Field(gt=0)
    count: int | None = Field(default=None, ge=1)  # None only with a documents prompt
    start_s: float = Field(default=0.0, ge=0)


class GammaArrivals(_Strict):
    """Gamma-distributed gaps with mean 1/rate. `burstiness` is the shape: 1 is Poisson,
    below 1 burstier, above 1 more regular (the convention of vLLM's benchmark)."""

    process: Literal["gamma"]
    rate_per_s: float = Field(gt=0)
    burstiness: float = Field(default=1.0, gt=0)
    count: int | None = Field(default=None, ge=1)
    start_s: float = Field(default=0.0, ge=0)


class BurstArrivals(_Strict):
    """`count` requests at `start_s`, `interval_s` apart (0: all at once)."""

    process: Literal["burst"]
    count: int | None = Field(default=None, ge=1)
    start_s: float = Field(default=0.0, ge=0)
    interval_s: float = Field(default=0.0, ge=0)


class ClosedLoopArrivals(_Strict):
    """`users` people, each sending `turns` requests: a user's next request arrives a think
    time (exponential, mean `think_s`) after its previous response finished. User k's first
    request arrives at start_s + k * stagger_s. The think times are seeded; the arrival
    times follow from the run, as they do for real users. With `conversation`, each turn
    resends the user's conversation so far (the previous turn's prompt and answer) before a
    new question of `prompt.tokens`, as every client of a stateless chat API does: a
    turn's prompt is known only once the turn before it has answered."""

    process: Literal["closed_loop"]
    users: int = Field(ge=1)
    turns: int = Field(ge=1)
    think_s: float = Field(ge=0)
    stagger_s: float = Field(default=0.0, ge=0)
    start_s: float = Field(default=0.0, ge=0)
    conversation: bool = False


class TraceArrivals(_Strict):
    """Arrival times replayed from a file: CSV with a `timestamp_s` column, or JSONL with a
    `timestamp_s` field per line; optional `prompt_tokens` / `output_tokens` per row
    override the stream's ranges. Times count from the file's first timestamp."""

    process: Literal["trace"]
    path: str
    start_s: float = Field(default=0.0, ge=0)
    _rows: tuple[dict[str, float], ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _load(self, info: ValidationInfo) -> TraceArrivals:
        from edgeprefill.runtime.traffic.trace_file import read_trace

        self._rows = tuple(read_trace(_resolve(self.path, info)))
        return self

    @property
    def rows(self) -> tuple[dict[str, float], ...]:
        return self._rows


class Phase(_Strict):
    duration_s: float = Field(gt=0)
    rate_per_s: float = Field(ge=0)


class PhasedArrivals(_Strict):
    """Poisson arrivals whose rate changes phase by phase (P-PAS's steady/burst trace)."""

    process: Literal["phases"]
    phases: list[Phase] = Field(min_length=1)
    start_s: float = Field(default=0.0, ge=0)


Arrivals = Annotated[
    PoissonArrivals
    | GammaArrivals
    | BurstArrivals
    | PhasedArrivals
    | ClosedLoopArrivals
    | TraceArrivals,
    Field(discriminator="process"),
]
COUNTED = (PoissonArrivals, GammaArrivals, BurstArrivals)


class TextPrompt(_Strict):
    """Real English text generated deterministically from words, tokenized by the model's
    own tokenizer and cut to an exact token count, inside the model's chat template."""

    source: Literal["text"]
    tokens: Range
    system: str | None = None
    instruction: str | None = None  # appended after the text, e.g. "Summarize the above."
    chat_template: bool = True


class SyntheticPrompt(_Strict):
    """Exact-token prompts of random plain-text token ids, for reproducible benchmarks."""

    source: Literal["synthetic"]
    tokens: Range


class DocumentsPrompt(_Strict):
    """Real documents: every file in `folder` matching `patterns`, in name order. Each is
    split into pieces of at most `chunk_tokens` tokens (template and instruction included):
    at paragraph breaks (blank lines) where a paragraph fits, at token boundaries inside a
    paragraph longer than a piece. Nothing is dropped: every token of every document is in
    exactly one request. One request per piece, so the arrivals take no count."""

    source: Literal["documents"]
    folder: str
    patterns: list[str] = Field(default_factory=lambda: ["*.txt", "*.md"], min_length=1)
    chunk_tokens: int = Field(ge=64)
    system: str | None = None
    instruction: str | None = None
    chat_template: bool = True
    _files: tuple[Path, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _find(self, info: ValidationInfo) -> DocumentsPrompt:
        folder = _resolve(self.folder, info)
        if not folder.is_dir():
            raise ValueError(f"document folder {folder} does not exist or is not a folder")
        files = sorted({p for pat in self.patterns for p in folder.glob(pat) if p.is_file()})
        if not files:
            raise ValueError(f"no files matching {', '.join(self.patterns)} in {folder}")
        self._files = tuple(files)
        return self

    @property
    def files(self) -> tuple[Path, ...]:
        return self._files


class AboutPrompt(_Strict):
    """A question about one of another stream's documents, asked as a person would after
    the indexer read it: that document first, in the same template, then the question
    (generated text of `question` tokens). The i-th request asks about document i modulo
    their number. The document's tokens are the same as the indexer's, so where its KV
    state was kept, only the question is computed."""

    source: Literal["about"]
    stream: str
    question: Range


Prompt = Annotated[
    TextPrompt | SyntheticPrompt | DocumentsPrompt | AboutPrompt, Field(discriminator="source")
]


class Sampling(_Strict):
    temperature: float = Field(default=0.0, ge=0)  # 0: greedy
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0)  # None: derived from the workload seed
    # The answer is JSON fitting this JSON Schema (OpenAI's `response_format` json_schema),
    # sampled under its grammar: what a structured-output client costs the scheduler.
    json_schema: dict[str, JsonValue] | None = None

    def params(self, derived_seed: int) -> SamplingParams:
        """A request's sampling: the stream's seed if it gives one, else `derived_seed`
        (one per request, from the workload's seed)."""
        fmt = None if self.json_schema is None else OutputFormat(json.dumps(self.json_schema))
        seed = self.seed if self.seed is not None else derived_seed
        return SamplingParams(self.temperature, self.top_p, seed, output_format=fmt)


class Stream(_Strict):
    """One source of requests of one class (the assistant, the indexer, ...)."""

    cls: Literal["foreground", "background"] = Field(alias="class")
    arrivals: Arrivals
    prompt: Prompt
    output_tokens: Range
    ignore_eos: bool = False  # generate exactly the drawn output length
    sampling: Sampling = Sampling()
    # Seconds from arrival to the first token wanted, absolute (left out: none). Deadline-
    # aware policies size a waiting request's prompt chunks by it; the summary reports how
    # many met it.
    ttft_target_s: float | None = Field(default=None, gt=0)
    # The same, relative: this multiple of what the prompt takes alone on the device at hand
    # (left out: the class's default, 3 for foreground, none for background; null: none).
    # Where both are given, planning aims at the absolute one and both are reported.
    ttft_slowdown: float | None = Field(default=None, gt=1)

    @property
    def ttft_relative(self) -> float | None:
        if "ttft_slowdown" in self.model_fields_set:
            return self.ttft_slowdown
        return DEFAULT_TTFT_SLOWDOWN[self.cls]

    @property
    def expected_count(self) -> float:
        """Requests this stream makes (phased arrivals: on average; documents: unknown
        until they are split into pieces, 0)."""
        a = self.arrivals
        if isinstance(a, ClosedLoopArrivals):
            return a.users * a.turns
        if isinstance(a, PhasedArrivals):
            return sum(p.rate_per_s * p.duration_s for p in a.phases)
        if isinstance(a, TraceArrivals):
            return len(a.rows)
        return a.count or 0

    @model_validator(mode="after")
    def _count(self) -> Stream:
        a = self.arrivals
        expected = self.expected_count
        if expected > MAX_REQUESTS:
            raise ValueError(
                f"this stream would make about {expected:.0f} requests; at most {MAX_REQUESTS:,} "
                "per stream are allowed: lower its count, rate or duration"
            )
        if isinstance(self.prompt, DocumentsPrompt):
            if not isinstance(a, COUNTED):
                raise ValueError(
                    "a documents prompt needs poisson, gamma or burst arrivals (one request "
                    f"per document piece), not {a.process}"
                )
            if a.count is not None:
                raise ValueError(
                    "arrivals.count must be left out with a documents prompt: there is one "
                    "request per document piece"
                )
        elif isinstance(a, COUNTED) and a.count is None:
            raise ValueError(f"arrivals.count is required for {a.process} arrivals")
        if isinstance(a, ClosedLoopArrivals) and a.conversation:
            if not isinstance(self.prompt, TextPrompt):
                raise ValueError(
                    "arrivals.conversation needs a text prompt (each turn's question is "
                    f"generated text), not {self.prompt.source}"
                )
        if self.ignore_eos and self.sampling.json_schema is not None:
            raise ValueError(
                "sampling.json_schema with ignore_eos: a JSON answer ends where its grammar "
                "does; drop ignore_eos"
            )
        return self


class Workload(_Strict):
    name: str
    description: str = ""
    seed: int = Field(default=0, ge=0)
    streams: dict[str, Stream] = Field(min_length=1)

    @model_validator(mode="after")
    def _about_names_a_document_stream(self) -> Workload:
        for name, stream in self.streams.items():
            p = stream.prompt
            if not isinstance(p, AboutPrompt):
                continue
            other = self.streams.get(p.stream)
            if other is None or other is stream:
                raise ValueError(
                    f"stream {name}: prompt.stream {p.stream!r} must name another stream "
                    f"(one of: {', '.join(n for n in self.streams if n != name)})"
                )
            if not isinstance(other.prompt, TextPrompt | DocumentsPrompt):
                raise ValueError(
                    f"stream {name}: prompt.stream {p.stream!r} must have text or documents "
                    f"prompts to ask about, not {other.prompt.source}"
                )
        return self


def load_workload(path: Path) -> Workload:
    from edgeprefill.runtime.traffic.trace_file import read_text

    try:
        text = read_text(path, "workload")
    except ValueError as e:
        raise UserError(str(e)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join((getattr(e, "problem", None) or str(e)).split())
        raise UserError(f"{path}{where}: not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a workload is a YAML mapping with name, seed and streams")
    try:
        return Workload.model_validate(data, context={"base_dir": path.parent})
    except ValidationError as e:
        raise UserError(f"{path}: {describe_error(e, data)}") from None


def describe_error(err: ValidationError, data: Any) -> str:
    """The first error as `key.path: problem (got value)`, with the allowed keys for an
    unknown one. Union tags that pydantic puts in the location are dropped so the path is
    the one written in the file."""
    first = err.errors()[0]
    path: list[str] = []
    node: Any = data
    model: Any = Workload
    parent: Any = None  # the model holding the key the error is about
    for part in first["loc"]:
        if isinstance(node, dict) and part in node:
            path.append(str(part))
            node = node[part]
            parent, model = model, _child_model(model, part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            path.append(str(part))
            node = node[part]
        else:  # a union tag (e.g. 'poisson'), or the missing key itself
            tagged = _union_member(model, part)
            if tagged is not None:
                model = tagged
            elif first["type"] == "missing":
                path.append(str(part))
    where = ".".join(path) or "(top level)"
    more = len(err.errors()) - 1
    tail = f" ({more} more problem{'s' if more > 1 else ''} after this one)" if more else ""
    if first["type"] == "extra_forbidden":
        allowed = _allowed_keys(parent)
        return f"{where}: unknown key; allowed keys here: {', '.join(allowed)}{tail}"
    if first["type"] == "missing":
        return f"{where}: required key is missing{tail}"
    if first["type"] == "union_tag_not_found":
        key = first["ctx"]["discriminator"].strip("'")
        return f"{where}.{key}: required key is missing{tail}"
    if first["type"] == "union_tag_invalid":
        ctx = first["ctx"]
        key = ctx["discriminator"].strip("'")
        return f"{where}.{key}: unknown {key} '{ctx['tag']}'; allowed: {ctx['expected_tags']}{tail}"
    msg = first["msg"].removeprefix("Value error, ")
    got = "" if isinstance(first["input"], dict) else f" (got {first['input']!r})"
    return f"{where}: {msg}{got}{tail}"


def _unwrap(tp: Any) -> list[Any]:
    """The BaseModel classes a field annotation may hold."""
    args = getattr(tp, "__args__", None)
    if getattr(tp, "__metadata__", None) is not None:  # Annotated[...]
        return _unwrap(tp.__origin__)
    if args:
        return [m for a in args for m in _unwrap(a)]
    return [tp] if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def _child_model(model: Any, key: Any) -> Any:
    if isinstance(model, type) and issubclass(model, BaseModel):
        for name, field in model.model_fields.items():
            if key in (name, field.alias):
                annotation = field.annotation
                if get_origin(annotation) is dict:
                    return ("dict", get_args(annotation)[1])
                members = _unwrap(annotation)
                return members[0] if len(members) == 1 else tuple(members)
    if isinstance(model, tuple) and model and model[0] == "dict":
        members = _unwrap(model[1])
        return members[0] if len(members) == 1 else tuple(members)
    return None


def _union_member(model: Any, tag: Any) -> Any:
    if isinstance(model, tuple):
        for member in model:
            if isinstance(member, type) and issubclass(member, BaseModel):
                for field in member.model_fields.values():
                    if getattr(field.annotation, "__args__", None) == (tag,):
                        return member
    return None


def _allowed_keys(model: Any) -> list[str]:
    if isinstance(model, type) and issubclass(model, BaseModel):
        return [f.alias or name for name, f in model.model_fields.items()]
    return []
