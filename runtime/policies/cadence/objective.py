"""How cadence weighs a waiting chat against the chats already streaming: the token gap the
running chats get while a new chat's prompt computes.

The rule: the worst slowdown of the two sides is made as small as it can be, within the
readable-rate floor. A running chat's slowdown is its token gap over its decode alone (the
decodes' iteration); the waiting chat's is its first token, on the present course, over its
reference (its prompt alone). With a token gap `u` times the decodes' iteration, the prompt
gets `u - 1` of it per iteration, so its first token comes after `waited + left * u/(u-1)`;
the two slowdowns meet where

    reference * u**2 - (reference + waited + left) * u + waited = 0

(`left`: the rest of the prompt alone). A chat that has not waited meets them at
u = 1 + left/reference, about 2: both sides about twice their time alone; one that has
waited longer gets a longer gap. The gap
is never less than the ITL target (a chat gets at least the chunk it got before) nor more
than the readable-rate floor.

Why: sized to the ITL target alone, a chat arriving beside three decoding chats on a slow
CPU (67 ms of a 100 ms target, less margins) went in at ~6 tokens an iteration and waited
5.5 s for a 0.78 s prompt (issue 41), protecting streams that already ran faster than anyone
reads.
"""

from __future__ import annotations

import logging
import math

from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.plan import SchedState

log = logging.getLogger("edgeprefill")

# The longest token gap a running chat is given for a waiting one, and its gap wherever the
# device cannot decode the running chats within the ITL target: ~7 tokens a second, still
# faster than a person reads.
DEFAULT_READABLE_MS = 150.0


class ChatBalance:
    """The token gap for an iteration with a waiting chat's prompt, and a note, once per
    number of running chats, where the device (its calibrated cost model `device`, not the
    online fit, which a busy moment of a shared machine inflates) cannot decode them within
    the ITL target."""

    def __init__(self, itl_s: float, readable_s: float, device: CostModel) -> None:
        self.itl_s, self.readable_s, self.device = itl_s, readable_s, device
        self._said: set[int] = set()

    def gap_s(self, model: CostModel, state: SchedState) -> float:
        left, pos = state.foreground_prompt_left, state.foreground_prompt_pos
        if left <= 0:
            return self.itl_s
        base = model.predict(state.n_decode, 0, 1, state.decode_ctx)
        if base <= 0:
            return self.itl_s
        if state.foreground_prompts_behind:  # each one waits for this prompt too
            return self.readable_s
        left_s = model.prompt_tokens_s(left, pos)
        reference = model.per_pass_s + model.per_sampled_s + model.prompt_tokens_s(pos + left)
        waited = state.foreground_waited_s
        b = reference + waited + left_s
        u = (b + math.sqrt(b * b - 4 * reference * waited)) / (2 * reference)
        return min(self.readable_s, max(self.itl_s, u * base))

    def note(self, state: SchedState) -> None:
        n = state.n_decode_foreground
        if not n or n in self._said:
            return
        decode_s = self.device.predict(n, 0, 0, state.decode_ctx_foreground)
        if decode_s > self.itl_s:
            self._said.add(n)
            log.warning(
                f"{n} chats decoding take {decode_s * 1e3:.0f} ms an iteration on this device, "
                f"over the {self.itl_s * 1e3:.0f} ms ITL target: a waiting chat's prompt may "
                f"stretch their token gaps to the readable-rate floor of "
                f"{self.readable_s * 1e3:.0f} ms (cadence:readable_ms)"
            )
