"""Prompt prefixes kept across requests with llama.cpp's per-sequence state API.

`llama_state_seq_get_data` copies one sequence's KV cells (every layer, with the sliding
window layers' recent cells) into a buffer; `llama_state_seq_set_data` puts them into
another, empty sequence of a context with the same model and KV layout, which then continues
from the next position as if it had computed them (`LlamaContext.seq_state_*` make the
calls). The buffers live in a `StateStore`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from edgeprefill.backends.llamacpp.native import LlamaContext
from edgeprefill.backends.llamacpp.spare_memory import SpareMemory
from edgeprefill.backends.llamacpp.state_store import StateStore

log = logging.getLogger(__name__)


class LlamaPrefixCache:
    def __init__(self, ctx: LlamaContext, store: StateStore) -> None:
        self.ctx = ctx
        self.store = store
        self.save_s: list[float] = []  # engine-thread time of each save (the copy)
        self._memory = SpareMemory()  # the copies go to pages already mapped

    def save(self, seq_id: int, tokens: Sequence[int]) -> None:
        t0 = time.perf_counter()
        buf = self._memory.take(self.ctx.seq_state_size(seq_id))
        n = self.ctx.seq_state_read(seq_id, buf)
        if n == 0:
            log.warning("KV cache: llama.cpp could not copy sequence %d's state", seq_id)
            return
        self.store.put(tokens, buf[:n])
        self.save_s.append(time.perf_counter() - t0)

    def restore(
        self, seq_id: int, prompt: Sequence[int], boundary: Callable[[int], int] = int
    ) -> int:
        loaded = self.store.lookup(prompt, boundary, self._cuttable)
        if loaded is None:
            return 0
        n = self.ctx.seq_state_write(seq_id, loaded.payload)
        if n == 0 or self.ctx.seq_pos_max(seq_id) != loaded.n_tokens - 1:
            self.ctx.seq_rm(seq_id)
            log.warning("KV cache: llama.cpp refused a saved state; computing the prompt instead")
            return 0
        return self.ctx.seq_truncate(seq_id, loaded.common)

    def _cuttable(self, n_tokens: int, common: int) -> bool:
        """Whether a saved state of `n_tokens` can be cut back to `common`: of a
        sliding-window layer it holds only the window's last cells, which the first
        position after a cut further back would attend below."""
        n_swa = self.ctx.model.n_swa
        return common >= n_tokens or not n_swa or n_tokens <= n_swa

    def clear(self) -> None:
        self.store.clear()
        self.save_s.clear()

    def flush(self) -> None:
        self.store.flush()

    def describe(self) -> dict[str, Any]:
        saves = self.save_s
        return {
            **self.store.describe(),
            "max_save_ms": max(saves) * 1e3 if saves else None,
            "mean_save_ms": sum(saves) / len(saves) * 1e3 if saves else None,
        }

    def close(self) -> None:
        self.store.close()
        self._memory.close()
