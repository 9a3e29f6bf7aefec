"""Cadence's cost model, fitted online: to the startup probe's iterations and the last
`window` completed ones, every `REFIT_EVERY` iterations.

Refitting from scratch rebuilt a matrix of a few hundred rows in Python each iteration
(~1.5 ms of host time a token waits for). The fit is the same non-negative least squares
solved from the normal equations, which change by one row in and one row out: a 4x4 update
each iteration (microseconds), and a 4x4 solve, with the margins measured again against its
result, only every few iterations: one iteration moves a fit over hundreds by little, and
the solve and margins were most of the host time a token waited for. An iteration the
foreground felt beyond its margin is refitted at once: a stall is the tail event the
margins exist for.
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
# it) lags the device. At 20-100 ms an iteration, well under a second.
REFIT_EVERY = 8


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

    def append(self, t: IterationTiming) -> tuple[np.ndarray, float] | None:
        """Add `t`; returns the row it pushed out (features, duration) once full."""
        i, cap = self._next, len(self.y)
        out = (self.x[i].copy(), float(self.y[i])) if self.n == cap else None
        self.x[i] = features(t)
        self.y[i] = t.duration_s
        self.host[i] = np.nan if t.host_s is None else t.host_s
        self.mixed[i] = bool(t.n_decode_foreground and t.n_prefill)
        self._next = (i + 1) % cap
        self.n = min(self.n + 1, cap)
        return out

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
        self._gram = self._anchor.T @ self._anchor
        self._xty = self._anchor.T @ self._anchor_y
        self._yty = float(self._anchor_y @ self._anchor_y)
        self._unfitted = 0  # iterations added since the last refit

    def add(self, timing: IterationTiming, refit: bool = False) -> bool:
        """A completed iteration enters the window (the oldest leaves). Returns whether the
        model was refitted: every `REFIT_EVERY`, once `MIN_RECENT` are in, or at once when
        asked (`refit`: the iteration surprised its caller)."""
        out = self.recent.append(timing)
        x, y = np.array(features(timing), dtype=float), timing.duration_s
        self._gram += np.outer(x, x)
        self._xty += x * y
        self._yty += y * y
        if out is not None:
            ox, oy = out
            self._gram -= np.outer(ox, ox)
            self._xty -= ox * oy
            self._yty -= oy * oy
        self._unfitted += 1
        if len(self.recent) < MIN_RECENT or (self._unfitted < REFIT_EVERY and not refit):
            return False
        self._unfitted = 0
        self.model = self._solve()
        return True

    def _solve(self) -> CostModel:
        """min ||X c - y|| over c >= 0 from X'X and X'y: with X'X = R'R it is
        min ||R c - R'^-1 X'y||, the same problem on a 4x4 matrix. Columns are scaled to
        unit norm first (prompt tokens and attention work differ by orders of magnitude)."""
        n = len(self._anchor_y) + len(self.recent)
        scale = np.sqrt(np.diag(self._gram))
        scale[scale == 0] = 1.0
        gram = self._gram / np.outer(scale, scale)
        try:
            r = np.linalg.cholesky(gram).T
            coef, _ = nnls(r, np.linalg.solve(r.T, self._xty / scale))
        except np.linalg.LinAlgError:  # rank-deficient: solve on the rows themselves
            x, y, _ = self.recent.rows()
            return CostModel.fit_arrays(
                np.vstack([self._anchor, x]), np.concatenate([self._anchor_y, y])
            )
        coef = coef / scale
        sse = self._yty - 2 * coef @ self._xty + coef @ self._gram @ coef
        return CostModel(*map(float, coef), n_samples=n, rmse_s=float(np.sqrt(max(sse, 0) / n)))
