"""Iteration time as a function of what the iteration holds.

    t = per_pass * passes + per_sampled * n_sampled + per_prefill * n_prefill
        + per_kctx * ctx_work / 1000

`passes` counts the groups a backend runs (on llama.cpp: one for all decodes plus one per
prompt chunk, each streaming the weights once); `n_sampled` the rows whose logits are
computed and sampled (each decode, and a chunk that ends its prompt: with a 262k-token
vocabulary that output projection costs a small model more than a dozen prompt tokens);
`ctx_work` is the attention work (KV cells attended, summed over tokens). Fitted by
non-negative least squares from completed iterations: at startup from a short probe, online
inside the cadence policy, and offline from a run's iterations.jsonl for the simulated
backend. (Cost-model files written before chunks that end a prompt counted name the
sampled row's cost `per_decode_s`; they still load.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.optimize import nnls

from edgeprefill.runtime.core.plan import IterationTiming


def passes(n_decode: int, n_chunks: int) -> int:
    return (1 if n_decode else 0) + n_chunks


def features(t: IterationTiming) -> list[float]:
    return [passes(t.n_decode, t.n_chunks), t.sampled, t.n_prefill, t.ctx_work / 1000.0]


def _matrix(timings: Sequence[IterationTiming]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([features(t) for t in timings], dtype=float).reshape(-1, 4)
    return x, np.array([t.duration_s for t in timings], dtype=float)


@dataclass(frozen=True)
class CostModel:
    per_pass_s: float
    per_sampled_s: float
    per_prefill_s: float
    per_kctx_s: float
    n_samples: int = 0
    rmse_s: float | None = None

    def predict(
        self,
        n_decode: int,
        n_prefill: int,
        n_chunks: int,
        ctx_work: int,
        n_sampled: int | None = None,  # None: only the decodes are sampled
    ) -> float:
        return (
            self.per_pass_s * passes(n_decode, n_chunks)
            + self.per_sampled_s * (n_decode if n_sampled is None else n_sampled)
            + self.per_prefill_s * n_prefill
            + self.per_kctx_s * ctx_work / 1000.0
        )

    def max_prefill(self, target_s: float, n_decode: int, decode_ctx: int, start_pos: int) -> int:
        """The most prompt tokens one chunk starting at `start_pos` may hold, beside
        `n_decode` decodes attending to `decode_ctx` cells, for the iteration to be predicted
        at or under `target_s`. 0 when even the decodes alone are predicted over it."""
        base = self.predict(n_decode, 0, 1, decode_ctx)  # the chunk's pass included
        if base >= target_s:
            return 0
        # per_kctx/1000 * (c*start + c(c+1)/2) + per_prefill * c <= target - base
        a = self.per_kctx_s / 2000.0
        b = self.per_prefill_s + self.per_kctx_s * (start_pos + 0.5) / 1000.0
        room = target_s - base
        if a <= 0:
            return int(room / b) if b > 0 else 1 << 30
        return int((-b + math.sqrt(b * b + 4 * a * room)) / (2 * a))

    def prompt_end_s(self, n_decode: int, decode_ctx: int, left: int, start_pos: int) -> float:
        """An iteration whose chunk ends a prompt: its `left` tokens from `start_pos` beside
        `n_decode` decodes, and the row that samples the prompt's first output token."""
        ctx = decode_ctx + left * start_pos + left * (left + 1) // 2
        return self.predict(n_decode, left, 1, ctx, n_sampled=n_decode + 1)

    def prompt_tokens_s(self, n_tokens: int, start_pos: int = 0) -> float:
        """What `n_tokens` prompt tokens from `start_pos` add to an iteration they share:
        their own cost and attention, the pass over the weights and any sampled row aside."""
        return (self.per_prefill_s + self.per_kctx_s * (start_pos + n_tokens / 2) / 1000) * n_tokens

    def prompt_alone_s(self, n_tokens: int, n_batch: int, start_pos: int = 0) -> float:
        """A prompt's time computed alone from `start_pos`: chunks of `n_batch`, each a
        pass over the weights, the last one sampling the first output token. What a chat's
        first token would take on an idle device, the yardstick of its TTFT target."""
        t, pos, left = 0.0, start_pos, n_tokens
        while left > 0:
            c = min(left, n_batch)
            left -= c
            ctx = c * pos + c * (c + 1) // 2
            t += self.predict(0, c, 1, ctx, n_sampled=0 if left else 1)
            pos += c
        return t

    @property
    def coef(self) -> np.ndarray:
        return np.array([self.per_pass_s, self.per_sampled_s, self.per_prefill_s, self.per_kctx_s])

    def residuals(self, timings: Sequence[IterationTiming]) -> np.ndarray:
        """Measured minus predicted duration of each iteration, in seconds."""
        x, y = _matrix(timings)
        return y - x @ self.coef

    @classmethod
    def fit(cls, timings: Sequence[IterationTiming]) -> CostModel:
        if len(timings) < 4:
            raise ValueError(f"need at least 4 iterations to fit a cost model, got {len(timings)}")
        return cls.fit_arrays(*_matrix(timings))

    @classmethod
    def fit_arrays(cls, x: np.ndarray, y: np.ndarray) -> CostModel:
        """Non-negative least squares on feature rows `x` (see `features`) and durations."""
        coef, _ = nnls(x, y)
        rmse = float(np.sqrt(np.mean((y - x @ coef) ** 2)))
        return cls.of(coef, n_samples=len(y), rmse_s=rmse)

    @classmethod
    def of(cls, coef: Iterable[float], *, n_samples: int, rmse_s: float) -> CostModel:
        """A model from its coefficients, in the order of `features`' columns."""
        per_pass, per_sampled, per_prefill, per_kctx = map(float, coef)
        return cls(per_pass, per_sampled, per_prefill, per_kctx, n_samples, rmse_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        d = dict(d)
        if "per_decode_s" in d:  # files written before the name said what it is
            d["per_sampled_s"] = d.pop("per_decode_s")
        return cls(**d)
