"""A waiting foreground prompt's first-token floor: a guaranteed rate, so that no prompt
starves, and FlowPrefill's slack idea where its caller gave an absolute target."""

from __future__ import annotations

import math

from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.plan import SchedState
from edgeprefill.runtime.core.request import FOREGROUND_SLOWDOWN

# Where the decodes alone fill the ITL target, a late prompt waits at one piece an
# iteration for one of them to end if one is certain to (its max_tokens) within this many
# times its own allowance (slowdown x its time alone); else it takes the rate. Measured in
# the simulator calibrated at one thread (bursty workload, 6 seeds): 1x let two seeds' P99
# ITL to 141-155 ms against DLFP's 116-119; 2x and 4x held 100-102 ms in all six.
SLOT_WAIT = 2.0


def first_token_floor(
    model: CostModel, state: SchedState, target_s: float | None, itl_s: float | None = None
) -> int | None:
    """The fewest tokens the waiting foreground prompt computes this iteration (the budget
    may give it more): the more of two rates.

    - Guaranteed, once the prompt is late: the budget serves it until it has waited
      (slowdown - 1)/slowdown of what is left of it alone (a 7k-token question is mostly
      read under the ITL target); from then on chunks cost at least 1/(slowdown - 1) of the
      rest of their iteration, so beside a few decodes it finishes within about
      slowdown + 1 times its time alone. But never past `itl_s` (the target a chat's chunk
      is sized to: the ITL target less the tail of the chats' own prediction errors), and at
      least one token; where the decodes alone fill the target, one piece an iteration while
      one of them is certain to end soon (`SLOT_WAIT`), else the rate whatever it costs
      them (no starving beside long answers).
    - In time for an absolute target, while it can be met: the fewest tokens per iteration
      whose remaining iterations, each the decodes' cost plus the chunk's, fit the time left
      (all of it when only one iteration fits). A caller who set one asked for it whatever
      it costs the others.

    Before the guaranteed rate a lost target got no floor, as S-EDF drops a request whose
    deadline is lost rather than stall every other request for it (a 7k-token question
    computed at once stopped the other chats for 8 s). On a CPU half as fast, ordinary chats
    then waited 4.5 s in chunks of a few tokens beside other chats' decodes (issue 23).
    Without the ITL cap the rate's iterations took up to 1.5x what the decodes take: on the
    bursty workload at one thread each chat that came in a burst went in at that rate, became
    one more decode (~20 ms a row there) and made the next one later still, up to 8 chats
    decoding at 250 ms a token (P99 ITL 205 ms against DLFP's 115). Capped, a chat waits
    beside decodes that fill the target until one of them ends. Capped at the ITL target
    itself rather than less the errors, the chunks beside two or three decodes took 120-137
    ms where 100 were predicted (small batches cost far more per token than the model's
    line at one thread): P99 ITL 134/120/129 ms against 111/114 less the errors (history
    section I)."""
    left = state.foreground_prompt_left
    base = model.predict(state.n_decode, 0, 1, state.decode_ctx)  # + the last row: small
    if base <= 0 or left <= 0:  # a model fitted with no cost per iteration: nothing to spread
        return None
    alone = model.prompt_tokens_s(left, state.foreground_prompt_pos)
    slowdown = state.foreground_ttft_slowdown or FOREGROUND_SLOWDOWN
    floors = []
    if state.foreground_waited_s >= alone * (slowdown - 1) / slowdown:  # late: the rate binds
        rate = _spread(left, math.floor((slowdown - 1) * alone / base))
        if itl_s is not None and _waits(state, base, itl_s, SLOT_WAIT * slowdown * alone):
            rate = min(rate, _within(model, state, itl_s))
        floors.append(rate)
    if target_s is not None:
        in_time = math.floor((target_s - state.foreground_waited_s - alone) / base)
        if in_time >= 1:
            floors.append(_spread(left, in_time))
    return max(floors) if floors else None


def _spread(left: int, iterations: int) -> int:
    return left if iterations <= 1 else math.ceil(left / iterations)


def _waits(state: SchedState, base: float, itl_s: float, wait_s: float) -> bool:
    """Whether the rate keeps within the ITL target: always while the decodes leave room
    under it; where they alone fill it, only while one of them is certain to end (its
    max_tokens) within `wait_s`, so that a chat beside long answers is not starved."""
    if base < itl_s:
        return True
    ends = state.foreground_decode_ends
    return ends is not None and ends * base <= wait_s


def _within(model: CostModel, state: SchedState, itl_s: float) -> int:
    """The most of the prompt whose iteration is predicted within `itl_s`, its first
    token's row included when the chunk ends it; at least one token."""
    left, pos = state.foreground_prompt_left, state.foreground_prompt_pos
    c = model.max_prefill(itl_s, state.n_decode, state.decode_ctx, pos)
    if c >= left and model.prompt_end_s(state.n_decode, state.decode_ctx, left, pos) > itl_s:
        c = left - 1
    return max(min(c, left), 1)
