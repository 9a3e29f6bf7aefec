"""Small builders for scheduler tests (no model needed)."""

from __future__ import annotations

from edgeprefill.runtime.core.contract import Capacity
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.iteration import Iteration
from edgeprefill.runtime.core.plan import Decision, Plan
from edgeprefill.runtime.core.request import Request, RequestClass
from edgeprefill.runtime.core.scheduler import BackgroundLimits, Scheduler

EOG = 1


def make_scheduler(
    n_batch: int = 512,
    n_ctx: int = 65536,
    n_seq_max: int = 8,
    n_ctx_seq: int | None = None,
    limits: BackgroundLimits | None = None,
    min_chunk: int = 1,
    max_chunk: int | None = None,
    chunk_quantum: int = 1,
) -> tuple[Scheduler, list[int]]:
    """A scheduler over a pretend device; returns it and the list of released sequences."""
    released: list[int] = []
    cap = Capacity(
        n_batch, n_ctx, n_seq_max, n_ctx_seq or n_ctx, min_chunk, max_chunk, chunk_quantum
    )
    return Scheduler(cap, lambda t: t == EOG, released.append, limits), released


def make_request(
    rid: str,
    cls: RequestClass = "foreground",
    prompt_len: int = 10,
    max_tokens: int = 4,
    arrival_s: float = 0.0,
    ignore_eos: bool = False,
) -> Request:
    return Request(
        rid, cls, arrival_s, list(range(100, 100 + prompt_len)), max_tokens, ignore_eos=ignore_eos
    )


def plan(sched: Scheduler, budget: int | None = None, **decision) -> Plan:
    """Admit what may start, then plan one iteration under `Decision(budget, ...)`."""
    for _ in sched.admit():
        pass
    return sched.plan(Decision(budget, **decision))


def run_plan(sched: Scheduler, budget: int | None, token: int = 7, now: float = 0.0):
    """Plan one iteration and pretend the device sampled `token` wherever asked."""
    planned = plan(sched, budget)
    work = sched.work(planned)
    sampled = {w.seq_id: token for w in work if w.sample is not None}
    finished = sched.update(planned, sampled, now)
    return planned, work, finished


def drain(engine: Engine, requests: list[Request]) -> list[Iteration]:
    """Submit everything at once and step until all requests are done."""
    for r in requests:
        engine.add(r)
    iterations = []
    while engine.has_work:
        it = engine.iterate()
        assert it is not None, "scheduler stalled with work left"
        iterations.append(it)
    return iterations
