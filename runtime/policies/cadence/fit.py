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

import math
from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from edgeprefill.runtime.core.costs.costmodel import CostModel, features
from edgeprefill.runtime.core.plan import IterationTiming

N_FEATURES = 4
MIN_RECENT = 8  # completed iterations before the model is refitted at all
# Completed iterations between refits: the most the model (and the margins measured against
# it) lags the device: at 20-100 ms an iteration, 0.3-1.6 s.
REFIT_EVERY = 16


class Rows:
    """The last `cap` iterations as feature rows (a ring), so the least squares and
    residuals never rebuild a matrix from timings.

    An iteration is kept as it came and written into the ring only when the rows are read
    (at a refit, every `REFIT_EVERY` iterations): writing each at once, right after a
    device call, cost ~25 us of host time a token waits for (four NumPy stores on cold
    caches), where a refit writes sixteen on warm ones."""

    def __init__(self, cap: int) -> None:
        # Features and duration side by side: one product gives the normal equations.
        self.xy = np.zeros((cap, N_FEATURES + 1))
        self.x, self.y = self.xy[:, :N_FEATURES], self.xy[:, N_FEATURES]
        self.host = np.zeros(cap)  # host time, NaN where a timing had none
        self.constrained = np.zeros(cap)  # rows sampled under a grammar
        self._mixed = np.zeros(cap, dtype=bool)  # foreground decodes beside prompt work
        self.n = 0
        self._next = 0
        self._pending: list[IterationTiming] = []

    def append(self, t: IterationTiming) -> None:
        """Add `t`, in place of the oldest once full."""
        self._pending.append(t)
        self.n = min(self.n + 1, len(self.y))
        if len(self._pending) >= len(self.y):
            self._write()

    def _write(self) -> None:
        if not self._pending:
            return
        cap = len(self.y)
        new = np.array(
            [
                (
                    *features(t),
                    t.duration_s,
                    np.nan if t.host_s is None else t.host_s,
                    t.n_constrained,
                )
                for t in self._pending[-cap:]
            ]
        )
        mixed = [bool(t.n_decode_foreground and t.n_prefill) for t in self._pending[-cap:]]
        at = (self._next + np.arange(len(new))) % cap
        self.xy[at] = new[:, : N_FEATURES + 1]
        self.host[at] = new[:, -2]
        self.constrained[at] = new[:, -1]
        self._mixed[at] = mixed
        self._next = int(at[-1] + 1) % cap
        self._pending.clear()

    def __len__(self) -> int:
        return self.n

    @property
    def mixed(self) -> np.ndarray:
        """Which rows held foreground decodes beside prompt work."""
        self._write()
        return self._mixed

    def rows(
        self, where: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(features, durations, host times, constrained rows) of the rows held, or of
        those `where` marks."""
        self._write()
        keep = slice(0, self.n) if where is None else where[: self.n]
        held = (self.x, self.y, self.host, self.constrained)
        return tuple(a[: self.n][keep] for a in held)  # type: ignore[return-value]

    def normal(self) -> np.ndarray:
        """[X y]'[X y] over the rows held: X'X, X'y and y'y in one 5x5 product."""
        self._write()
        held = self.xy[: self.n]
        return held.T @ held


class OnlineFit:
    def __init__(self, model: CostModel, anchor: Sequence[IterationTiming], window: int) -> None:
        self.model = model
        self.recent = Rows(window)
        self._anchor = np.array([features(t) for t in anchor], dtype=float).reshape(-1, 4)
        self._anchor_y = np.array([t.duration_s for t in anchor], dtype=float)
        anchor_xy = np.column_stack([self._anchor, self._anchor_y])
        self._anchor_normal = anchor_xy.T @ anchor_xy  # fixed: computed once
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
        """min ||X c - y|| over c >= 0 from X'X and X'y (X: the anchor's and the window's
        rows). Columns are scaled to unit norm first (prompt tokens and attention work
        differ by orders of magnitude)."""
        g = self._anchor_normal + self.recent.normal()
        n = len(self._anchor_y) + len(self.recent)
        # The usual case in plain Python: a 4x4 Cholesky solve on lists took a third of the
        # time of NumPy's on the caches a device call has just emptied (~100 us against
        # ~230), where NumPy's Python-level wrappers cost more than the arithmetic.
        normal = g.tolist()
        coef = _positive_solution(normal)
        if coef is None:
            coef = self._constrained(g)
            if coef is None:  # rank-deficient: solve on the rows themselves
                x, y, *_ = self.recent.rows()
                return CostModel.fit_arrays(
                    np.vstack([self._anchor, x]), np.concatenate([self._anchor_y, y])
                )
        k = N_FEATURES
        fitted = sum(coef[i] * normal[i][j] * coef[j] for i in range(k) for j in range(k))
        sse = normal[k][k] - 2 * sum(coef[i] * normal[i][k] for i in range(k)) + fitted
        return CostModel.of(coef, n_samples=n, rmse_s=math.sqrt(max(sse, 0.0) / n))

    @staticmethod
    def _constrained(g: np.ndarray) -> list[float] | None:
        """Where the unconstrained solution has a negative cost: with X'X = R'R the problem
        is min ||R c - R'^-1 X'y||, non-negative least squares on a 4x4 matrix. None when
        X'X is singular."""
        gram, xty = g[:N_FEATURES, :N_FEATURES], g[:N_FEATURES, N_FEATURES]
        scale = np.sqrt(np.diag(gram))
        scale[scale == 0] = 1.0
        scaled = gram / np.outer(scale, scale)
        try:
            coef = np.linalg.solve(scaled, xty / scale)
            if (coef < 0).any():
                r = np.linalg.cholesky(scaled).T
                coef, _ = nnls(r, np.linalg.solve(r.T, xty / scale))
        except np.linalg.LinAlgError:
            return None
        return [float(c) for c in coef / scale]


def _positive_solution(normal: list[list[float]]) -> list[float] | None:
    """X'X c = X'y by Cholesky, from [X y]'[X y] as nested lists, columns scaled to unit
    norm; None where X'X is not positive definite or a cost comes out negative (where no
    cost is negative this is also the non-negative least-squares solution)."""
    k = N_FEATURES
    scale = [math.sqrt(normal[i][i]) or 1.0 for i in range(k)]
    a = [[normal[i][j] / (scale[i] * scale[j]) for j in range(k)] for i in range(k)]
    lower = [[0.0] * k for _ in range(k)]
    for i in range(k):
        for j in range(i + 1):
            v = a[i][j] - sum(lower[i][m] * lower[j][m] for m in range(j))
            if i != j:
                lower[i][j] = v / lower[j][j]
            elif v > 0:
                lower[i][i] = math.sqrt(v)
            else:
                return None
    z = [0.0] * k
    for i in range(k):
        rhs = normal[i][k] / scale[i]
        z[i] = (rhs - sum(lower[i][m] * z[m] for m in range(i))) / lower[i][i]
    c = [0.0] * k
    for i in reversed(range(k)):
        c[i] = (z[i] - sum(lower[m][i] * c[m] for m in range(i + 1, k))) / lower[i][i]
    if any(x < 0 for x in c):
        return None
    return [c[i] / scale[i] for i in range(k)]
