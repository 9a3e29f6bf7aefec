"""Cadence's cost model, fitted online: to the startup probe's iterations and the last
`window` completed ones, every `REFIT_EVERY` iterations.

Refitting from scratch rebuilt a matrix of a few hundred rows in Python each iteration
(~1.5 ms of host time a token waits for). The window is now kept as feature rows (a
ring), and the same non-negative least squares is solved from its normal equations (one
256x4 product and a 4x4 solve) only every few iterations, the margins measured again
against the result: one iteration moves a fit over hundreds by little, and updating the
normal equations, solving and re-measuring every iteration were most of the host time a
token waited for. An iteration the foreground felt beyond its margin is refitted at once:
a stall is the tail event the margins exist for.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from edgeprefill.runtime.core.costmodel import CostModel, features
from edgeprefill.runtime.core.plan import IterationTiming

N_FEATURES = 4
MIN_RECENT = 8  # completed iterations before the model is refitted at all
# Completed iterations between refits: the most the model (and the margins measured against
# it) lags the device: at 20-100 ms an iteration, 0.3-1.6 s.
REFIT_EVERY = 16


class Rows:
    """The last `cap` iterations as feature rows (a ring), so the least squares and
    residuals never rebuild a matrix from timings."""

    def __init__(self, cap: int) -> None:
        self.x = np.zeros((cap, N_FEATURES))
        self.y = np.zeros(cap)
        self.host = np.zeros(cap)  # host time, NaN where a timing had none
        self.mixed = np.zeros(cap, dtype=bool)  # foreground decodes beside prompt work
        self.n = 0
        self._next = 0

    def append(self, t: IterationTiming) -> None:
        """Add `t`, in place of the oldest once full."""
        i, cap = self._next, len(self.y)
        self.x[i] = features(t)
        self.y[i] = t.duration_s
        self.host[i] = np.nan if t.host_s is None else t.host_s
        self.mixed[i] = bool(t.n_decode_foreground and t.n_prefill)
        self._next = (i + 1) % cap
        self.n = min(self.n + 1, cap)

    def __len__(self) -> int:
        return self.n

    def rows(self, where: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(features, durations, host times) of the rows held, or of those `where` marks."""
        keep = slice(0, self.n) if where is None else where[: self.n]
        return self.x[: self.n][keep], self.y[: self.n][keep], self.host[: self.n][keep]


class OnlineFit:
    def __init__(self, model: CostModel, anchor: Sequence[IterationTiming], window: int) -> None:
        self.model = model
        self.recent = Rows(window)
        self._anchor = np.array([features(t) for t in anchor], dtype=float).reshape(-1, 4)
        self._anchor_y = np.array([t.duration_s for t in anchor], dtype=float)
        self._unfitted = 0  # iterations added since the last refit

    def add(self, timing: IterationTiming, refit: bool = False) -> bool:
        """A completed iteration enters the window (the oldest leaves). Returns whether the
        model was refitted: once `MIN_RECENT` are in, then every `REFIT_EVERY`, and at
        once when asked (`refit`: the iteration surprised its caller)."""
        self.recent.append(timing)
        self._unfitted += 1
        n = len(self.recent)
        if n < MIN_RECENT or not (refit or n == MIN_RECENT or self._unfitted >= REFIT_EVERY):
            return False
        self._unfitted = 0
        self.model = self._solve()
        return True

    def _solve(self) -> CostModel:
        """min ||X c - y|| over c >= 0 from X'X and X'y: with X'X = R'R it is
        min ||R c - R'^-1 X'y||, the same problem on a 4x4 matrix. Columns are scaled to
        unit norm first (prompt tokens and attention work differ by orders of magnitude)."""
        x, y, _ = self.recent.rows()
        n = len(self._anchor_y) + len(y)
        gram = self._anchor.T @ self._anchor + x.T @ x
        xty = self._anchor.T @ self._anchor_y + x.T @ y
        scale = np.sqrt(np.diag(gram))
        scale[scale == 0] = 1.0
        scaled = gram / np.outer(scale, scale)
        try:
            # Unconstrained first: where no cost comes out negative it is also the
            # non-negative solution, and scipy's nnls costs ~10x a 4x4 solve in checks.
            coef = np.linalg.solve(scaled, xty / scale)
            if (coef < 0).any():
                r = np.linalg.cholesky(scaled).T
                coef, _ = nnls(r, np.linalg.solve(r.T, xty / scale))
        except np.linalg.LinAlgError:  # rank-deficient: solve on the rows themselves
            return CostModel.fit_arrays(
                np.vstack([self._anchor, x]), np.concatenate([self._anchor_y, y])
            )
        coef = coef / scale
        yty = float(self._anchor_y @ self._anchor_y + y @ y)
        sse = yty - 2 * coef @ xty + coef @ gram @ coef
        return CostModel(*map(float, coef), n_samples=n, rmse_s=float(np.sqrt(max(sse, 0) / n)))
