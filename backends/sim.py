"""A simulated backend: a virtual clock and a fitted cost model instead of a device.

It answers "what would this policy do on this workload at 10x the load" in seconds, and
makes policy tests deterministic. Iteration times come from a `CostModel` (fitted from a
real run with `edgeprefill calibrate`), optionally with seeded noise: Gaussian, or the
fitted run's own residuals drawn at random (a shared machine's stalls are rare and long, not
Gaussian, and they are what a tail target must absorb); sampled tokens are a
hash of the sequence's last token and position, so every policy sees the same outputs.
Every result it produces is labelled simulated.
"""

from __future__ import annotations

import re
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from edgeprefill.runtime.core.contract import (
    Backend,
    Capacity,
    SeqWork,
    StepResult,
    plain_transcript,
)
from edgeprefill.runtime.core.costmodel import CostModel

BOS, EOG, FIRST_NORMAL = 1, 2, 10


class SimClock:
    """Virtual seconds: advanced by each simulated iteration and by idle waits."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


class SimTokenizer:
    """Words and punctuation hashed to ids: exact-length prompts without a model."""

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        span = self.vocab_size - FIRST_NORMAL
        ids = [
            FIRST_NORMAL + zlib.crc32(w.encode()) % span for w in re.findall(r"\w+|[^\w\s]", text)
        ]
        return ([BOS] if add_bos else []) + ids

    def chat_parts(self, system: str | None) -> tuple[str, str]:
        return ((system + "\n\n" if system else "") + "User: ", "\nAssistant:")

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return plain_transcript(messages)

    def piece(self, token: int) -> bytes:
        return f" w{token}".encode()

    def is_normal(self, token: int) -> bool:
        return token >= FIRST_NORMAL

    def is_eog(self, token: int) -> bool:
        return token == EOG


class SimBackend(Backend):
    name = "sim"

    def __init__(
        self,
        cost: CostModel,
        capacity: Capacity,
        *,
        noise: float = 0.0,
        residuals: Sequence[float] = (),
        seed: int = 0,
        clock: SimClock | None = None,
    ) -> None:
        if noise < 0:
            raise ValueError(f"noise must not be negative, got {noise}")
        self.cost = cost
        self.capacity = capacity
        self.tokenizer = SimTokenizer()
        self.clock = clock or SimClock()
        self.noise = noise
        self.residuals = np.asarray(residuals, dtype=float)
        self._rng = np.random.default_rng(seed)

    def execute(self, work: Sequence[SeqWork], abort: threading.Event | None = None) -> StepResult:
        n_decode = sum(w.is_decode for w in work)
        duration = self.cost.predict(
            n_decode,
            sum(len(w.tokens) for w in work if not w.is_decode),
            len(work) - n_decode,
            sum(w.ctx_work for w in work),
            n_sampled=sum(w.sample is not None for w in work),
        )
        if self.noise:
            duration *= max(0.0, 1.0 + self.noise * float(self._rng.normal()))
        if self.residuals.size:
            # No iteration is free: one a residual would make shorter than a tenth of its
            # prediction takes that tenth.
            duration = max(duration / 10, duration + float(self._rng.choice(self.residuals)))
        self.clock.sleep(duration)
        span = self.tokenizer.vocab_size - FIRST_NORMAL
        sampled = {
            w.seq_id: FIRST_NORMAL
            + zlib.crc32(f"{w.tokens[-1]}@{w.pos + len(w.tokens)}".encode()) % span
            for w in work
            if w.sample is not None
        }
        return StepResult(duration_s=duration, sampled=sampled)

    def release(self, seq_id: int) -> None:
        """No cache to free; the capacity accounting lives in the scheduler."""

    def describe(self) -> dict[str, Any]:
        c = self.capacity
        return {
            "name": self.name,
            "simulated": True,
            "clock": "virtual",  # iteration times from the cost model
            "cost_model": self.cost.to_dict(),
            "noise": self.noise,
            "residuals": int(self.residuals.size),
            "n_batch": c.n_batch,
            "n_ctx_seq": c.n_ctx_seq,
            "n_seq_max": c.n_seq_max,
            "min_chunk": c.min_chunk,
            "chunk_quantum": c.chunk_quantum,
        }

    def close(self) -> None:
        """Nothing native to free."""
