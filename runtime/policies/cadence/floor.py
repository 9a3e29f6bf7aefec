"""A waiting foreground prompt's first-token floor: FlowPrefill's slack idea on a CPU, with
a guaranteed rate so that no prompt starves once its deadline is lost."""

from __future__ import annotations

import math

from edgeprefill.runtime.core.costmodel import CostModel
from edgeprefill.runtime.core.plan import SchedState

# A waiting foreground prompt always progresses at least as fast as one that would finish
# within this multiple of its time alone: each chunk costs at least 1/(3-1) of the rest of
# its iteration, which then takes at most 1.5 times what the other requests' work takes.
PROGRESS_SLOWDOWN = 3.0


def first_token_floor(model: CostModel, state: SchedState, target_s: float | None) -> int | None:
    """The smallest chunk for the waiting foreground prompt such that its remaining
    iterations, each the decodes' cost plus the chunk's, fit in the time left to its TTFT
    target (all of it at once when only one iteration fits), and never less than the
    guaranteed rate.

    A lost target used to get no floor at all, as S-EDF drops a request whose deadline is
    lost rather than stall every other request for it (a 7k-token question computed at once
    stopped the other chats for 8 s). But on a CPU half as fast, ordinary chats then waited
    4.5 s in chunks of a few tokens beside other chats' decodes. The guaranteed rate covers
    both: a long question progresses in chunks that add at most half to an iteration, and
    no chat waits more than a bounded multiple of its time alone."""
    left = state.foreground_prompt_left
    base = model.predict(state.n_decode, 0, 1, state.decode_ctx)  # + the last row: small
    pos = state.foreground_prompt_pos + left / 2
    per_token = model.per_prefill_s + model.per_kctx_s * pos / 1000
    if base <= 0 or left <= 0:  # a model fitted with no cost per iteration: nothing to spread
        return None
    alone = per_token * left
    # The most iterations it may be spread over: at the guaranteed rate, and within the time
    # left to its target while that can still be met.
    spread = math.floor((PROGRESS_SLOWDOWN - 1) * alone / base)
    if target_s is not None:
        in_time = math.floor((target_s - state.foreground_waited_s - alone) / base)
        if in_time >= 1:
            spread = min(spread, in_time)
    return left if spread <= 1 else math.ceil(left / spread)
