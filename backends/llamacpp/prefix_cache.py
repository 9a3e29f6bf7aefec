"""Prompt prefixes kept across requests with llama.cpp's per-sequence state API.

`llama_state_seq_get_data` copies one sequence's KV cells (every layer, with the sliding
window layers' recent cells) into a buffer; `llama_state_seq_set_data` puts them into
another, empty sequence of a context with the same model and KV layout, which then continues
from the next position as if it had computed them. The buffers live in a `StateStore`.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from typing import Any

import llama_cpp as lc
import numpy as np

from edgeprefill.backends.llamacpp.native import LlamaContext
from edgeprefill.backends.spare_memory import SpareMemory
from edgeprefill.backends.state_store import StateStore

log = logging.getLogger(__name__)


def _ptr(a: np.ndarray) -> Any:
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


class LlamaPrefixCache:
    def __init__(self, ctx: LlamaContext, store: StateStore) -> None:
        self.ctx = ctx
        self.store = store
        self.save_s: list[float] = []  # engine-thread time of each save (the copy)
        self._memory = SpareMemory()  # the copies go to pages already mapped

    def save(self, seq_id: int, tokens: Sequence[int]) -> None:
        t0 = time.perf_counter()
        size = lc.llama_state_seq_get_size(self.ctx.ptr, seq_id)
        buf = self._memory.take(size)
        n = lc.llama_state_seq_get_data(self.ctx.ptr, _ptr(buf), size, seq_id)
        if n == 0:
            log.warning("KV cache: llama.cpp could not copy sequence %d's state", seq_id)
            return
        self.store.put(tokens, buf[:n])
        self.save_s.append(time.perf_counter() - t0)

    def restore(self, seq_id: int, prompt: Sequence[int]) -> int:
        loaded = self.store.lookup(prompt)
        if loaded is None:
            return 0
        payload = loaded.payload
        n = lc.llama_state_seq_set_data(self.ctx.ptr, _ptr(payload), payload.nbytes, seq_id)
        if n == 0 or self.ctx.seq_pos_max(seq_id) != loaded.n_tokens - 1:
            self.ctx.seq_rm(seq_id)
            log.warning("KV cache: llama.cpp refused a saved state; computing the prompt instead")
            return 0
        return loaded.n_tokens

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
