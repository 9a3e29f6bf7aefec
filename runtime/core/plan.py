"""Plain values that cross the seams of one iteration.

`SchedState` and `IterationTiming` are all a budget policy may see; `Decision` is what it
answers, once per iteration; `Plan` is what the scheduler made of that decision, printable
and testable, before any backend runs it.

These, and the other values built once per iteration (`Candidate`, `SeqWork`,
`IterationResult`, the engine's `Executed`, `Iteration`, `IterationSpan`), are plain dataclasses,
not frozen ones: they are built between two device calls, where a chat's next token waits,
and a frozen dataclass sets each field through `object.__setattr__`, which took about twice
as long there (benchmarks/history.md, section M). Nothing changes one after it is built
(a changed one is a copy).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class IterationTiming:
    """One completed iteration, timed around the work that actually finished
    (synchronously around `llama_decode` on a CPU), never the scheduler's cadence."""

    duration_s: float
    n_decode: int  # decode tokens in it (one per running decode)
    n_prefill: int  # prompt tokens in it
    n_decode_foreground: int = 0
    budget: int | None = None  # the cap that was in force
    n_chunks: int = 0  # prompt chunks in it (on llama.cpp each is a pass over the weights)
    ctx_work: int = 0  # attention work: KV cells attended, summed over its tokens
    # Rows whose logits were computed and sampled: every decode, plus each chunk that ends
    # its prompt. None (records written before it existed): the decodes.
    n_sampled: int | None = None
    # Host time since the previous device call (planning, bookkeeping) and in the backend's
    # call besides its device time (filling the batch, sampling): a foreground token waits
    # for it as well as for the device. After an idle wait, only the latter.
    host_s: float | None = None
    # Of n_prefill, the foreground's prompt tokens: a chat's chunk is shallow and cheap to
    # predict, a document's deep one is not, so policies may weigh their errors apart.
    n_prefill_foreground: int = 0
    # Of the sampled rows, those sampled under a grammar (a JSON schema, a tool call): each
    # can cost the host milliseconds a token waits for (`costs.host.HostCost`).
    n_constrained: int = 0

    @property
    def sampled(self) -> int:
        return self.n_decode if self.n_sampled is None else self.n_sampled


@dataclass
class SchedState:
    """What the scheduler looks like before an iteration is planned."""

    n_prompts_running: int  # requests holding a slot with prompt left
    n_prompts_waiting: int  # arrived requests without a slot yet
    n_decode: int  # requests that will get a decode token this iteration
    n_decode_foreground: int
    n_batch: int  # the most tokens one iteration can hold
    last: IterationTiming | None = None
    decode_ctx: int = 0  # KV cells the decodes will attend to, summed
    next_prompt_pos: int = 0  # where the next prompt chunk would start in its sequence
    next_prompt_left: int = 0  # prompt tokens that request has left (0: no prompt waits)
    decode_ctx_foreground: int = 0  # the foreground decodes' share of decode_ctx
    # The first foreground prompt waiting for its first token (0 left: none): a TTFT target
    # runs from its arrival.
    foreground_prompt_left: int = 0
    foreground_prompt_pos: int = 0
    foreground_waited_s: float = 0.0
    foreground_ttft_target_s: float | None = None  # that request's own absolute target
    foreground_ttft_slowdown: float | None = None  # and its relative one
    foreground_prompts_behind: int = 0  # other foreground prompts waiting for their first token
    # The fewest tokens any foreground decode may still generate: within as many iterations
    # one of them is certain to end (None: no foreground decode, or no bound known).
    foreground_decode_ends: int | None = None
    # Whether background decodes may be left out of this iteration (the planner bounds how
    # many iterations in a row they are).
    may_defer: bool = True
    # Of n_decode, the decodes sampled under a grammar, and the foreground's share of them.
    n_constrained: int = 0
    n_constrained_foreground: int = 0

    @property
    def n_decode_background(self) -> int:
        return self.n_decode - self.n_decode_foreground

    def without_background_decodes(self, riders: int = 0) -> SchedState:
        """The state as an iteration that defers the background's decodes (all but
        `riders` of them, each attending to their mean context) will see it."""
        background_ctx = self.decode_ctx - self.decode_ctx_foreground
        background_constrained = self.n_constrained - self.n_constrained_foreground
        share = riders / self.n_decode_background if self.n_decode_background else 0.0
        # A copy with three fields set: `dataclasses.replace` (which rebuilds all 20 through
        # `__init__`) cost ~6x as much, in most iterations beside a document's decode.
        state = copy.copy(self)
        state.n_decode = self.n_decode_foreground + riders
        state.decode_ctx = self.decode_ctx_foreground + round(background_ctx * share)
        state.n_constrained = self.n_constrained_foreground + round(background_constrained * share)
        return state


@dataclass
class Decision:
    """What a policy (and the thermal guard) decided for one iteration: the one value either
    engine's scheduler turns into a plan, written to iterations.jsonl as it is."""

    budget: int | None = None  # most prompt tokens in the iteration (None: fill n_batch)
    # The least prompt tokens the first waiting foreground prompt gets, whatever the budget,
    # so it meets its TTFT target (None: the budget alone).
    floor: int | None = None
    # How many of the background's decodes ride, those with the fewest output tokens first
    # (None: all; 0: they wait).
    background_decodes: int | None = None
    background_cap: int | None = None  # a further cap on background prompt tokens (thermal)
    # With no budget, a foreground prompt goes alone (its first token waits for every token
    # beside it). False only for a policy that leaves batching to the backend (`unlimited`).
    foreground_alone: bool = True
    reason: str = ""  # why, in a few words, for a reader of iterations.jsonl

    @property
    def defers_background_decodes(self) -> bool:
        return self.background_decodes == 0

    @property
    def constrains(self) -> bool:
        """Whether it asks anything of the batch beyond the backend's own batching."""
        return not (
            self.budget is None
            and self.floor is None
            and self.background_decodes is None
            and self.background_cap is None
            and not self.foreground_alone
        )

    def record(self) -> dict[str, Any]:
        # Every field, in order: dataclasses.asdict costs ~30 us, and this runs every
        # iteration.
        return dict(vars(self))

    def __str__(self) -> str:
        parts = [f"budget={'none' if self.budget is None else self.budget}"]
        if self.floor is not None:
            parts.append(f"floor={self.floor}")
        if self.background_decodes is not None:
            parts.append(f"background_decodes={self.background_decodes}")
        if self.background_cap is not None:
            parts.append(f"background_cap={self.background_cap}")
        return f"Decision({', '.join(parts)}: {self.reason or 'no reason given'})"


@dataclass
class Plan:
    """One iteration: every running decode's token, then prompt chunks as `decision` allows.

    `decode` and `prefill` keep scheduling order; `prefill` maps request id -> prompt tokens.
    """

    decision: Decision
    decode: tuple[str, ...] = ()
    prefill: dict[str, int] = field(default_factory=dict)
    deferred: tuple[str, ...] = ()  # background decodes left out of this iteration
    foreground: AbstractSet[str] = frozenset()  # which of its requests are foreground
    # Counted once, when the plan is made: an iteration reads them several times between
    # two device calls. A plan is not changed after it is made (`replace` makes one).
    n_prefill: int = field(init=False, repr=False)
    n_prefill_foreground: int = field(init=False, repr=False)
    n_decode_foreground: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.n_prefill = sum(self.prefill.values())
        self.n_prefill_foreground = sum(
            n for rid, n in self.prefill.items() if rid in self.foreground
        )
        self.n_decode_foreground = sum(rid in self.foreground for rid in self.decode)

    @property
    def n_prefill_background(self) -> int:
        return self.n_prefill - self.n_prefill_foreground

    @property
    def budget(self) -> int | None:
        return self.decision.budget

    @property
    def n_decode(self) -> int:
        return len(self.decode)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """request id -> tokens this iteration (vLLM's name for the same thing)."""
        return {**{rid: 1 for rid in self.decode}, **self.prefill}

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    def __str__(self) -> str:
        chunks = ", ".join(f"{rid}: {n}" for rid, n in self.prefill.items())
        return f"Plan({self.decision}, decode=[{', '.join(self.decode)}], prefill={{{chunks}}})"


def riders(background: Sequence[T], decision: Decision, outputs: Callable[[T], int]) -> list[T]:
    """The background decodes that ride in an iteration under `decision`: none when it
    are left out, else at most `background_decodes` of them, the fewest output tokens first
    (so those left out one iteration go first the next: a round robin), in their order."""
    n = decision.background_decodes
    if n is None or n >= len(background):
        return list(background)
    first = sorted(range(len(background)), key=lambda i: outputs(background[i]))[:n]
    return [background[i] for i in sorted(first)]
