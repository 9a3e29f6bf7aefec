"""First-token targets that follow the device.

A chat's target is, unless its caller gave an absolute one, a multiple of what its prompt
would take alone on this device (the device profile's cost model). An absolute target tuned
on a fast CPU is all or nothing on a slower one: a 350-token prompt alone took 1.1 s on an
AVX2-only EPYC, so a 1 s target made its first-token floor either the whole prompt (a spike
in the other chats' tokens) or, once lost, nothing (the chat starved for 4.5 s).
"""

from __future__ import annotations

import logging

from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.request import Request

log = logging.getLogger("edgeprefill")


class FirstTokenTargets:
    """Estimates each request's prompt alone on this device, and says once per absolute
    target, in numbers, when prompts this long cannot meet it here."""

    def __init__(self, profile: DeviceProfile | None) -> None:
        self.profile = profile
        self._said: set[float] = set()

    def estimate(self, req: Request) -> None:
        """At arrival, and again after a saved prefix is restored (less is left)."""
        if self.profile is None:
            return
        req.ttft_alone_s = self.profile.prompt_alone_s(req.remaining_prompt, req.num_computed)
        target = req.ttft_target_s
        if target is not None and req.ttft_alone_s > target and target not in self._said:
            self._said.add(target)
            log.warning(self.infeasible(req.remaining_prompt, req.ttft_alone_s, target))

    def infeasible(self, n_tokens: int, alone_s: float, target_s: float) -> str:
        assert self.profile is not None
        longest = self.profile.longest_prompt_within(target_s)
        return (
            f"a {n_tokens}-token prompt alone takes {alone_s:.2f} s on this device; the "
            f"{target_s:g} s first-token target cannot be met for prompts over ~{longest} "
            "tokens (give a longer ttft_target_s, or leave it out for a target relative to "
            "this device)"
        )
