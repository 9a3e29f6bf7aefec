"""The documents' share of the device's time while chats decode.

On llama.cpp a prompt chunk beside decodes is a pass of its own, so riding along saves the
documents nothing, while every slower chat token keeps the chat alive longer; the next chat
then more often arrives while others decode, and its prompt is computed beside their
decodes under their ITL (one run: 9 of 14 chats arrived beside others at ~7 s per answer, 3
of 14 without documents at ~1.3 s). What documents do not take beside a chat they take
once it has answered, as large background-only chunks (abortable, so a new chat does not
wait for them), which cost fewer passes per token than small chunks. With chats that never
pause, `share` is what the documents are guaranteed.
"""

from __future__ import annotations

from edgeprefill.runtime.core.costmodel import CostModel
from edgeprefill.runtime.core.plan import IterationTiming


class ShareCredit:
    """Each chat iteration earns `share` of its time; the documents' part of it (its time
    beyond the chats' own decodes, as the model prices them) spends it. While the credit is
    spent the documents' prompt and decodes wait."""

    def __init__(self, share: float, itl_s: float) -> None:
        self.share = share
        # Never more than one iteration's share: a long run of chat-only iterations does
        # not add up to a burst of document work.
        self.cap_s = share * itl_s
        self.credit_s = 0.0

    def spent(self, n_decode_foreground: int) -> bool:
        """Documents have spent their share of the chats' iterations."""
        return n_decode_foreground > 0 and self.share < 1 and self.credit_s <= 0

    def add(self, timing: IterationTiming, model: CostModel) -> None:
        """A chat's prompt iteration neither earns nor spends: documents have no part in
        it. The credit starts at 0 with each chatting spell, so a chat's first tokens come
        alone."""
        if self.share >= 1:
            return  # documents may fill every chat iteration: nothing to keep
        if not timing.n_decode_foreground:
            self.credit_s = 0.0
            return
        if timing.n_prefill_foreground:
            return
        chats = model.predict(timing.n_decode_foreground, 0, 0, 0)
        documents = max(0.0, timing.duration_s - chats)
        self.credit_s = min(self.cap_s, self.credit_s + self.share * timing.duration_s - documents)
