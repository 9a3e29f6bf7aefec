"""How long an iteration that cannot be stopped may run.

llama.cpp's backend stops a documents-only micro-batch when a chat arrives (preemption).
vLLM has no abort inside an iteration (its step), so a chat that arrives during one waits
for all of it: on vLLM's CPU build on an AVX2-only EPYC a 2,048-token documents-only
iteration took 13.9 s, and chats that arrived during it waited 9-11 s for their first
token. Where a backend cannot stop an iteration, one with no foreground work in it is sized
so that its predicted time stays within the wait a chat's first-token allowance leaves:
(slowdown - 1) times a chat's prompt alone on this device, and never under a wait nobody
notices. On a GPU, where a 2,048-token iteration takes ~0.1 s, that changes nothing.
"""

from __future__ import annotations

import statistics
from collections import deque

from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.plan import SchedState
from edgeprefill.runtime.core.request import FOREGROUND_SLOWDOWN

# A wait before a first token that a person does not notice.
UNNOTICED_WAIT_S = 0.25
# The chat prompt the allowance is priced at before any chat has arrived (tokens); after,
# the median of the last RECENT chats' prompts.
FIRST_PROMPT = 256
RECENT = 64


class IterationLimit:
    def __init__(
        self,
        profile: DeviceProfile,
        slowdown: float = FOREGROUND_SLOWDOWN,
        min_wait_s: float = UNNOTICED_WAIT_S,
    ) -> None:
        self.profile = profile
        self.slowdown = slowdown
        self.min_wait_s = min_wait_s
        self._prompts: deque[int] = deque(maxlen=RECENT)

    def saw_prompt(self, n_tokens: int) -> None:
        """A foreground prompt arrived: the allowance follows the chats' prompts."""
        self._prompts.append(n_tokens)

    @property
    def wait_s(self) -> float:
        """The longest a chat that arrives during an iteration should wait for it."""
        typical = int(statistics.median(self._prompts)) if self._prompts else FIRST_PROMPT
        alone = self.profile.prompt_alone_s(typical)
        return max((self.slowdown - 1) * alone, self.min_wait_s)

    def cap(self, state: SchedState) -> int | None:
        """The most background prompt tokens in an iteration with no foreground work in it (at
        least the profile's smallest chunk, so documents progress); None where the iteration
        holds foreground work, which the policy's budget sizes, or no prompt work."""
        if state.n_decode_foreground or state.foreground_prompt_left:
            return None
        if not state.next_prompt_left:
            return None
        n = self.profile.cost.max_prefill(
            self.wait_s, state.n_decode, state.decode_ctx, state.next_prompt_pos
        )
        return max(n, self.profile.min_chunk)
