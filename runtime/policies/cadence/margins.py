"""What cadence takes off its target for what the model cannot know: a shared machine's
jitter, its own misfit, and the host's time between device calls (a foreground token waits
for it too: the target is a gap between tokens a user sees, not a device time), counted
per row sampled under a grammar (`costs.host.HostCost`).

Errors are those of the model in use, on the recent iterations that held foreground decodes
beside prompt work, so a model corrected early in a run does not keep paying for its first
guesses. A foreground prompt's chunk gets the margin of the iterations that held only foreground
prompt work: a chat's shallow chunk is often predicted better than a deep document chunk
(not in every run), and a waiting chat should not pay for the background's
unpredictability.
"""

from __future__ import annotations

import numpy as np

from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.costs.host import HostCost
from edgeprefill.runtime.core.plan import IterationTiming
from edgeprefill.runtime.policies.cadence.fit import MIN_RECENT, Rows

# Iterations of each kind kept apart from the fit's window (foreground prompt iterations
# are rare, a few per chat) and host times the median is taken over.
KEPT = 64


class TailMargins:
    def __init__(self, tail_pct: float, cap_s: float) -> None:
        self.tail_pct = tail_pct
        # The margin never exceeds this. Errors are measured only on iterations that mix
        # foreground decodes and prompt work; a margin that left no room for prompt work would stop
        # those iterations, so one outlier (a stall of the shared machine) would stay the
        # tail of a shrinking sample and starve the background (seen: the margin crept from
        # 118 to 140 ms of a 100 ms target while only the foreground decoded).
        self.cap_s = cap_s
        self.margin_s = 0.0  # for foreground decodes beside prompt work
        self.prompt_margin_s: float | None = None  # for a foreground prompt's chunk
        self._prompts = Rows(KEPT)
        self.host = HostCost(KEPT)  # the host's share of a token gap

    def add(self, timing: IterationTiming) -> None:
        """A completed iteration: its host time, and its errors if it held only foreground prompt work."""
        if timing.n_decode_foreground:
            self.host.add(timing)
        if timing.n_decode_foreground and 0 < timing.n_prefill == timing.n_prefill_foreground:
            self._prompts.append(timing)

    def surprised(self, timing: IterationTiming, model: CostModel) -> bool:
        """Foreground decodes beside prompt work (the iterations the margin is measured on)
        took longer than `model` and the margin allowed."""
        if not (timing.n_decode_foreground and timing.n_prefill):
            return False
        predicted = model.predict(
            timing.n_decode, timing.n_prefill, timing.n_chunks, timing.ctx_work, timing.sampled
        )
        return timing.duration_s - predicted > self.margin_s

    def update(self, model: CostModel, recent: Rows) -> None:
        """Re-measure the host's cost and both margins against `model` (just refitted to
        `recent`)."""
        self.host.update()
        mixed = recent.mixed[: len(recent)]
        if mixed.sum() >= MIN_RECENT:
            self.margin_s = self._tail_error(model, *recent.rows(mixed))
        if len(self._prompts) >= MIN_RECENT:
            self.prompt_margin_s = self._tail_error(model, *self._prompts.rows())

    def _tail_error(
        self,
        model: CostModel,
        x: np.ndarray,
        y: np.ndarray,
        host: np.ndarray,
        constrained: np.ndarray,
    ) -> float:
        """The gap a person sees, at `tail_pct`: the device's error plus the host's
        deviation from its predicted time, which the target already takes off.

        The tail is the error that the `100 - tail_pct` percent of samples above it may
        exceed, and at least one sample always may: a percentile of a few dozen samples is
        their largest, so one stall of the shared machine would be the margin for as long
        as it stays in the sample (seen: one 169 ms iteration, of a kind that takes ~80 ms,
        put a chat's prompt margin at its 50 ms cap for the rest of a run; three chats'
        prompts then ran in half-full iterations and waited 0.8-1 s for their first token)."""
        predicted = self.host.base_s + self.host.per_constrained_s * constrained
        deviation = host - predicted
        deviation[np.isnan(deviation)] = 0.0  # no host time recorded: none to add
        errors = np.sort(y - x @ model.coef + deviation)
        above = max(1, int(len(errors) * (100 - self.tail_pct) / 100))
        return min(self.cap_s, max(0.0, float(errors[-1 - above])))
