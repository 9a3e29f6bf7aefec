"""One request as planning sees it, whichever engine holds it, and the order prompts
compute in: the one row type and the one ordering both the decision (`planner`) and the
plan (`planning`) read, so the prompt a policy sizes is the prompt the plan computes.

Each engine lists its requests as `Candidate`s: the runtime's `Scheduler` from its own
requests, the vLLM adapter from vLLM's running and waiting queues.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from edgeprefill.runtime.core.request import CLASSES, RequestClass


@dataclass  # not frozen: one is built every iteration (see core/plan.py)
class Candidate:
    id: str
    cls: RequestClass
    computed: int  # tokens in its KV cache (for a decode: its prompt and outputs fed back)
    prompt_left: int  # prompt tokens still to compute (0: it decodes)
    arrival_s: float  # on the clock `sched_state` is given `now_s` on
    ttft_target_s: float | None = None  # absolute, where its caller gave one
    admitted: bool = True  # holds a sequence (False: waiting for one)
    admissible: bool = True  # waiting, and a sequence and KV cells are free for it now
    ttft_slowdown: float | None = None  # relative: its first token within this x its alone
    output_left: int | None = None  # the most tokens it may still generate (None: unknown)
    constrained: bool = False  # its tokens are sampled under a grammar
    outputs: int = 0  # output tokens so far: deferred background decodes go round robin
    # The most prompt tokens its next chunk may take, where fewer than prompt_left (on
    # llama.cpp, up to a shared prefix's save point). None: prompt_left.
    chunk_limit: int | None = None

    @property
    def decodes(self) -> bool:
        return self.admitted and self.prompt_left == 0

    @property
    def next_chunk_max(self) -> int:
        return self.prompt_left if self.chunk_limit is None else self.chunk_limit


def prompt_order(candidates: Sequence[Candidate]) -> Iterator[Candidate]:
    """Who computes prompt work, first first: foreground before background; within a
    class, the started prompts in the order given (admission order), then the waiting ones
    in the order given (arrival) up to the first that cannot be admitted now (FCFS: a long
    document is not starved by short ones behind it)."""
    for cls in CLASSES:
        yield from (c for c in candidates if c.cls == cls and c.admitted and c.prompt_left)
        for c in candidates:
            if c.cls == cls and not c.admitted:
                if not c.admissible:
                    break
                yield c
