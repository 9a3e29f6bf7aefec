"""A waiting foreground prompt's first-token floor: a guaranteed rate, so that no prompt
starves, and FlowPrefill's slack idea where its caller gave an absolute target."""

from __future__ import annotations

import math

from edgeprefill.runtime.core.costmodel import CostModel
from edgeprefill.runtime.core.plan import SchedState
from edgeprefill.runtime.core.request import DEFAULT_TTFT_SLOWDOWN

# The rate for a prompt with no relative target of its own.
DEFAULT_SLOWDOWN = DEFAULT_TTFT_SLOWDOWN["foreground"] or 3.0


def first_token_floor(model: CostModel, state: SchedState, target_s: float | None) -> int | None:
    """The fewest tokens the waiting foreground prompt computes this iteration (the budget
    may give it more): the more of two rates.

    - Guaranteed, once the prompt is late: the budget serves it until it has waited
      (slowdown - 1)/slowdown of what is left of it alone (a 7k-token question is mostly
      read under the ITL target); from then on chunks cost at least 1/(slowdown - 1) of the
      rest of their iteration, so beside any number of decodes it finishes within about
      slowdown + 1 times its time alone, and its iterations take at most
      slowdown/(slowdown - 1) of what the decodes take.
    - In time for an absolute target, while it can still be met: the fewest tokens per
      iteration whose remaining iterations, each the decodes' cost plus the chunk's, fit
      the time left (all of it when only one iteration fits).

    Before the guaranteed rate a lost target got no floor, as S-EDF drops a request whose
    deadline is lost rather than stall every other request for it (a 7k-token question
    computed at once stopped the other chats for 8 s). On a CPU half as fast, ordinary chats
    then waited 4.5 s in chunks of a few tokens beside other chats' decodes (issue 23). A
    third rate, filling the iteration to the ITL target itself rather than less the budget's
    margins, raised the P99 ITL beside 7k-token questions from 108 to 129 ms: left out."""
    left = state.foreground_prompt_left
    base = model.predict(state.n_decode, 0, 1, state.decode_ctx)  # + the last row: small
    if base <= 0 or left <= 0:  # a model fitted with no cost per iteration: nothing to spread
        return None
    pos = state.foreground_prompt_pos + left / 2
    alone = (model.per_prefill_s + model.per_kctx_s * pos / 1000) * left
    slowdown = state.foreground_ttft_slowdown or DEFAULT_SLOWDOWN
    # The most iterations it may be spread over (None: the budget alone serves it).
    spread: int | None = None
    if state.foreground_waited_s >= alone * (slowdown - 1) / slowdown:  # late: the rate binds
        spread = math.floor((slowdown - 1) * alone / base)
    if target_s is not None:
        in_time = math.floor((target_s - state.foreground_waited_s - alone) / base)
        if in_time >= 1:
            spread = in_time if spread is None else min(spread, in_time)
    if spread is None:
        return None
    return left if spread <= 1 else math.ceil(left / spread)
