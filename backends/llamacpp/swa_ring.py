"""Where an abort may stop a prompt micro-batch so that its rollback is exact.

A sliding-window (SWA) layer's KV cache holds `size` cells per sequence: the window plus one
micro-batch, padded to 256 (`llama_kv_cache_iswa`). A sequence computed from position 0
fills it as a ring, position p in cell p mod size, each micro-batch reusing the cells of the
positions that fell out of the window. When a micro-batch is aborted, llama.cpp removes its
cells and moves the search head back to the lowest cell freed. For a micro-batch inside one
turn of the ring that is where it started, so the retry lands in the same cells and computes
bit-identical logits. For one that wraps past the ring's end the lowest freed cell is cell
0: the retry and everything after it land in other cells, attention sums in another order,
and the sequence's logits differ from then on (by up to 1.2-1.4 on the bundled model,
`benchmarks/abort_exactness.py`). So a micro-batch may be stopped mid-graph only where its
sequence's ring is known (computed from position 0 in this context, in its own KV stream)
and the micro-batch does not wrap; any other one finishes first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SWA_PAD = 256  # llama.cpp pads the SWA cache to this many cells


@dataclass
class SwaRing:
    n_swa: int  # the model's sliding window (0: no SWA layers, every abort is exact)
    size: int  # SWA cells per sequence
    shared: bool  # one KV stream for all sequences: where cells go depends on all of them
    _from_zero: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, n_swa: int, n_ctx_seq: int, n_ubatch: int, kv_unified: bool) -> SwaRing:
        """The ring llama.cpp builds for these settings (no full-size SWA cache)."""
        size = min(n_ctx_seq, n_swa + n_ubatch) if n_swa else n_ctx_seq
        return cls(n_swa, -(-size // SWA_PAD) * SWA_PAD, kv_unified)

    def placed(self, seq_id: int, pos: int) -> None:
        """Note a slice about to be computed: a sequence whose first slice starts at
        position 0 has a known ring; one restored from a saved prefix does not."""
        if pos == 0:
            self._from_zero.add(seq_id)

    def released(self, seq_id: int) -> None:
        self._from_zero.discard(seq_id)

    def known(self, seq_id: int) -> bool:
        """Whether the cells of `seq_id`'s positions are known (no window: nothing to know)."""
        return not self.n_swa or (not self.shared and seq_id in self._from_zero)

    def abortable(self, seq_id: int, pos: int, n_tokens: int) -> bool:
        """Whether the micro-batch [pos, pos + n_tokens) of `seq_id` may stop mid-graph."""
        if not self.known(seq_id):
            return False
        return not self.n_swa or pos // self.size == (pos + n_tokens - 1) // self.size

    def room(self, pos: int) -> int:
        """Tokens from `pos` to the ring's next turn: a micro-batch no longer than that does
        not wrap."""
        return self.size - pos % self.size

    def describe(self) -> dict[str, Any]:
        return {"n_swa": self.n_swa, "swa_cells": self.size if self.n_swa else None}
