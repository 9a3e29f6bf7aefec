"""A request and its life: waiting -> prefill -> decode -> finished (or failed).

The scheduler changes these fields; everything else (metrics, result files) reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

RequestClass = Literal["foreground", "background"]
CLASSES: tuple[RequestClass, ...] = ("foreground", "background")
# A chat's first token is wanted within this multiple of what its prompt takes alone on the
# device at hand, so the target follows the device: an absolute 1 s, tuned on a fast CPU,
# was all or nothing on one half as fast (issue 23). Background requests have no target.
# Workloads and callers may give an absolute target instead, or another multiple.
# The one home of the default, for workloads, the API, the policies and the iteration limit.
FOREGROUND_SLOWDOWN = 3.0
DEFAULT_TTFT_SLOWDOWN: dict[RequestClass, float | None] = {
    "foreground": FOREGROUND_SLOWDOWN,
    "background": None,
}


@dataclass(frozen=True)
class OutputFormat:
    """What the output must be, enforced while sampling (OpenAI's `response_format`): any
    JSON object (`schema` None), or JSON that fits `schema` (a JSON Schema, as JSON text).
    With a `tag`, the JSON is written between `<tag>` and `</tag>` lines, once or, with
    `repeat`, once or more (tool calls in a Hermes-style template's form). With `or_text`
    the answer may instead be any text that does not open as the JSON does: with `<tag>`,
    or without a tag with `{` (a reply where calls are optional). Each backend turns it into its own constraint: a
    grammar on llama.cpp, vLLM's structured outputs on vLLM (JSON alone)."""

    schema: str | None = None
    tag: str | None = None
    repeat: bool = False
    or_text: bool = False


# OpenAI's bound on `top_logprobs`; llama-server and vLLM take more, clients ask for a few.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model's distribution (its logits'
    log-softmax, before any sampling step changes them, as llama-server reports by
    default), and the likeliest tokens' (token id, log-probability), likeliest first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when `temperature` is 0 (the default, so runs are exactly reproducible). The
    other fields are OpenAI's and llama.cpp's, applied in llama.cpp's order: bias,
    penalties (over the output so far), the format, top-k, top-p, min-p, temperature."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    output_format: OutputFormat | None = None
    # None: no log-probabilities; k: each sampled token's and the k likeliest tokens'.
    logprobs: int | None = None
    # The token is the logits' argmax: greedy, nothing changing the logits first. Read for
    # every sampled row, between two device calls: computed once.
    argmax: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        plain = not self.logit_bias and self.output_format is None and not self.penalized
        object.__setattr__(self, "argmax", self.greedy and plain)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repeat_penalty != 1)


class Status(Enum):
    WAITING = "waiting"  # arrived, holds no sequence slot yet
    PREFILL = "prefill"  # holds a slot, prompt partly in the KV cache
    DECODE = "decode"  # prompt done, one token per iteration
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(eq=False)
class Request:
    id: str
    cls: RequestClass
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    ignore_eos: bool = False
    after: str | None = None  # closed loop: arrives `think_s` after this request finished
    think_s: float = 0.0
    # A conversation's next turn (closed loop): `prompt` holds only what is new (the
    # template's text after an answer, the question, the text before the next answer)
    # until the turn before it has answered; see `follow`.
    continues: bool = False
    source: str | None = None  # where the prompt came from (a document piece)
    ttft_target_s: float | None = None  # absolute: first token wanted this soon after arrival
    ttft_slowdown: float | None = None  # relative: within this multiple of `ttft_alone_s`
    # Prompt tokens worth keeping for later requests (a document before its instruction):
    # their KV state is saved once computed, where the backend keeps prefixes.
    share_prefix: int | None = None

    status: Status = Status.WAITING
    seq_id: int | None = None
    num_computed: int = 0  # prompt tokens already in the KV cache
    output: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # by output token, if asked
    finish_reason: str | None = None  # "stop" (end-of-generation token) or "length"
    error: str | None = None
    # Prompt tokens not computed: continued from a kept sequence or restored from a saved
    # prefix (`usage.prompt_tokens_details.cached_tokens`).
    prefix_reused_tokens: int = 0
    restore_s: float | None = None  # how long restoring them took
    ttft_alone_s: float | None = None  # its prompt alone on this device (the engine's estimate)
    # len(prompt), kept: planning reads it several times an iteration, between two device
    # calls (a property call each), and a prompt never changes.
    prompt_len: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt)

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_len - self.num_computed

    @property
    def kv_cells(self) -> int:
        """KV cells this request can ever occupy: its prompt plus every output token that
        is fed back (the last sampled token never is). Reserved at admission, so a running
        request can never run out of cache."""
        return self.prompt_len + self.max_tokens - 1

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.FAILED)

    @property
    def decode_tokens_fed(self) -> int:
        """Output tokens fed back as decode inputs so far (all but the newest)."""
        return max(len(self.output) - 1, 0)

    def held_tokens(self) -> list[int]:
        """The tokens whose KV its sequence holds, in position order: the prompt computed
        so far, then (once the prompt is done) every output token fed back."""
        if self.num_computed < self.prompt_len:
            return self.prompt[: self.num_computed]
        return self.prompt + self.output[: self.decode_tokens_fed]

    def follow(self, before: Request, answer: list[int]) -> None:
        """Released after `before` answered with `answer` (its tokens as the client holds
        them: without an end-of-generation token, or re-tokenized from text): a
        conversation's turn resends `before`'s prompt and that answer ahead of its own new
        part, as every client of a stateless chat API does."""
        if self.continues:
            self.prompt = before.prompt + answer + self.prompt
            self.prompt_len = len(self.prompt)

    def stop_after(self, kept: int) -> None:
        """Finished at a stop its reader found: the answer is its first `kept` tokens."""
        del self.output[kept:], self.token_times_s[kept:], self.logprobs[kept:]
        self.finish_reason, self.status = "stop", Status.FINISHED

    def fail(self, reason: str) -> None:
        self.status = Status.FAILED
        self.error = reason

    def record(self) -> dict[str, Any]:
        """The request's line in requests.jsonl (the result contract)."""
        return {
            "id": self.id,
            "class": self.cls,
            "arrival_s": self.arrival_s,
            "prompt_tokens": self.prompt_len,
            "prefilled_tokens": self.num_computed - self.prefix_reused_tokens,
            "prefix_reused_tokens": self.prefix_reused_tokens,
            "max_tokens": self.max_tokens,
            "output_token_ids": list(self.output),
            "token_times_s": list(self.token_times_s),
            "finish_reason": self.finish_reason,
            "error": self.error,
            **({"after": self.after, "think_s": self.think_s} if self.after else {}),
            **({"continues": True} if self.continues else {}),
            **({"source": self.source} if self.source else {}),
            **({"ttft_target_s": self.ttft_target_s} if self.ttft_target_s is not None else {}),
            **({"ttft_slowdown": self.ttft_slowdown} if self.ttft_slowdown is not None else {}),
            **({"ttft_alone_s": self.ttft_alone_s} if self.ttft_alone_s is not None else {}),
            **({"restore_s": self.restore_s} if self.restore_s is not None else {}),
        }
