"""Refuse a KV cache that does not fit in memory before llama.cpp allocates it.

llama.cpp clears its KV buffers as it creates them, so a context larger than free memory
is not refused: the process is OOM-killed, or the machine swaps. The bytes per cell depend
on the model (layers, KV heads, head size, which layers keep only a sliding window), and
llama.cpp states them only in its log, so a 1,024-cell context is created once and its
report read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import psutil

from edgeprefill.backends.llamacpp.native import LlamaContext, LlamaModel, captured_log
from edgeprefill.backends.llamacpp.swa_ring import SwaRing
from edgeprefill.runtime.core.errors import UserError

_CACHE = re.compile(r"creating\s+(non-SWA|SWA) KV cache")
_SIZE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells")
PROBE_CELLS = 1024
GIB = 1 << 30


@dataclass(frozen=True)
class KvFootprint:
    full_bytes: float  # per cell, over the layers that attend to the whole context
    window_bytes: float  # per cell, over the sliding-window layers

    @classmethod
    def measure(cls, model: LlamaModel) -> KvFootprint | None:
        """None where this llama.cpp's log does not say (another build's wording)."""
        with captured_log() as lines:
            ctx = LlamaContext(
                model, n_ctx=PROBE_CELLS, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1
            )
            ctx.close()
        per_cell = {"non-SWA": 0.0, "SWA": 0.0}
        kind = "non-SWA"  # a model without sliding-window layers has one cache
        for line in lines:
            if m := _CACHE.search(line):
                kind = m.group(1)
            elif m := _SIZE.search(line):
                per_cell[kind] = float(m.group(1)) * (1 << 20) / int(m.group(2))
        if not per_cell["non-SWA"] and not per_cell["SWA"]:
            return None
        return cls(per_cell["non-SWA"], per_cell["SWA"])

    def bytes_for(
        self, n_ctx: int, n_seq_max: int, n_ubatch: int, n_swa: int, unified: bool
    ) -> float:
        """The KV cache of a context of `n_seq_max` sequences of `n_ctx` cells each, or of
        one pool of `n_ctx` cells shared by all (`unified`)."""
        streams, window = (1, n_swa * n_seq_max) if unified else (n_seq_max, n_swa)
        ring = SwaRing.of(window, n_ctx, n_ubatch, unified).size if n_swa else n_ctx
        return streams * (self.full_bytes * n_ctx + self.window_bytes * ring)


def check_fits(
    footprint: KvFootprint,
    n_ctx: int,
    n_seq_max: int,
    n_ubatch: int,
    n_swa: int,
    unified: bool,
    largest_ubatch: int | None = None,
) -> None:
    """Refuse, in one line with the numbers and the fix, a KV cache over the memory that
    is available now (the model is already loaded).

    Before the micro-batch is chosen the cache is checked at the smallest one (`n_ubatch`),
    but the `--n-ctx` suggested must fit at any it may become (`largest_ubatch`): the
    sliding-window ring grows with it."""

    def need(cells: int, ubatch: int = n_ubatch) -> float:
        return footprint.bytes_for(cells, n_seq_max, ubatch, n_swa, unified)

    available = psutil.virtual_memory().available
    if need(n_ctx) <= available:
        return
    worst = max(n_ubatch, largest_ubatch or 0)
    cells = range(n_ctx // 256 * 256, 0, -256)
    fits = next((c for c in cells if need(c, worst) <= available), 0)
    fix = f"--n-ctx {fits} or less" if fits else "a smaller --n-seq-max"
    what = f"{n_ctx:,} cells" + ("" if unified else f" x {n_seq_max} sequences")
    raise UserError(
        f"the KV cache needs {need(n_ctx) / GIB:.1f} GiB ({what}) but {available / GIB:.1f} "
        f"GiB of memory is available: use {fix}, or free memory"
    )
