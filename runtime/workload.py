"""Workload files: YAML validated strictly into frozen models.

An unknown key, a wrong type or an out-of-range value is reported as one line with the file,
the key path as written in the file, what was wrong, and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edgeprefill.runtime.errors import UserError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


class Range(_Strict):
    """An inclusive range of token counts, drawn uniformly per request; a bare integer
    `N` means exactly N."""

    min: int = Field(ge=1)
    max: int = Field(ge=1)

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


class PoissonArrivals(_Strict):
    process: Literal["poisson"]
    rate_per_s: float = Field(gt=0)
    count: int = Field(ge=1)
    start_s: float = Field(default=0.0, ge=0)


class BurstArrivals(_Strict):
    """`count` requests at `start_s`, `interval_s` apart (0: all at once)."""

    process: Literal["burst"]
    count: int = Field(ge=1)
    start_s: float = Field(default=0.0, ge=0)
    interval_s: float = Field(default=0.0, ge=0)


class Phase(_Strict):
    duration_s: float = Field(gt=0)
    rate_per_s: float = Field(ge=0)


class PhasedArrivals(_Strict):
    """Poisson arrivals whose rate changes phase by phase (P-PAS's steady/burst trace)."""

    process: Literal["phases"]
    phases: list[Phase] = Field(min_length=1)
    start_s: float = Field(default=0.0, ge=0)


Arrivals = Annotated[
    PoissonArrivals | BurstArrivals | PhasedArrivals, Field(discriminator="process")
]


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


Prompt = Annotated[TextPrompt | SyntheticPrompt, Field(discriminator="source")]


class Sampling(_Strict):
    temperature: float = Field(default=0.0, ge=0)  # 0: greedy
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0)  # None: derived from the workload seed


class Stream(_Strict):
    """One source of requests of one class (the assistant, the indexer, ...)."""

    cls: Literal["foreground", "background"] = Field(alias="class")
    arrivals: Arrivals
    prompt: Prompt
    output_tokens: Range
    ignore_eos: bool = False  # generate exactly the drawn output length
    sampling: Sampling = Sampling()


class Workload(_Strict):
    name: str
    description: str = ""
    seed: int = Field(default=0, ge=0)
    streams: dict[str, Stream] = Field(min_length=1)


def load_workload(path: Path) -> Workload:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"workload file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read workload file {path}: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise UserError(f"{path}:{where}: not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a workload is a YAML mapping with name, seed and streams")
    try:
        return Workload.model_validate(data)
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
    return f"{where}: {msg} (got {first['input']!r}){tail}"


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
                if getattr(annotation, "__origin__", None) is dict:
                    return ("dict", annotation.__args__[1])
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
