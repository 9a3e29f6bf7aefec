"""Continuous batching with a per-iteration prefill budget.

There is no prefill phase and no decode phase: each iteration every running decode gets its
one token (decode first, so a chat never stalls behind a document), then prompt chunks fill
what the budget allows, foreground prompts before background ones; with no budget (the
policy set no cap), an iteration that holds a foreground prompt holds no background prompt
work. A foreground prompt that arrives while a document is being read is served from the
next iteration on (and on llama.cpp the document's iteration in flight is stopped at its
next graph node): background work is preempted, never dropped.

Admission is check-then-act on two resources the backend reports: sequence slots and KV
cells. A request reserves every cell it can ever use when admitted, so a running request
never runs out of cache; background work may hold only some of the sequences and must leave
some cells free (`BackgroundLimits`), so a burst of documents cannot lock the assistant out.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from edgeprefill.runtime.core.candidate import Candidate
from edgeprefill.runtime.core.contract import Capacity, SeqWork
from edgeprefill.runtime.core.parked import ParkedSequences
from edgeprefill.runtime.core.plan import Decision, Plan
from edgeprefill.runtime.core.planning import make_plan
from edgeprefill.runtime.core.request import CLASSES, Request, RequestClass, Status, TokenLogprob


@dataclass(frozen=True)
class BackgroundLimits:
    """How much of the device background work may hold, so a burst of documents cannot
    lock the assistant out: sequences, and KV cells it must leave free for foreground."""

    max_seqs: int | None = None  # None: half of n_seq_max (at least 1)
    foreground_kv_cells: int | None = None  # None: an eighth of n_ctx

    def resolve(self, capacity: Capacity) -> tuple[int, int]:
        """(max background sequences, KV cells kept for foreground) for this device."""
        seqs = self.max_seqs if self.max_seqs is not None else max(capacity.n_seq_max // 2, 1)
        kv = self.foreground_kv_cells
        kv = kv if kv is not None else capacity.n_ctx // 8
        check_background_seqs(seqs, capacity.n_seq_max)
        if not 0 <= kv < capacity.n_ctx:
            raise ValueError(
                f"foreground KV reserve must be between 0 and n_ctx - 1 ({capacity.n_ctx - 1}), "
                f"got {kv}"
            )
        return seqs, kv


def check_background_seqs(seqs: int, n_seq_max: int) -> None:
    """Background work may hold 1 to n_seq_max sequences (a command line checks it before
    the model loads, `resolve` again for any caller)."""
    if not 1 <= seqs <= n_seq_max:
        raise ValueError(
            f"background sequences must be between 1 and n_seq_max ({n_seq_max}), got {seqs}"
        )


class Scheduler:
    def __init__(
        self,
        capacity: Capacity,
        is_eog: Callable[[int], bool],
        release: Callable[[int], None],
        limits: BackgroundLimits | None = None,
        keeps_prefixes: bool = False,
        parked: ParkedSequences | None = None,
    ) -> None:
        """`keeps_prefixes`: the backend saves prompt prefixes, so requests'
        `share_prefix` points are honoured: a chunk ends there so the state can be saved
        (`saves_due`). `parked`: where the sequences of requests that ended stay, for a
        later prompt that starts with their tokens (None: released at once)."""
        if capacity.n_seq_max > capacity.n_batch:
            raise ValueError(
                f"n_seq_max ({capacity.n_seq_max}) must not exceed n_batch "
                f"({capacity.n_batch}): every decode needs a batch slot"
            )
        self.capacity = capacity
        self.max_background_seqs, self.foreground_kv_cells = (limits or BackgroundLimits()).resolve(
            capacity
        )
        self._is_eog = is_eog
        self._release = release
        self._keeps_prefixes = keeps_prefixes
        self.parked = parked
        self.waiting: dict[RequestClass, deque[Request]] = {c: deque() for c in CLASSES}
        self.running: list[Request] = []  # admission order
        # The running ones by request id and by sequence, kept with `running` (not rebuilt
        # every iteration between two device calls).
        self.by_id: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._free_seqs = list(range(capacity.n_seq_max))  # a heap: lowest id first
        self._n_background = 0  # running background requests, kept with `running`
        self.kv_free = capacity.n_ctx

    # --- requests in ----------------------------------------------------------------
    def add(self, req: Request) -> bool:
        """Queue an arrived request, or fail it now if it could never run."""
        reason = self._never_fits(req)
        if reason:
            req.fail(reason)
            return False
        self.waiting[req.cls].append(req)
        return True

    def _never_fits(self, req: Request) -> str | None:
        if req.prompt_len == 0:
            return "empty prompt: nothing to prefill"
        if req.max_tokens < 1:
            return f"max_tokens must be at least 1, got {req.max_tokens}"
        cap = self.capacity
        limit, where = cap.n_ctx_seq, f"a sequence holds {cap.n_ctx_seq}"
        background_limit = cap.n_ctx - self.foreground_kv_cells
        if req.cls == "background" and background_limit < limit:
            limit, where = (
                background_limit,
                f"background work may use {background_limit} of {cap.n_ctx}",
            )
        if req.kv_cells > limit:
            return (
                f"prompt of {req.prompt_len} tokens plus {req.max_tokens} output tokens needs "
                f"{req.kv_cells} KV cells but {where}; give each sequence more cells (n_ctx) or "
                "shorten the prompt"
            )
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(self.waiting.values())

    # --- one iteration --------------------------------------------------------------
    def candidates(self) -> list[Candidate]:
        """Every request as planning sees it: running ones in admission order, then the
        waiting ones in arrival order."""
        out = [
            Candidate(
                r.id,
                r.cls,
                r.num_computed + r.decode_tokens_fed,
                r.remaining_prompt,
                r.arrival_s,
                r.ttft_target_s,
                ttft_slowdown=r.ttft_slowdown,
                output_left=r.max_tokens - len(r.output),
                constrained=r.sampling.output_format is not None,
                outputs=len(r.output),
                chunk_limit=self._left(r) if r.remaining_prompt else None,
            )
            for r in self.running
        ]
        for cls in CLASSES:
            out += [
                Candidate(
                    r.id,
                    r.cls,
                    0,
                    r.prompt_len,
                    r.arrival_s,
                    r.ttft_target_s,
                    admitted=False,
                    admissible=self._can_admit(r),
                    ttft_slowdown=r.ttft_slowdown,
                )
                for r in self.waiting[cls]
            ]
        return out

    def admit(self) -> Iterator[Request]:
        """Give a sequence to each waiting request the next iteration may start: in arrival
        order within a class, while one fits, and while the class's admitted prompt work is
        under one full batch (no iteration could reach a request beyond that, so it need not
        hold a sequence and KV cells yet). Lazy: the caller may restore each one's saved
        prefix, which leaves less prompt work, before the next is considered."""
        for cls in CLASSES:
            queue = self.waiting[cls]
            while (
                queue
                and self._can_admit(queue[0])
                and self._prompt_admitted(cls) < self.capacity.n_batch
            ):
                req = queue[0]
                self._admit(req)
                yield req

    def _prompt_admitted(self, cls: RequestClass) -> int:
        return sum(r.remaining_prompt for r in self.running if r.cls == cls)

    def plan(self, decision: Decision, candidates: list[Candidate] | None = None) -> Plan:
        """The decision as this iteration's plan (`make_plan`), over the running requests
        of `candidates` (those the decision was made from; None: as they are now)."""
        rows = [c for c in candidates or self.candidates() if c.admitted]
        return make_plan(decision, rows, self.capacity.chunking)

    def save_point(self, req: Request) -> int | None:
        """Where `req`'s shareable prefix is saved: its `share_prefix` cut down to a piece
        boundary (a multiple of `chunk_quantum`, no shorter than `min_chunk`), so the
        chunks before it and after a restore keep their measured shapes. None: not saved."""
        if not self._keeps_prefixes or req.share_prefix is None:
            return None
        point = self.piece_floor(min(req.share_prefix, req.prompt_len - 1))
        return point or None

    def piece_floor(self, n: int) -> int:
        """`n` cut down to a piece boundary (a multiple of `chunk_quantum`, no shorter than
        `min_chunk`; 0 where none is), where a prompt may be split and its chunks before
        and after keep the shapes the probe measured."""
        q = self.capacity.chunk_quantum
        point = n // q * q
        return point if point >= self.capacity.min_chunk else 0

    def _left(self, req: Request) -> int:
        """Prompt tokens the next chunk may take: up to the save point, if one is ahead."""
        point = self.save_point(req)
        if point is not None and req.num_computed < point:
            return point - req.num_computed
        return req.remaining_prompt

    def saves_due(self, plan: Plan) -> list[Request]:
        """Requests whose shareable prefix this iteration completed: save them now."""
        return [
            r
            for rid in plan.prefill
            if (r := self.by_id.get(rid)) is not None and r.num_computed == self.save_point(r)
        ]

    def _can_admit(self, req: Request) -> bool:
        if not self._free_seqs and not self.parked:
            return False
        if req.cls == "foreground":
            return req.kv_cells <= self.kv_free
        return (
            self._n_background < self.max_background_seqs
            and req.kv_cells <= self.kv_free - self.foreground_kv_cells
        )

    def _admit(self, req: Request) -> None:
        self.waiting[req.cls].remove(req)
        req.seq_id = self._sequence_for(req)
        req.status = Status.PREFILL
        self.kv_free -= req.kv_cells
        while self.parked and self.kv_free < self.parked.cells:  # the parked give their cells
            heapq.heappush(self._free_seqs, self._evict())
        self.running.append(req)
        self.by_id[req.id] = self._by_seq[req.seq_id] = req
        self._n_background += req.cls == "background"

    def _sequence_for(self, req: Request) -> int:
        """A parked sequence that holds a prefix of the request's prompt (the request then
        starts past it, at a piece boundary: its last prompt token is always computed, for
        its logits), else a free one, else the least recently used parked one, saved and
        released (a prefix cache may then restore part of it)."""
        parked, free = self.parked, self._free_seqs
        if parked:
            match = parked.match(np.asarray(req.prompt, dtype=np.int32))
            usable = 0 if match is None else self.piece_floor(min(match[1], req.prompt_len - 1))
            if match is not None and usable:
                req.num_computed = req.prefix_reused_tokens = parked.take(match[0], usable)
                return match[0]
        return heapq.heappop(free) if free else self._evict()

    def _evict(self) -> int:
        assert self.parked is not None
        seq_id = self.parked.evict()
        assert seq_id is not None
        return seq_id

    def work(self, plan: Plan) -> list[SeqWork]:
        """The plan as batch slices: token ids, positions, and where to sample."""
        by_id = self.by_id
        out: list[SeqWork] = []
        for rid in plan.decode:
            r = by_id[rid]
            pos = r.prompt_len + r.decode_tokens_fed
            out.append(SeqWork(_seq(r), [r.output[-1]], pos, r.sampling))
        for rid, n in plan.prefill.items():
            r = by_id[rid]
            chunk = r.prompt[r.num_computed : r.num_computed + n]
            last = r.num_computed + n == r.prompt_len
            out.append(SeqWork(_seq(r), chunk, r.num_computed, r.sampling if last else None))
        return out

    def update(
        self,
        plan: Plan,
        sampled: dict[int, int],
        now_s: float,
        logprobs: dict[int, TokenLogprob] | None = None,
    ) -> list[Request]:
        """Apply a completed iteration: advance prompts, append sampled tokens (keyed by
        sequence) and their log-probabilities where asked, finish requests that stopped.
        Returns the requests that finished."""
        for rid, n in plan.prefill.items():
            r = self.by_id[rid]
            r.num_computed += n
            if r.remaining_prompt == 0:
                r.status = Status.DECODE
        finished: list[Request] = []
        for seq, token in sampled.items():
            r = self._by_seq[seq]
            r.output.append(token)
            r.token_times_s.append(now_s)
            if logprobs and seq in logprobs:
                r.logprobs.append(logprobs[seq])
            if self._is_eog(token) and not r.ignore_eos:
                r.finish_reason = "stop"
            elif len(r.output) >= r.max_tokens:
                r.finish_reason = "length"
            else:
                continue
            r.status = Status.FINISHED
            self._retire(r)
            finished.append(r)
        return finished

    # --- failures -------------------------------------------------------------------
    def fail_plan(self, plan: Plan, reason: str) -> list[Request]:
        """Fail every request of an iteration the backend could not run."""
        ids = set(plan.num_scheduled_tokens)
        failed = [r for r in self.running if r.id in ids]
        for r in failed:
            r.fail(reason)
            self._retire(r, keep=False)  # what its cells hold is not known
        return failed

    def cancel(self, req: Request, reason: str = "cancelled") -> bool:
        """End one request now, waiting or running: its sequence, KV cells and sampler are
        freed before the next iteration; the others are untouched. False if it had
        already ended (or was never added)."""
        if req.done:
            return False
        if req in self.running:
            req.fail(reason)
            self._retire(req)
            return True
        queue = self.waiting[req.cls]
        if req in queue:
            queue.remove(req)
            req.fail(reason)
            return True
        return False

    def finish(self, req: Request, kept: int) -> bool:
        """End a running request as finished at a stop its reader found (a stop string):
        its answer is its first `kept` output tokens. Its sequence is parked with all it
        computed, the tokens sampled past the stop included (what the cells hold), so the
        conversation's next turn still starts from it. False if it had already ended."""
        if req.done or req not in self.running:
            return False
        self._retire(req)
        req.stop_after(kept)
        return True

    def abort(self, reason: str) -> list[Request]:
        """Fail everything waiting or running (the run is being stopped)."""
        failed = list(self.running) + [r for q in self.waiting.values() for r in q]
        for r in list(self.running):
            r.fail(reason)
            self._retire(r, keep=False)
        for q in self.waiting.values():
            for r in q:
                r.fail(reason)
            q.clear()
        return failed

    def _retire(self, req: Request, keep: bool = True) -> None:
        """Free what a request held: its sequence stays parked, where sequences are, with
        the KV it computed (`keep`), else is released."""
        self.running.remove(req)
        self._n_background -= req.cls == "background"
        assert req.seq_id is not None
        del self.by_id[req.id], self._by_seq[req.seq_id]
        if keep and self.parked is not None:
            self.parked.park(req.seq_id, req.held_tokens())
        else:
            self._release(req.seq_id)
            heapq.heappush(self._free_seqs, req.seq_id)
        self.kv_free += req.kv_cells


def _seq(req: Request) -> int:
    """The sequence a running request holds (given at admission, kept until it ends)."""
    assert req.seq_id is not None
    return req.seq_id
