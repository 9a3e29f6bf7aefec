"""What policies take their defaults from: a cost model of iterations on this device, the
time of one decode-only iteration and the interactive target derived from it.

The papers' budgets were tuned for GPUs (16k/2k tokens, an 80 ms target); on a laptop CPU a
512-token chunk beside a decode takes over a second. A `DeviceProfile` is measured on the
device a run uses (`runner.calibration`) or fitted from a finished run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.plan import IterationTiming

# A chat reads comfortably at 10 tokens/s or faster; on a device whose decode-only iteration alone is
# slower than a quarter of that, the target follows the device instead.
READING_TARGET_S = 0.100
TARGET_DECODE_MULTIPLE = 4.0
# The context a chunk is sized for when no scheduler state is at hand (P-PAS's cap, DLFP's
# initial chunk): a chunk 2k tokens into a document, beside one decode with 512 cells.
TYPICAL_START_POS = 2048
TYPICAL_DECODE_CTX = 512


@dataclass(frozen=True)
class DeviceProfile:
    cost: CostModel
    decode_s: float  # one decode-only iteration alone
    target_s: float  # interactive inter-token target derived from decode_s
    n_batch: int
    min_chunk: int
    source: str  # "probe" or the run folder it was fitted from
    timings: list[IterationTiming] = field(default_factory=list, repr=False)
    chunk_quantum: int = 1  # prompt pieces other than a prompt's last are multiples of it

    def chunk_for(self, target_s: float | None = None) -> int:
        """The prompt chunk predicted to keep one decode's iteration at the target."""
        c = self.cost.max_prefill(
            target_s or self.target_s, 1, TYPICAL_DECODE_CTX, TYPICAL_START_POS
        )
        return int(min(max(c, self.min_chunk), self.n_batch))

    def prompt_alone_s(self, n_tokens: int, start_pos: int = 0) -> float:
        """A prompt computed alone on this device, in chunks of the batch size."""
        return self.cost.prompt_alone_s(n_tokens, self.n_batch, start_pos)

    def longest_prompt_within(self, seconds: float) -> int:
        """The longest prompt predicted to compute alone within `seconds` (0: none)."""
        lo, hi = 0, 1
        while self.prompt_alone_s(hi) <= seconds and hi < 1 << 22:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.prompt_alone_s(mid) <= seconds else (lo, mid)
        return lo

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "decode_ms": self.decode_s * 1000,
            "target_ms": self.target_s * 1000,
            "chunk_at_target": self.chunk_for(),
            "cost_model": self.cost.to_dict(),
        }


def target_for(decode_s: float) -> float:
    """A reading pace where the device allows it, else a multiple of its decode-only iteration."""
    return max(READING_TARGET_S, TARGET_DECODE_MULTIPLE * decode_s)
