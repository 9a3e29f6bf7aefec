"""The host's time in a token gap, as a function of the rows sampled under a grammar.

    host = base + per_constrained * n_constrained

A foreground token waits for the host as well as the device: planning, filling the batch,
sampling (`IterationTiming.host_s`). Plain rows cost that little and evenly (~1 ms an
iteration here), so a median of recent iterations was the whole model. A row sampled
under a grammar (a JSON schema, a tool call) costs more and unevenly: the drawn token is
checked alone, most often accepted; on a rejection the likeliest candidates are checked in
turn (benchmarks/history.md, section AL: a P99 host time of 7-46 ms an iteration with JSON
chats against ~1.2 ms without). A median over all iterations would charge an iteration
of plain chats for a JSON chat's grammar and a JSON chat's iteration too little; counted
per row, each iteration is charged for the rows it holds.

Both terms are medians (robust to one stall of a shared machine, as the tail is the
margins' to take): `base` over iterations without a constrained row, `per_constrained`
over those with, of what they took beyond `base`, per constrained row.
"""

from __future__ import annotations

import statistics
from collections import deque

from edgeprefill.runtime.core.plan import IterationTiming


class HostCost:
    def __init__(self, kept: int) -> None:
        self._plain: deque[float] = deque(maxlen=kept)
        self._constrained: deque[tuple[float, int]] = deque(maxlen=kept)
        self.base_s = 0.0
        self.per_constrained_s = 0.0

    def add(self, timing: IterationTiming) -> None:
        """A completed iteration's host time (none recorded: nothing to learn)."""
        if timing.host_s is None:
            return
        if timing.n_constrained:
            self._constrained.append((timing.host_s, timing.n_constrained))
        else:
            self._plain.append(timing.host_s)

    def update(self) -> None:
        """Re-measure both terms from the iterations kept (called at a refit, not after
        each iteration: a median over a few dozen values is host time a token waits for)."""
        if self._plain:
            self.base_s = statistics.median(self._plain)
        if self._constrained:
            self.per_constrained_s = statistics.median(
                max(host - self.base_s, 0.0) / n for host, n in self._constrained
            )

    def predict(self, n_constrained: int) -> float:
        return self.base_s + self.per_constrained_s * n_constrained
