"""The scheduler state a policy sees, built the same way for either engine.

Each engine lists its requests as `Candidate`s (the runtime's `Scheduler` from its own
requests, the vLLM adapter from vLLM's running and waiting queues); `sched_state` turns them
into the one `SchedState`, so a policy decides from the same facts on both.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from edgeprefill.runtime.core.plan import IterationTiming, SchedState
from edgeprefill.runtime.core.request import CLASSES, RequestClass


@dataclass(frozen=True)
class Candidate:
    """One request as planning sees it, whichever engine holds it."""

    cls: RequestClass
    computed: int  # tokens in its KV cache (for a decode: its prompt and outputs fed back)
    prompt_left: int  # prompt tokens still to compute (0: it decodes)
    arrival_s: float  # on the clock `sched_state` is given `now_s` on
    ttft_target_s: float | None = None  # absolute, where its caller gave one
    admitted: bool = True  # holds a sequence (False: waiting for one)
    admissible: bool = True  # waiting, and a sequence and KV cells are free for it now
    ttft_slowdown: float | None = None  # relative: its first token within this x its alone
    output_left: int | None = None  # the most tokens it may still generate (None: unknown)

    @property
    def decodes(self) -> bool:
        return self.admitted and self.prompt_left == 0


def prompt_order(candidates: Sequence[Candidate]) -> Iterator[Candidate]:
    """Who computes prompt work first: foreground before background; within a class,
    started prompts (in the order given), then waiting ones in order until the first that
    cannot be admitted (FCFS: a long document is not starved by short ones)."""
    for cls in CLASSES:
        yield from (c for c in candidates if c.cls == cls and c.admitted and c.prompt_left)
        for c in candidates:
            if c.cls == cls and not c.admitted:
                if not c.admissible:
                    break
                yield c


def sched_state(
    candidates: Sequence[Candidate],
    n_batch: int,
    last: IterationTiming | None,
    now_s: float,
    may_defer: bool = True,
) -> SchedState:
    decodes = [c for c in candidates if c.decodes]
    head = next(prompt_order(candidates), None)
    fg = head if head is not None and head.cls == "foreground" else None
    return SchedState(
        n_prefill_running=sum(c.admitted and c.prompt_left > 0 for c in candidates),
        n_prefill_waiting=sum(not c.admitted for c in candidates),
        n_decode=len(decodes),
        n_decode_foreground=sum(c.cls == "foreground" for c in decodes),
        n_batch=n_batch,
        last=last,
        decode_ctx=sum(c.computed + 1 for c in decodes),
        next_prefill_pos=head.computed if head is not None else 0,
        next_prefill_left=head.prompt_left if head is not None else 0,
        decode_ctx_foreground=sum(c.computed + 1 for c in decodes if c.cls == "foreground"),
        foreground_prompt_left=fg.prompt_left if fg is not None else 0,
        foreground_prompt_pos=fg.computed if fg is not None else 0,
        foreground_waited_s=max(now_s - fg.arrival_s, 0.0) if fg is not None else 0.0,
        foreground_ttft_target_s=fg.ttft_target_s if fg is not None else None,
        foreground_ttft_slowdown=fg.ttft_slowdown if fg is not None else None,
        foreground_decode_ends=min(
            (c.output_left for c in decodes if c.cls == "foreground" and c.output_left is not None),
            default=None,
        ),
        may_defer=may_defer,
    )
