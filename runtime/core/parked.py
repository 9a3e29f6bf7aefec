"""Finished requests' sequences left in the context, for the next prompt that starts with
their tokens.

Why: the OpenAI API is stateless, so an assistant sends the whole conversation again at
every turn. Freed at its end, a turn's KV had to be computed again at the next: turn 10 of
a conversation took 3.5 s to its first token where llama-server, which keeps each slot's
cache and picks the slot with the longest common prefix, took 0.4 s. Here a request that
ends leaves its sequence as it is (its sampler freed); a new request takes the parked
sequence that shares the longest prefix with its prompt, the sequence cut back to that
prefix, and computes only the rest. Sequences are parked until a request needs their slot or
cells, least recently used first; one evicted goes to the prefix cache's memory (`spill`)
when the backend keeps one, so it can still be restored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from edgeprefill.runtime.core.contract import Backend

# A parked sequence is taken for a new prompt when they share at least this share of its
# tokens (llama-server's --slot-prompt-similarity default).
SIMILARITY = 0.5


@dataclass
class ParkedSeq:
    seq_id: int
    tokens: np.ndarray  # int32 ids whose KV the sequence holds, at positions 0..n-1


@dataclass
class ParkedStats:
    hits: int = 0  # requests that continued a parked sequence
    reused_tokens: int = 0
    evicted: int = 0  # sequences given up for another request's slot or cells
    spilled: int = 0  # of those, saved to the prefix cache first


class ParkedSequences:
    def __init__(
        self,
        backend: Backend,
        spill: Callable[[int, Sequence[int]], None] | None = None,
    ) -> None:
        """The backend parks, reuses and releases the sequences (`Backend.park`, `reuse`,
        `release`); `spill(seq, tokens)` saves one's state elsewhere before its release."""
        self._backend, self._spill = backend, spill
        self._by_seq: OrderedDict[int, ParkedSeq] = OrderedDict()  # least recently used first
        self.cells = 0  # KV cells the parked sequences hold
        self.stats = ParkedStats()

    def __len__(self) -> int:
        return len(self._by_seq)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._by_seq

    def park(self, seq_id: int, tokens: Sequence[int]) -> None:
        self._backend.park(seq_id)
        parked = ParkedSeq(seq_id, np.asarray(tokens, dtype=np.int32))
        self._by_seq[seq_id] = parked
        self.cells += len(parked.tokens)

    def match(self, prompt: np.ndarray) -> tuple[int, int] | None:
        """(sequence, common prefix) of the parked sequence sharing the longest prefix with
        `prompt`, among those that share at least `SIMILARITY` of their tokens with it (a
        weaker match would cut away a conversation that may yet continue)."""
        best: tuple[int, int] | None = None
        for parked in self._by_seq.values():
            n = common_prefix(parked.tokens, prompt)
            if n >= SIMILARITY * len(parked.tokens) and n and (best is None or n > best[1]):
                best = (parked.seq_id, n)
        return best

    def take(self, seq_id: int, n_tokens: int) -> int:
        """Give the parked sequence to a new request, cut back to `n_tokens`; the tokens it
        holds for the request (0: none, it starts empty)."""
        parked = self._by_seq.pop(seq_id)
        self.cells -= len(parked.tokens)
        held = self._backend.reuse(seq_id, n_tokens)
        if held:
            self.stats.hits += 1
            self.stats.reused_tokens += held
        return held

    def evict(self) -> int | None:
        """Release the least recently used parked sequence, saved first where a `spill` is
        given; its id, or None when none is parked."""
        if not self._by_seq:
            return None
        seq_id, parked = self._by_seq.popitem(last=False)
        self.cells -= len(parked.tokens)
        if self._spill is not None and len(parked.tokens):
            self._spill(seq_id, parked.tokens.tolist())
            self.stats.spilled += 1
        self._backend.release(seq_id)
        self.stats.evicted += 1
        return seq_id


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many first tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
