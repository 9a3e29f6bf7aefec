"""A decision becomes a plan: one pure function, the same on both engines.

The llama.cpp scheduler lists its running requests, the vLLM adapter vLLM's running and
admissible waiting ones, each as the `Candidate` its decision was made from; `make_plan`
applies the rules every iteration follows (decodes first, background decodes deferred as
decided, foreground prompts before background ones, the first foreground prompt's floor,
the background cap, a chat's prompt alone when no budget was set, chunks cut only where
greedy output stays the same) and returns the `Plan`. llama.cpp runs it; vLLM's `_reserve_prefill_lookahead` grants each
request its share of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edgeprefill.runtime.core.candidate import Candidate, prompt_order
from edgeprefill.runtime.core.plan import Decision, Plan, riders


@dataclass(frozen=True)
class Chunking:
    """The sizes a plan may use: tokens per iteration, and prompt pieces that keep greedy
    output independent of the budget (see `Capacity`)."""

    n_batch: int
    min_chunk: int = 1
    chunk_quantum: int = 1
    max_chunk: int | None = None


def make_plan(decision: Decision, rows: Sequence[Candidate], chunking: Chunking) -> Plan:
    """Decode tokens first, then prompt chunks up to the budget (None: fill n_batch), of
    which background prompts get at most `background_cap`; the first foreground prompt gets
    at least `floor` tokens (sized by its TTFT target), which leaves the background that
    much less; with no budget and `foreground_alone`, no background prompt rides beside a
    foreground one. Background decodes are left out when the decision defers them. Prompts
    compute foreground first, each class in the order of `rows` (admission order: a long
    document is not starved by short ones)."""
    decoding = [r for r in rows if r.prompt_left == 0]
    deferred: tuple[str, ...] = ()
    if decision.background_decodes is not None:  # some background decodes may wait
        background = [r for r in decoding if r.cls == "background"]
        riding = {r.id for r in riders(background, decision, _outputs)}
        deferred = tuple(r.id for r in background if r.id not in riding)
    decode = tuple(r.id for r in decoding if r.id not in deferred)
    foreground = frozenset(r.id for r in rows if r.cls == "foreground")
    budget, background_cap = decision.budget, decision.background_cap
    room = chunking.n_batch - len(decode)
    left = budget_cap = room if budget is None else max(0, min(budget, room))
    if left == 0 and not decision.floor:  # most iterations beside a chat's decodes
        return Plan(decision, decode, {}, deferred, foreground)
    background_left = background_allowed = (
        left if background_cap is None else min(background_cap, left)
    )
    prefill: dict[str, int] = {}
    foreground_planned = False  # a foreground prompt chunk is planned
    for row in prompt_order(rows):
        floor = (decision.floor or 0) if row.cls == "foreground" and not foreground_planned else 0
        if left == 0 and not floor:
            break
        if (
            row.cls == "background"
            and budget is None
            and foreground_planned
            and decision.foreground_alone
        ):
            # A chat's prompt is in this iteration and no policy sized the rest: its
            # first token waits for every background token beside it, so none ride.
            break
        if row.cls == "background":
            avail, full = (
                min(left, background_left),
                left == budget_cap and background_left == background_allowed,
            )
        elif floor > left:
            avail, full = min(floor, room - sum(prefill.values())), True
        else:
            avail, full = left, left == budget_cap
        n = _chunk(chunking, row.next_chunk_max, avail, full, room) if avail else 0
        if n == 0:
            continue
        prefill[row.id] = n
        foreground_planned = foreground_planned or row.cls == "foreground"
        left = max(left - n, 0)
        if row.cls == "background":
            background_left -= n
    return Plan(decision, decode, prefill, deferred, foreground)


def _outputs(row: Candidate) -> int:
    return row.outputs


def _chunk(chunking: Chunking, remaining: int, left: int, full: bool, room: int) -> int:
    """The largest chunk within `left` that is a multiple of `chunk_quantum`, not shorter
    than `min_chunk`, and leaves no shorter remainder, so every piece is computed the same
    way whatever the budget. 0 means wait for a larger leftover; a request given the whole
    budget always progresses. The last tokens of a prompt that no budget below them can
    cut into valid pieces are taken whole (exceeding the budget by less than two pieces'
    minimum) rather than computed as a short piece."""
    hard = min(room, chunking.max_chunk or room)
    cap = min(left, hard)
    if remaining <= cap:
        return remaining
    lo, q = chunking.min_chunk, chunking.chunk_quantum
    n = min(cap, remaining - lo) // q * q
    if n >= lo:
        return n
    shortest = -(-lo // q) * q  # the shortest piece that is not a prompt's last
    if full and remaining - lo < shortest and remaining <= hard:
        return remaining
    return cap if full else 0
