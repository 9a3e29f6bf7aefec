"""Cadence: keep the foreground's inter-token latency under a target the user states.

Each iteration it predicts, with a cost model of iteration time against composition (passes
over the weights, sampled rows, prompt tokens, attention work; `fit`), the largest prompt
chunk that keeps the iteration, and so every foreground token, under `itl_ms`, less the
margins for what the model cannot know (`margins`). While no foreground decode is active
the background gets the whole batch. Background work rides beside foreground decodes only up to `share` of the
device's time (`share`), and a waiting foreground prompt gets the chunks that meet its
first-token target (`floor`).

Unlike DLFP it does not wait for a slow iteration to react: a chunk deep in a long document
costs more attention work, and the model knows that before the chunk runs. The target is a
tail target: `tail_pct` percent of the foreground's token gaps (by default 99, so the P99 a
user would measure) should stay under it.

Why the tail and not the mean: on a CPU an iteration beside a decode costs a fixed part
(passes, sampled rows) plus ~2-4 ms per prompt token, so background throughput is set by the
mean iteration time whichever policy chose it, while the P99 a person feels is set by how
far iterations scatter above that mean. Predicting each iteration scatters them less than
DLFP's proportional steps; spending that on the tail gives a lower P99 at the same
throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.plan import Decision, IterationTiming, SchedState
from edgeprefill.runtime.policies.cadence.fit import OnlineFit
from edgeprefill.runtime.policies.cadence.floor import first_token_floor
from edgeprefill.runtime.policies.cadence.margins import TailMargins
from edgeprefill.runtime.policies.cadence.objective import DEFAULT_READABLE_MS, ChatBalance
from edgeprefill.runtime.policies.cadence.share import ShareCredit
from edgeprefill.runtime.policies.registry import POLICIES

# The most iterations in a row the foreground's target may keep prompt work at 0 tokens.
MAX_STARVED = 8
# The margins never take more than this share of the target (see `TailMargins.cap_s`).
MAX_MARGIN_SHARE = 0.5
# The background's share of the device's time while the foreground decodes (see `share`):
# 0.3 kept the chats' mean and P95 first-token times within 1.3x of the same chats alone at
# one thread in 3 of 3 seeds where 0.5 did in 0 of 3, documents as fast (history, section J).
DEFAULT_SHARE = 0.3


@POLICIES.register("cadence")
@dataclass
class CadencePolicy(BudgetPolicy):
    name: ClassVar[str] = "cadence"
    baseline: ClassVar[bool] = False  # ours: compared with the papers' policies
    required: ClassVar[dict[str, str]] = {
        "_fit": "cost model (it is fitted from a device profile only)",
        "itl_ms": "itl_ms (cadence:itl_ms=MS)",
    }
    itl_ms: float | None = None  # None: the device profile's interactive target
    window: int = 256
    min_tokens: int | None = None  # floor beside foreground decodes, so background work progresses
    tail_pct: float = 99.0  # share of foreground token gaps (%) to keep under itl_ms
    # A foreground prompt's first-token target: it gets the chunks that meet it, whatever
    # the foreground decodes' ITL costs for those iterations (None: each request's own
    # absolute target, if any; with none, it still gets the guaranteed rate of `floor`).
    ttft_ms: float | None = None
    share: float = (
        DEFAULT_SHARE  # most of the device's time background work takes beside foreground decodes
    )
    # The readable-rate floor: the longest token gap a waiting chat's prompt may stretch
    # the running chats' to (`objective`), and theirs where the device cannot decode them
    # within itl_ms at all.
    readable_ms: float = DEFAULT_READABLE_MS
    _fit: OnlineFit | None = field(default=None, init=False, repr=False)
    _margins: TailMargins | None = field(default=None, init=False, repr=False)
    _credit: ShareCredit | None = field(default=None, init=False, repr=False)
    _last_budget: int | None = field(default=None, init=False, repr=False)
    _at_risk: int = field(default=0, init=False, repr=False)  # zero budgets in a row
    _balance: ChatBalance | None = field(default=None, init=False, repr=False)

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
        if self.readable_ms <= 0:
            raise ValueError(f"readable_ms must be positive, got {self.readable_ms}")
        if not 50 <= self.tail_pct < 100:
            raise ValueError(f"tail_pct must be at least 50 and under 100, got {self.tail_pct}")

    def calibrate(self, profile: DeviceProfile) -> None:
        if self.itl_ms is None:
            self.itl_ms = profile.target_s * 1000
        if self.min_tokens is None:
            self.min_tokens = profile.min_chunk
        self._fit = OnlineFit(profile.cost, profile.timings, self.window)
        self._margins = TailMargins(self.tail_pct, MAX_MARGIN_SHARE * self._itl_s)
        self._credit = ShareCredit(self.share, self._itl_s)
        readable_s = max(self.readable_ms / 1000, self._itl_s)
        self._balance = ChatBalance(self._itl_s, readable_s, profile.cost)

    @property
    def _itl_s(self) -> float:
        return self._need(self.itl_ms, "itl_ms") / 1000

    @property
    def _model(self) -> CostModel:
        return self._parts()[0].model

    def _parts(self) -> tuple[OnlineFit, TailMargins, ShareCredit]:
        """What `calibrate` made, checked once a decision or observation (both run between
        two device calls, where a chat's token waits)."""
        fit, margins, credit = self._fit, self._margins, self._credit
        if fit is None or margins is None or credit is None:
            raise RuntimeError(f"policy {self.name} used before check_ready: no device calibration")
        return fit, margins, credit

    # --- before an iteration ------------------------------------------------------------
    def decide(self, state: SchedState) -> Decision:
        _, margins, credit = self._parts()
        assert self._balance is not None
        self._balance.note(state)
        # With every decode in it: whether the background's decodes ride is decided on it.
        full = self._target(margins, state)
        defer = self._defers(state, full, credit)
        riders = None if defer else self._riders(state, full)
        seen = state.without_background_decodes(riders or 0) if defer or riders else state
        target = self._target(margins, seen)
        chat_target = self._prompt_target(margins, self._balance.gap_s(self._model, seen), seen)
        budget, reason = self._budget(seen, target, chat_target, credit)
        floor = None
        if state.foreground_prompt_left:
            ttft = state.foreground_ttft_target_s if self.ttft_ms is None else self.ttft_ms / 1000
            # The guaranteed rate keeps to the ITL target and its own rule where the decodes
            # alone fill it: capped at the balanced gap instead, a late chat beside three
            # decodes of 110 ms got 13 tokens an iteration, and waited 6x its prompt alone.
            itl_target = self._prompt_target(margins, self._itl_s, seen)
            floor = first_token_floor(self._model, seen, ttft, itl_target)
        return Decision(budget, floor, 0 if defer else riders, reason=reason)

    def _defers(self, state: SchedState, target: float, credit: ShareCredit) -> bool:
        """Leave background decodes out while a foreground prompt computes (as every capping
        policy does), and beside foreground decodes when their share is spent or when with
        them (and the smallest prompt chunk) the iteration is predicted over the target: on
        a small model every sampled row costs as much as a foreground token."""
        if self.prompt_defers(state):
            return True
        if not (state.may_defer and state.n_decode_background and state.n_decode_foreground):
            return False
        return credit.spent(state.n_decode_foreground) or self._over(state, target)

    def _over(self, state: SchedState, target: float) -> bool:
        floor = self.min_tokens or 0
        t = self._model.predict(
            state.n_decode, floor, 1 if floor else 0, state.decode_ctx, n_sampled=state.n_decode
        )
        return t > target

    def _riders(self, state: SchedState, target: float) -> int | None:
        """When background decodes may not wait longer (the planner's bound) beside
        foreground decodes they would push over the target: the most of them that fit, at
        least one. All of them at once made every ninth iteration of a burst of chats one
        row per document longer (122-141 ms in the simulator at one thread, the P99)."""
        n_background = state.n_decode_background
        if state.may_defer or not (n_background and state.n_decode_foreground):
            return None
        if not self._over(state, target):
            return None
        fits = (
            k
            for k in range(n_background - 1, 0, -1)
            if not self._over(state.without_background_decodes(k), target)
        )
        return next(fits, 1)

    def _target(self, margins: TailMargins, state: SchedState) -> float:
        """The device's share of the ITL target for an iteration of `state`'s decodes: the
        host's time for them (each row under a grammar counted) and the margin taken off."""
        return self._itl_s - margins.margin_s - margins.host.predict(state.n_constrained)

    def _prompt_target(self, margins: TailMargins, gap_s: float, state: SchedState) -> float:
        """The target an iteration with a chat's prompt chunk is sized to: the token gap
        `gap_s` less the tail of the chats' own errors (a shallow chunk is cheap to
        predict), else of all."""
        margin = margins.margin_s if margins.prompt_margin_s is None else margins.prompt_margin_s
        return gap_s - margin - margins.host.predict(state.n_constrained)

    def _budget(
        self, state: SchedState, target: float, chat_target: float, credit: ShareCredit
    ) -> tuple[int | None, str]:
        """`chat_target`: the target while a chat's prompt waits (`ChatBalance`'s gap)."""
        if state.n_decode_foreground == 0:
            self._last_budget = None
            return None, "no foreground decode: prompt work fills the batch"
        if not state.foreground_prompt_left and credit.spent(state.n_decode_foreground):
            self._last_budget = 0
            return 0, "the background's share of the foreground's time is spent"
        if state.foreground_prompt_left:
            target = chat_target
        model = self._model
        c = model.max_prefill(target, state.n_decode, state.decode_ctx, state.next_prompt_pos)
        if 0 < state.next_prompt_left <= c:
            c = self._past_prompt_end(model, target, state)
        # Predicted over the target even with no prompt work: give it none, but never for
        # more than a few iterations in a row, so background work progresses.
        self._at_risk = self._at_risk + 1 if c == 0 else 0
        if 0 < self._at_risk <= MAX_STARVED:
            self._last_budget = 0
            return 0, f"over the {target * 1e3:.0f} ms target with no prompt work"
        self._at_risk = 0
        self._last_budget = max(c, self.min_tokens or 0)
        return self._last_budget, f"predicted to fit {target * 1e3:.0f} ms"

    def _past_prompt_end(self, model: CostModel, target: float, state: SchedState) -> int:
        """The chunk fits the rest of the prompt, which costs more than its tokens: its last
        token is sampled, and tokens past it open another chunk, another pass over the
        weights. Without this the iterations that end a prompt form the foreground's tail.
        Nothing is added after a foreground prompt: its first token would wait for it (seen: a
        chat's last prompt token beside 41 document tokens, 98 ms instead of ~35)."""
        left, pos = state.next_prompt_left, state.next_prompt_pos
        t = model.prompt_end_s(state.n_decode, state.decode_ctx, left, pos)
        if t > target:
            return left - 1  # the scheduler keeps the remainder a valid chunk
        if state.foreground_prompt_left:
            return left  # its first token waits for all of it: nothing rides along
        more = model.max_prefill(target - t, 0, 0, 0)  # a new prompt: its pass, at position 0
        return left + (more if more >= (self.min_tokens or 1) else 0)

    # --- after an iteration -------------------------------------------------------------
    def observe(self, timing: IterationTiming) -> None:
        fit, margins, credit = self._parts()
        credit.add(timing, fit.model)
        margins.add(timing)
        if fit.add(timing, refit=margins.surprised(timing, fit.model)):
            margins.update(fit.model, fit.recent)

    def params(self) -> dict[str, Any]:
        names = ("itl_ms", "ttft_ms", "tail_pct", "window", "min_tokens", "share", "readable_ms")
        return {k: getattr(self, k) for k in names}

    def snapshot(self) -> dict[str, Any]:
        m = None if self._fit is None else self._fit.model
        margins, credit = self._margins, self._credit
        prompt_margin = None if margins is None else margins.prompt_margin_s
        return {
            "budget": self._last_budget,
            "margin_ms": 0.0 if margins is None else margins.margin_s * 1e3,
            "prompt_margin_ms": None if prompt_margin is None else prompt_margin * 1e3,
            "host_ms": 0.0 if margins is None else margins.host.base_s * 1e3,
            "host_constrained_ms": 0.0 if margins is None else margins.host.per_constrained_s * 1e3,
            "credit_ms": 0.0 if credit is None else credit.credit_s * 1e3,
            "model_ms": None
            if m is None
            else {
                "pass": m.per_pass_s * 1e3,
                "sampled": m.per_sampled_s * 1e3,
                "prefill": m.per_prefill_s * 1e3,
                "kctx": m.per_kctx_s * 1e3,
            },
        }
