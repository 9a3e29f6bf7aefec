"""The OpenAI request bodies this server accepts, and how they map onto the runtime.

Unknown fields are ignored, as OpenAI-compatible servers do (clients send `user`,
`logprobs: false` and others); fields with a value this server cannot honour (n > 1) are
refused with a 400 that names them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeprefill.runtime.core.request import RequestClass, SamplingParams

MAX_TOKENS_DEFAULT = 256


class StreamOptions(BaseModel):
    include_usage: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: the text ones
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class Generation(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    # vLLM's field: lower runs first; here <= 0 is foreground (a chat), > 0 background.
    priority: int = 0
    # edgeprefill's extensions: the first token wanted this many ms after arrival, and a
    # document given to /v1/documents that the request asks about (only the question is
    # computed once the document has been read).
    ttft_target_ms: float | None = Field(default=None, gt=0)
    document_id: str | None = None
    # vLLM's and llama-server's extension: keep generating past end-of-text (benchmarks).
    ignore_eos: bool = False

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
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.seed or 0)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(Generation):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Generation):
    prompt: str | list[int]

    @model_validator(mode="after")
    def _not_empty(self) -> CompletionRequest:
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class DocumentRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    tokens: list[int] | None = None
    instruction: str | None = None
    max_tokens: int = Field(default=64, ge=1)

    @model_validator(mode="after")
    def _one_source(self) -> DocumentRequest:
        if (self.text is None) == (self.tokens is None):
            raise ValueError("give exactly one of text and tokens")
        return self
