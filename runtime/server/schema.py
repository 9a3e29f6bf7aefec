"""The OpenAI request bodies this server accepts, and how they map onto the runtime.

Every field is bounded: numbers finite and within limits, strings and lists of a bounded
length, content parts typed, so no body reaches the engine with a value it cannot take.
Unknown fields are ignored, as OpenAI-compatible servers do (clients send `user`,
`store` and others); fields with a value this server cannot honour (n > 1) are
refused with a 400 that names them.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from edgeprefill.runtime.core.request import (
    MAX_TOP_LOGPROBS,
    OutputFormat,
    RequestClass,
    SamplingParams,
)

MAX_TOKENS_DEFAULT = 256
# Bounds that no real request comes near; the context and the body size bind first.
MAX_TOKENS = 1 << 20  # tokens to generate (the context refuses more anyway)
MAX_TEXT = 16 << 20  # characters in one string (the body limit binds first by default)
MAX_MESSAGES = 4096
MAX_PARTS = 1024  # content parts of one message
MAX_STOPS, MAX_STOP_CHARS = 16, 256
MAX_TTFT_TARGET_MS = 3_600_000.0  # an hour
MAX_ID_CHARS = 256  # model names, document ids
MAX_PRIORITY = 1 << 31
MAX_TOKEN_ID = (1 << 31) - 1  # ids past the vocabulary are refused by the runtime
# Token ids in one prompt: a million, the longest context models have. The server's own
# context binds first (`BodyParser` refuses a body with more values than it holds).
MAX_PROMPT_IDS = 1 << 20
MAX_LOGIT_BIASES = 1024  # OpenAI takes 300


# Strings of bounded length (pydantic also refuses lone surrogates, which the tokenizer
# could not encode), token ids of a bounded size. Every list stops at its first bad item
# (`fail_fast`): a list of a million bad ids is one error, not a million.
Text = Annotated[str, Field(max_length=MAX_TEXT)]
Name = Annotated[str, Field(max_length=MAX_ID_CHARS)]
# An empty stop string would end every answer before its first token.
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stops = Annotated[list[StopText], Field(max_length=MAX_STOPS, fail_fast=True)]
TokenIds = Annotated[
    list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]],
    Field(max_length=MAX_PROMPT_IDS, fail_fast=True),
]


class Strict(BaseModel):
    """Finite numbers only: JSON's `1e400`, `Infinity` and `NaN` parse to inf and nan. A
    field's docstring is its description (in /openapi.json and docs/reference.md)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, use_attribute_docstrings=True)


class StreamOptions(Strict):
    include_usage: bool = False
    """A last chunk with the token counts."""


class ContentPart(Strict):
    """One part of a message's content: text parts are read, others (images) ignored."""

    type: Name
    text: Text | None = None

    @model_validator(mode="after")
    def _text_given(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError('a content part of type "text" needs a string "text"')
        return self


Parts = Annotated[list[ContentPart], Field(max_length=MAX_PARTS, fail_fast=True)]


class FunctionCall(Strict):
    name: Name
    arguments: Text = "{}"
    """The arguments as JSON text, as OpenAI sends them."""


class ToolCall(Strict):
    id: Name = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | Parts | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_MESSAGES)
    """An assistant's calls, sent back in the conversation."""
    tool_call_id: Name | None = None
    """The call a tool message answers."""

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: the text ones
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class JsonSchemaFormat(Strict):
    name: Name = "response"
    schema_: dict[str, JsonValue] = Field(default_factory=dict, alias="schema")
    """The JSON Schema the answer must fit ({}: any JSON)."""
    strict: bool | None = None
    """Enforced either way: the answer is sampled under the schema's grammar."""


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('a response_format of type "json_schema" needs its "json_schema"')
        return self

    def output_format(self) -> OutputFormat | None:
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema is None:
            return OutputFormat()
        schema = self.json_schema.schema_
        return OutputFormat(json.dumps(schema, sort_keys=True) if schema else None)


class Generation(Strict):
    model: Name | None = None
    """The served model's id as `/v1/models` lists it (--served-model-name; by default the
    model file's name without .gguf), or none; another name is a 404."""
    stream: bool = False
    """Server-sent events, a chunk per token."""
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    """Tokens to generate at most (256 when neither this nor max_completion_tokens is given)."""
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    """As max_tokens (OpenAI's newer name); wins when both are given."""
    temperature: float = Field(default=1.0, ge=0, le=2)
    """0: greedy."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, le=1 << 20)
    """The k likeliest tokens only (0: all)."""
    min_p: float = Field(default=0.0, ge=0, le=1)
    """Tokens at least this share of the likeliest one's probability only (0: all)."""
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    """Subtracted from the logit of a token the last 64 output tokens hold (llama.cpp's
    window, as llama-server counts)."""
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    """Subtracted once for each time the last 64 output tokens hold it."""
    repeat_penalty: float = Field(default=1.0, gt=0, le=10)
    """llama.cpp's: a repeated token's logit divided by this (1: off)."""
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIASES)
    """Token id (as a string) to a bias from -100 to 100 added to its logit."""
    response_format: ResponseFormat | None = None
    """`json_object` or `json_schema`: the answer is sampled under a grammar, so it is
    JSON (fitting the schema) whatever the model."""
    seed: int | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    """OpenAI's 64-bit seed; none: a random one, so two requests alike differ."""
    stop: StopText | Stops | None = None
    """Text that ends the answer (not included)."""
    n: int = Field(default=1, ge=1, le=1)
    """One choice per request."""
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    """vLLM's field, lower first: <= 0 a chat (foreground), > 0 background work."""
    ttft_target_ms: float | None = Field(default=None, gt=0, le=MAX_TTFT_TARGET_MS)
    """The first token wanted within this many ms of arrival (a chat by default: within 3x
    its prompt alone on this device)."""
    document_id: Name | None = None
    """A document given to /v1/documents that this asks about: only the question is
    computed once the document has been read."""
    ignore_eos: bool = False
    """Generate past end-of-text and the turn's end (vLLM's and llama-server's extension, for
    benchmarks); the request's own `stop` strings still end it."""

    @property
    def limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or MAX_TOKENS_DEFAULT

    @property
    def cls(self) -> RequestClass:
        return "foreground" if self.priority <= 0 else "background"

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token(cls, biases: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (biases or {}).items():
            if not token.isdigit() or int(token) > MAX_TOKEN_ID:
                raise ValueError(f"logit_bias keys are token ids, not {token[:32]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias of token {token} is {bias}, not from -100 to 100")
        return biases

    def sampling(self) -> SamplingParams:
        seed = secrets.randbits(63) if self.seed is None else self.seed
        fmt = self.response_format
        return SamplingParams(
            self.temperature,
            self.top_p,
            seed,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repeat_penalty=self.repeat_penalty,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            output_format=None if fmt is None else fmt.output_format(),
            logprobs=self.logprobs_asked,
        )

    @property
    def logprobs_asked(self) -> int | None:
        """None: no log-probabilities; k: each token's and its k likeliest alternatives'."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _any_object() -> dict[str, JsonValue]:
    return {"type": "object"}


class Function(Strict):
    name: Name = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text = ""
    parameters: dict[str, JsonValue] = Field(default_factory=_any_object)
    """The arguments' JSON Schema: the call's arguments are sampled under it."""
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(Strict):
    name: Name


class NamedTool(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(Generation):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    """The conversation, rendered with the model's chat template."""
    tools: list[Tool] | None = Field(default=None, max_length=MAX_MESSAGES, fail_fast=True)
    """Functions the model may call: its answer is then sampled as calls (or a reply,
    with tool_choice "auto") under their schemas."""
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    """"auto" by default with tools; "required": at least one call; a named function: it."""
    parallel_tool_calls: bool = True
    """Several calls in one answer (false: at most one)."""
    functions: list[JsonValue] | None = Field(default=None, max_length=MAX_MESSAGES)
    """OpenAI's older tools: refused unless empty (send tools)."""
    logprobs: bool | None = None
    """Each answer token's log-probability, in `choices[].logprobs.content`."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """With `logprobs`: that many likeliest tokens at each position too."""

    @model_validator(mode="after")
    def _tools_named(self) -> ChatRequest:
        if self.functions:
            raise ValueError("functions is OpenAI's older form of tools: send tools instead")
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if isinstance(choice, NamedTool) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which no tool has")
        if choice in ("auto", "required") and not names:
            raise ValueError(f'tool_choice "{choice}" needs tools')
        if self.calls_tools and self.response_format and self.response_format.type != "text":
            raise ValueError("give tools or a response_format, not both")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.calls_tools and self.logprobs:
            raise ValueError("logprobs are given for text answers, not tool calls: leave one out")
        return self

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Generation):
    prompt: Text | TokenIds
    """Text, or token ids as they are."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Each answer token's log-probability and that many likeliest tokens' (0: only its
    own), in `choices[].logprobs`."""

    @property
    def logprobs_asked(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _not_empty(self) -> CompletionRequest:
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class DocumentRequest(Strict):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
    text: Text | None = None
    """The document (this or tokens)."""
    tokens: TokenIds | None = None
    """The document as token ids (this or text)."""
    instruction: Text | None = None
    """What to answer about it (default: "Summarize the text above.")."""
    max_tokens: int = Field(default=64, ge=1, le=MAX_TOKENS)
    """Tokens of the answer at most."""

    @model_validator(mode="after")
    def _one_source(self) -> DocumentRequest:
        if (self.text is None) == (self.tokens is None):
            raise ValueError("give exactly one of text and tokens")
        return self
