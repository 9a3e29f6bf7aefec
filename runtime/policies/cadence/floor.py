"""A waiting foreground prompt's first-token floor: FlowPrefill's slack idea on a CPU."""

from __future__ import annotations

import math

from edgeprefill.runtime.core.costmodel import CostModel
from edgeprefill.runtime.core.plan import SchedState


def first_token_floor(model: CostModel, state: SchedState, target_s: float) -> int | None:
    """The smallest chunk for the waiting foreground prompt such that its remaining
    iterations, each the decodes' cost plus the chunk's, fit in the time left to its TTFT
    target; all of it at once when only one iteration fits. A target that cannot be met any
    more gets no floor, only the budget: S-EDF drops a request whose deadline is lost rather
    than stall every other foreground request's tokens for it (a 7k-token question about an unread
    document, computed at once, stopped the other chats for 8 s)."""
    left = state.foreground_prompt_left
    slack = target_s - state.foreground_waited_s
    base = model.predict(state.n_decode, 0, 1, state.decode_ctx)  # + the last row: small
    pos = state.foreground_prompt_pos + left / 2
    per_token = model.per_prefill_s + model.per_kctx_s * pos / 1000
    if base <= 0:  # a model fitted with no cost per iteration: nothing to spread
        return None
    room = slack - per_token * left  # what passes and decodes may take, all iterations
    iterations = math.floor(room / base)  # the most it can be spread over
    if iterations < 1:
        return None
    if iterations == 1:
        return left
    return math.ceil(left / iterations)
