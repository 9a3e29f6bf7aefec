"""The backend seam: one planned iteration in, sampled tokens and completed time out.

Everything a backend needs from the runtime is here, so backends import only the core.

The runtime owns all scheduling; a backend only owns the device's resources (weights, KV
cache, batch buffers, samplers) and runs exactly the batch it is given.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from edgeprefill.runtime.core.plan import IterationTiming, Plan
from edgeprefill.runtime.core.planning import Chunking
from edgeprefill.runtime.core.request import SamplingParams, TokenLogprob
from edgeprefill.runtime.core.resource import Closeable


@dataclass(frozen=True)
class Capacity:
    """What the backend can hold at once."""

    n_batch: int  # most tokens in one forward pass
    n_ctx: int  # KV cells of all sequences together
    n_seq_max: int  # sequences at once
    n_ctx_seq: int  # KV cells one sequence may hold (n_ctx when the pool is shared)
    # Prompt chunk sizes that keep greedy output independent of the budget. A backend whose
    # kernels compute some piece sizes differently (ggml's CPU attention for short pieces,
    # its repacked matmuls for rows beyond a multiple of four) sets these from what it
    # measured; the scheduler then never plans a chunk, nor leaves a remainder, shorter
    # than min_chunk, and cuts a prompt only at multiples of chunk_quantum (a prompt's last
    # piece may have any size), unless the budget itself is below min_chunk.
    min_chunk: int = 1
    max_chunk: int | None = None  # most prompt tokens of one request per iteration
    chunk_quantum: int = 1

    @functools.cached_property
    def chunking(self) -> Chunking:
        return Chunking(self.n_batch, self.min_chunk, self.chunk_quantum, self.max_chunk)

    def __post_init__(self) -> None:
        values = (self.n_batch, self.n_ctx, self.n_seq_max, self.n_ctx_seq, self.min_chunk)
        if min(*values, self.chunk_quantum, self.max_chunk or 1) < 1:
            raise ValueError(f"capacity values must be positive: {self}")


@dataclass  # not frozen: one is built every iteration (see core/plan.py)
class SeqWork:
    """One sequence's slice of an iteration's batch."""

    seq_id: int
    tokens: list[int]
    pos: int  # position of tokens[0]; each sequence continues at its last position + 1
    sample: SamplingParams | None  # sample a token after the last one, with these params

    @property
    def is_decode(self) -> bool:
        return len(self.tokens) == 1 and self.sample is not None

    @property
    def ctx_work(self) -> int:
        return ctx_work(len(self.tokens), self.pos)


def ctx_work(n: int, pos: int) -> int:
    """KV cells `n` tokens from position `pos` attend to: positions pos+1 .. pos+n, summed."""
    return n * pos + n * (n + 1) // 2


def timing_of(
    work: list[SeqWork], duration_s: float, plan: Plan | None = None, host_s: float | None = None
) -> IterationTiming:
    """A completed iteration's timing, its composition counted from the batch it ran (one
    pass over the work: this runs between two device calls, where a chat's token waits)
    and its classes from the `plan` it ran."""
    n_decode = n_prefill = n_chunks = ctx_work = n_sampled = n_constrained = 0
    for w in work:
        ctx_work += w.ctx_work
        if w.sample is not None:
            n_sampled += 1
            n_constrained += w.sample.output_format is not None
        if w.is_decode:
            n_decode += 1
        else:
            n_prefill += len(w.tokens)
            n_chunks += 1
    return IterationTiming(
        duration_s=duration_s,
        n_decode=n_decode,
        n_prefill=n_prefill,
        n_decode_foreground=0 if plan is None else plan.n_decode_foreground,
        budget=None if plan is None else plan.budget,
        n_chunks=n_chunks,
        ctx_work=ctx_work,
        n_sampled=n_sampled,
        host_s=host_s,
        n_prefill_foreground=0 if plan is None else plan.n_prefill_foreground,
        n_constrained=n_constrained,
    )


class Tokenizer(Protocol):
    """The model's own tokenizer, as workloads need it to build prompts."""

    vocab_size: int

    def encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str:
        """Text of token ids (a document's answer, read whole)."""
        ...

    def chat_parts(self, system: str | None) -> tuple[str, str]:
        """The model's chat template around one user message: (text before, text after)."""
        ...

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """A conversation ({role, content} messages, and an assistant's `tool_calls`) in
        the model's chat template, ending where the assistant's answer starts; `tools`
        (OpenAI's function tools) where `tool_calls_form()` says the template takes them."""
        ...

    def tool_calls_form(self) -> str:
        """The form of tool calls the chat template describes `tools` in and reads calls
        in, where this backend can hold an answer to it: "tagged" (JSON between
        <tool_call> tags: Hermes 2 Pro, Qwen 2.5 and 3), "llama3" (Llama 3.x's bare JSON
        call), else "json" (the generic form, the tools in the system text)."""
        ...

    def piece(self, token: int) -> bytes:
        """The bytes one token stands for; text is their concatenation, decoded."""
        ...

    def is_normal(self, token: int) -> bool:
        """A plain text token (not control, byte or unused), for synthetic prompts."""
        ...

    def is_eog(self, token: int) -> bool: ...


def plain_transcript(messages: list[dict[str, Any]]) -> str:
    """A conversation as plain text a base model (one without a chat template) continues."""
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(m["content"] + "\n\n")
        else:
            parts.append(("User: " if m["role"] == "user" else "Assistant: ") + m["content"] + "\n")
    return "".join(parts) + "Assistant:"


@dataclass  # not frozen: one is built every iteration (see core/plan.py)
class IterationResult:
    duration_s: float  # the completed forward pass, measured where the work finishes
    sampled: dict[int, int]  # sequence id -> sampled token, for work that asked for one
    # Set when the iteration was aborted part-way (preempted for a foreground arrival):
    # sequence id -> prompt tokens of its slice that were computed and kept in the KV cache.
    kept: dict[int, int] | None = None
    # sequence id -> the sampled token's log-probabilities, where its sampling asked
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)

    @property
    def preempted(self) -> bool:
        return self.kept is not None


class PrefixCache(Protocol):
    """Keeps the KV state of computed prompt prefixes for later requests: what the indexer
    computed for a document is reused when a chat asks about it."""

    def save(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Keep the state of `seq_id`, which holds exactly `tokens` (positions 0..n-1)."""
        ...

    def restore(
        self, seq_id: int, prompt: Sequence[int], boundary: Callable[[int], int] = int
    ) -> int:
        """Put the kept state sharing the longest prefix with `prompt` (shorter than it)
        into the empty sequence `seq_id`, cut back to `boundary(shared tokens)` (a piece
        boundary); the number of tokens restored (0: none, the sequence stays empty)."""
        ...

    def clear(self) -> None:
        """Forget every kept prefix (a replay that must start from nothing)."""
        ...

    def flush(self) -> None:
        """Return once every kept prefix queued for disk is written (or given up)."""
        ...

    def describe(self) -> dict[str, Any]: ...


class BackendError(RuntimeError):
    """The device refused an iteration; the requests in it fail, the run goes on."""


class Backend(Closeable, ABC):
    name: str
    capacity: Capacity
    tokenizer: Tokenizer
    # A backend with its own clock (the simulated one's is virtual) sets it; runs on it
    # then stamp every time with that clock instead of the wall clock.
    clock: Any = None

    # Whether `execute` can stop the prompt work of an iteration part-way when its `abort`
    # flag is set. Decode tokens are never stopped: they are computed (and sampled) first,
    # and the flag is only watched while prompt chunks compute.
    supports_abort: bool = False
    # Saved prompt prefixes (None: every prompt is computed from its first token).
    prefix_cache: PrefixCache | None = None

    @abstractmethod
    def execute(
        self, work: Sequence[SeqWork], abort: threading.Event | None = None
    ) -> IterationResult:
        """Run one iteration holding every slice of `work` in one forward pass. With an
        `abort` flag (only ever for prompt work), a backend that `supports_abort` stops
        soon after it is set and reports in `IterationResult.kept` what it kept."""

    @abstractmethod
    def release(self, seq_id: int) -> None:
        """Forget a finished or cancelled sequence: its KV cells and sampler state."""

    def check_sampling(self, sampling: SamplingParams) -> None:
        """ValueError naming what this backend cannot sample as asked (a schema it cannot
        enforce). Called before a request is queued, so its caller gets the error rather
        than a request that fails once its prompt is computed. Here: no output format."""
        if sampling.output_format is not None:
            raise ValueError(f"the {self.name} backend cannot enforce an output format")

    # Whether a finished sequence's KV may stay in the context for a later prompt that
    # starts with its tokens (`reuse`); False: every sequence is released when it ends.
    keeps_sequences: bool = False

    def park(self, seq_id: int) -> None:
        """A sequence's request ended and its KV stays for a later prompt: free what was
        the request's own (its sampler)."""

    def reuse(self, seq_id: int, n_tokens: int) -> int:
        """Start a new request on a kept sequence: cut it back to its first `n_tokens`
        positions and forget its sampler. Returns the tokens it then holds exactly; 0 where
        they cannot be (the sequence is emptied, and the prompt computed from its start)."""
        self.release(seq_id)
        return 0

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Backend and model facts for summary.json."""

    @abstractmethod
    def close(self) -> None:
        """Free native resources; idempotent."""
