"""The background's share of the device's time while the foreground decodes.

On llama.cpp a prompt chunk beside decodes is a pass of its own, so riding along saves the
background nothing, while every slower foreground token keeps a chat alive longer; the next
chat then more often arrives while others decode, and its prompt is computed beside their
decodes under their ITL (one run: 9 of 14 chats arrived beside others at ~7 s per answer, 3
of 14 without documents at ~1.3 s). What the background does not take beside foreground
decodes it takes once they end, as large background-only chunks (abortable, so a new chat
does not wait for them), which cost fewer passes per token than small chunks. With a
foreground that never pauses, `share` is what the background is guaranteed.
"""

from __future__ import annotations

from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.plan import IterationTiming


class ShareCredit:
    """Each iteration with foreground decodes earns `share` of its time; the background's
    part of it (its time beyond the foreground decodes, as the model prices them) spends it.
    While the credit is spent the background's prompt work and decodes wait."""

    def __init__(self, share: float, itl_s: float) -> None:
        self.share = share
        # Never more than one iteration's share: a long run of foreground-only iterations
        # does not add up to a burst of background work.
        self.cap_s = share * itl_s
        self.credit_s = 0.0

    def spent(self, n_decode_foreground: int) -> bool:
        """The background has spent its share of the foreground's iterations."""
        return n_decode_foreground > 0 and self.share < 1 and self.credit_s <= 0

    def add(self, timing: IterationTiming, model: CostModel) -> None:
        """A foreground prompt's iteration neither earns nor spends: the background has no
        part in it. The credit starts at 0 with each spell of foreground decodes, so a
        chat's first tokens come alone."""
        if self.share >= 1:
            return  # the background may fill every iteration: nothing to keep
        if not timing.n_decode_foreground:
            self.credit_s = 0.0
            return
        if timing.n_prefill_foreground:
            return
        foreground = model.predict(timing.n_decode_foreground, 0, 0, 0)
        background = max(0.0, timing.duration_s - foreground)
        self.credit_s = min(self.cap_s, self.credit_s + self.share * timing.duration_s - background)
