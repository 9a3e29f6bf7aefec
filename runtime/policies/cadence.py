"""Cadence: keep the foreground's inter-token latency under a target the user states.

Each iteration it predicts, with a cost model of iteration time against composition (passes
over the weights, decode tokens, prompt tokens, attention work), the largest prompt chunk
that keeps the iteration, and so every foreground token, under `itl_ms`. The model is fitted
online, by non-negative least squares, to the last `window` completed iterations together
with the startup probe's iterations (which keep it well-posed before the run has varied
chunk sizes). While no foreground decode is active the background gets the whole batch.

Unlike DLFP it does not wait for a slow iteration to react: a chunk deep in a long document
costs more attention work, and the model knows that before the chunk runs. The target is a
tail target: `tail_pct` percent of the foreground's token gaps (by default 99, so the P99 a
user would measure) should stay under it. What the model cannot know, a shared machine's
jitter and its own misfit, is taken off the target as a margin: the `tail_pct` percentile of
the current model's errors on the recent iterations that held foreground decodes beside a
prompt chunk (errors of the model in use, so a model corrected early in a run does not keep
paying for its first guesses). A chat's own prompt chunk gets the margin of the iterations
that held only chats' prompt work: a chat's shallow chunk is often predicted better than a
deep document chunk (not in every run), and a waiting chat should not pay for the
documents' unpredictability. The host's own time between device calls is taken
off too, since a foreground token waits for it: the target is a gap between tokens the user
sees, not a device time.

Why the tail and not the mean: on a CPU an iteration beside a decode costs a fixed part
(passes, sampled rows) plus ~2-4 ms per prompt token, so background throughput is set by the
mean iteration time whichever policy chose it, while the P99 a person feels is set by how
far iterations scatter above that mean. Predicting each iteration scatters them less than
DLFP's proportional steps; spending that on the tail gives a lower P99 at the same
throughput (RESULTS.md, section 0).

Why not fill every chat iteration up to the target: documents' work rides beside a chat's
decodes only up to `share` of the device's time while chats decode. On llama.cpp a prompt
chunk beside decodes is a pass of its own, so riding along saves the documents nothing,
while every slower chat token keeps the chat alive longer; the next chat then more often
arrives while others decode, and its prompt is computed beside their decodes under their
ITL (one run: 9 of 14 chats arrived beside others at ~7 s per answer, 3 of 14 without
documents at ~1.3 s). What documents do not take beside a chat they take once it has
answered, as large background-only chunks (abortable, so a new chat does not wait for
them), which cost fewer passes per token than small chunks. With chats that never pause,
`share` is what the documents are guaranteed. It is kept with a credit: each chat iteration
earns `share` of its time, and the documents' part of it (its time beyond the chats' own
decodes) spends it; while the credit is spent their prompt and decodes wait.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.costmodel import CostModel
from edgeprefill.runtime.core.plan import IterationTiming, SchedState
from edgeprefill.runtime.core.profile import DeviceProfile
from edgeprefill.runtime.policies.registry import POLICIES

# The most iterations in a row the foreground's target may keep prompt work at 0 tokens.
MAX_STARVED = 8
# The margin never takes more than this share of the target. Errors are measured only on
# iterations that mix chats and prompt work; a margin that left no room for prompt work
# would stop those iterations, so one outlier (a stall of the shared machine) would stay
# the tail percentile of a shrinking sample and starve the documents (seen: the margin
# crept from 118 to 140 ms of a 100 ms target while only chats decoded).
MAX_MARGIN_SHARE = 0.5
# Documents' share of the device's time while chats decode (see the module's docstring).
DEFAULT_SHARE = 0.5


@POLICIES.register("cadence")
@dataclass
class CadencePolicy(BudgetPolicy):
    name: ClassVar[str] = "cadence"
    required: ClassVar[dict[str, str]] = {
        "_model": "cost model (it is fitted from a device profile only)",
        "itl_ms": "itl_ms (cadence:itl_ms=MS)",
    }
    itl_ms: float | None = None  # None: the device profile's interactive target
    window: int = 256
    min_tokens: int | None = None  # floor while chatting, so documents still progress
    tail_pct: float = 99.0  # share of foreground token gaps (%) to keep under itl_ms
    # A chat's first-token target: its prompt gets the chunks that meet it, whatever the
    # ongoing chats' ITL costs for those iterations (None: each request's own target, 1 s
    # for a chat unless its workload or caller says otherwise).
    ttft_ms: float | None = None
    share: float = DEFAULT_SHARE  # most of the device's time documents take beside chats
    _credit: float = field(default=0.0, init=False, repr=False)  # seconds documents may take
    _model: CostModel | None = field(default=None, init=False, repr=False)
    _anchor: list[IterationTiming] = field(default_factory=list, init=False, repr=False)
    _recent: deque[IterationTiming] = field(default_factory=deque, init=False, repr=False)
    _last_budget: int | None = field(default=None, init=False, repr=False)
    _margin: float = field(default=0.0, init=False, repr=False)
    _chat_margin: float | None = field(default=None, init=False, repr=False)
    # Chats' prompt iterations are rare (a few per chat): kept apart from the window.
    _chats: deque[IterationTiming] = field(
        default_factory=lambda: deque(maxlen=64), init=False, repr=False
    )
    _host: deque[float] = field(default_factory=lambda: deque(maxlen=64), init=False, repr=False)
    _at_risk: int = field(default=0, init=False, repr=False)  # zero budgets in a row

    def __post_init__(self) -> None:
        if self.itl_ms is not None and self.itl_ms <= 0:
            raise ValueError(f"itl_ms must be positive, got {self.itl_ms}")
        if self.ttft_ms is not None and self.ttft_ms <= 0:
            raise ValueError(f"ttft_ms must be positive, got {self.ttft_ms}")
        if self.window < 8:
            raise ValueError(f"window must be at least 8 iterations, got {self.window}")
        if self.min_tokens is not None and self.min_tokens < 0:
            raise ValueError(f"min_tokens must not be negative, got {self.min_tokens}")
        if not 0 < self.share <= 1:
            raise ValueError(f"share must be over 0 and at most 1, got {self.share}")
        if not 50 <= self.tail_pct < 100:
            raise ValueError(f"tail_pct must be at least 50 and under 100, got {self.tail_pct}")
        self._recent = deque(maxlen=self.window)

    def calibrate(self, profile: DeviceProfile) -> None:
        if self.itl_ms is None:
            self.itl_ms = profile.target_s * 1000
        if self.min_tokens is None:
            self.min_tokens = profile.min_chunk
        self._model = profile.cost
        self._anchor = list(profile.timings)

    def foreground_chunk(self, state: SchedState) -> int | None:
        """FlowPrefill's slack idea on a CPU: the smallest chunk for the waiting chat's
        prompt such that its remaining iterations, each the decodes' cost plus the chunk's,
        fit in the time left to its TTFT target; all of it at once when only one iteration
        fits. A target that cannot be met any more gets no floor, only the budget: S-EDF
        drops a request whose deadline is lost rather than stall every other chat's tokens
        for it (a 7k-token question about an unread document, computed at once, stopped the
        other chats for 8 s)."""
        target = state.foreground_ttft_target_s if self.ttft_ms is None else self.ttft_ms / 1000
        if target is None or self._model is None:
            return None
        m, left = self._model, state.foreground_prompt_left
        slack = target - state.foreground_waited_s
        base = m.predict(state.n_decode, 0, 1, state.decode_ctx)  # + the last row: small
        per_token = m.per_prefill_s + m.per_kctx_s * (state.foreground_prompt_pos + left / 2) / 1000
        if base <= 0:  # a model fitted with no cost per iteration: nothing to spread
            return None
        room = slack - per_token * left  # what passes and decodes may take, all iterations
        iterations = math.floor(room / base)  # the most it can be spread over
        if iterations < 1:
            return None
        if iterations == 1:
            return left
        return math.ceil(left / iterations)

    def _documents_wait(self, state: SchedState) -> bool:
        """Documents have spent their share of the chats' iterations."""
        return state.n_decode_foreground > 0 and self.share < 1 and self._credit <= 0

    def defer_background_decodes(self, state: SchedState) -> bool:
        """Leave documents' decodes out while a chat decodes, when their share is spent or
        when with them (and the smallest prompt chunk) the iteration is predicted over the
        target: on a small model every sampled row costs as much as a chat's own token."""
        if state.n_decode_foreground == 0 or self._model is None or self.itl_ms is None:
            return False
        if self._documents_wait(state):
            return True
        floor = self.min_tokens or 0
        t = self._model.predict(
            state.n_decode, floor, 1 if floor else 0, state.decode_ctx, n_sampled=state.n_decode
        )
        return t > self._target_s

    @property
    def _target_s(self) -> float:
        return self._target(self.margin_s)

    def _target(self, margin: float) -> float:
        return self._itl_s - margin - self.host_s

    @property
    def _itl_s(self) -> float:
        return self._need(self.itl_ms, "itl_ms") / 1000

    def _target_for(self, state: SchedState) -> float:
        """The device time an iteration may take: a chat's prompt chunk, planned first,
        with its own margin when enough such iterations were seen."""
        if state.foreground_prompt_left and self._chat_margin is not None:
            return self._target(self._chat_margin)
        return self._target_s

    def budget(self, state: SchedState) -> int | None:
        if state.n_decode_foreground == 0:
            self._last_budget = None
            return None
        model = self._need(self._model, "cost model (device calibration)")
        if not state.foreground_prompt_left and self._documents_wait(state):
            self._last_budget = 0
            return 0
        target = self._target_for(state)
        c = model.max_prefill(target, state.n_decode, state.decode_ctx, state.next_prefill_pos)
        if 0 < state.next_prefill_left <= c:
            c = self._past_prompt_end(model, target, state)
        # Predicted over the target even with no prompt work: give it none, but never for
        # more than a few iterations in a row, so documents still progress.
        self._at_risk = self._at_risk + 1 if c == 0 else 0
        if 0 < self._at_risk <= MAX_STARVED:
            self._last_budget = 0
        else:
            self._at_risk = 0
            self._last_budget = max(c, self.min_tokens or 0)
        return self._last_budget

    def _past_prompt_end(self, model: CostModel, target: float, state: SchedState) -> int:
        """The chunk fits the rest of the prompt, which costs more than its tokens: its last
        token is sampled, and tokens past it open another chunk, another pass over the
        weights. Without this the iterations that end a prompt form the foreground's tail.
        Nothing is added after a chat's prompt: its first token would wait for it (seen: a
        chat's last prompt token beside 41 document tokens, 98 ms instead of ~35)."""
        left, pos = state.next_prefill_left, state.next_prefill_pos
        ctx = state.decode_ctx + left * pos + left * (left + 1) // 2
        t = model.predict(state.n_decode, left, 1, ctx, n_sampled=state.n_decode + 1)
        if t > target:
            return left - 1  # the scheduler keeps the remainder a valid chunk
        if state.foreground_prompt_left:
            return left  # a chat's first token waits for all of it: nothing rides along
        more = model.max_prefill(target - t, 0, 0, 0)  # a new prompt: its pass, at position 0
        return left + (more if more >= (self.min_tokens or 1) else 0)

    @property
    def host_s(self) -> float:
        """The host's share of a foreground token gap (median of recent iterations)."""
        return float(np.median(self._host)) if self._host else 0.0

    @property
    def margin_s(self) -> float:
        """How far recent foreground token gaps ran over the model, at `tail_pct`."""
        return self._margin

    def observe(self, timing: IterationTiming) -> None:
        self._spend(timing)
        if timing.n_decode_foreground and timing.host_s is not None:
            self._host.append(timing.host_s)
        self._recent.append(timing)
        if timing.n_decode_foreground and 0 < timing.n_prefill == timing.n_prefill_foreground:
            self._chats.append(timing)
        if len(self._recent) < 8:
            return
        self._model = CostModel.fit([*self._anchor, *self._recent])
        mixed = [t for t in self._recent if t.n_decode_foreground and t.n_prefill]
        if len(mixed) >= 8:
            self._margin = self._tail_error(mixed)
        if len(self._chats) >= 8:
            self._chat_margin = self._tail_error(list(self._chats))

    def _spend(self, timing: IterationTiming) -> None:
        """Earn `share` of a chat iteration's time; what it took beyond the chats' own
        decodes (as the model prices them) was the documents'. A chat's prompt iteration
        neither earns nor spends: documents have no part in it. The credit starts at 0 with
        each chatting spell, so a chat's first tokens come alone, and never exceeds one
        iteration's share, so a long run of chat-only iterations does not add up to a
        burst of document work."""
        if self.share >= 1:
            return  # documents may fill every chat iteration: nothing to keep
        if not timing.n_decode_foreground:
            self._credit = 0.0
            return
        if timing.n_prefill_foreground:
            return
        model = self._need(self._model, "cost model (device calibration)")
        chats = model.predict(timing.n_decode_foreground, 0, 0, 0)
        documents = max(0.0, timing.duration_s - chats)
        cap = self.share * self._itl_s
        self._credit = min(cap, self._credit + self.share * timing.duration_s - documents)

    def _tail_error(self, timings: list[IterationTiming]) -> float:
        """The gap a person sees, at `tail_pct`: the device's error plus the host's
        deviation from the median that budget() already takes off the target.

        The tail is the error that the `100 - tail_pct` percent of samples above it may
        exceed, and at least one sample always may: a percentile of a few dozen samples is
        their largest, so one stall of the shared machine would be the margin for as long
        as it stays in the sample (seen: one 169 ms iteration, of a kind that takes ~80 ms,
        put a chat's prompt margin at its 50 ms cap for the rest of a run; three chats'
        prompts then ran in half-full iterations and waited 0.8-1 s for their first token)."""
        assert self._model is not None
        median = self.host_s
        host = np.array([0.0 if t.host_s is None else t.host_s - median for t in timings])
        errors = np.sort(self._model.residuals(timings) + host)
        above = max(1, int(len(errors) * (100 - self.tail_pct) / 100))
        cap = MAX_MARGIN_SHARE * self._itl_s
        return min(cap, max(0.0, float(errors[-1 - above])))

    def params(self) -> dict[str, Any]:
        return {
            "itl_ms": self.itl_ms,
            "ttft_ms": self.ttft_ms,
            "tail_pct": self.tail_pct,
            "window": self.window,
            "min_tokens": self.min_tokens,
            "share": self.share,
        }

    def snapshot(self) -> dict[str, Any]:
        m = self._model
        return {
            "budget": self._last_budget,
            "margin_ms": self.margin_s * 1e3,
            "chat_margin_ms": None if self._chat_margin is None else self._chat_margin * 1e3,
            "host_ms": self.host_s * 1e3,
            "credit_ms": self._credit * 1e3,
            "model_ms": None
            if m is None
            else {
                "pass": m.per_pass_s * 1e3,
                "decode": m.per_decode_s * 1e3,
                "prefill": m.per_prefill_s * 1e3,
                "kctx": m.per_kctx_s * 1e3,
            },
        }
