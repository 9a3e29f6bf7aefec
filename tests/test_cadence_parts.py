"""Cadence's parts, each alone: the online fit, the tail margins, the share credit, the
first-token floor and the balance between a waiting chat and the running ones."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.plan import IterationTiming, SchedState
from edgeprefill.runtime.core.request import FOREGROUND_SLOWDOWN
from edgeprefill.runtime.policies.cadence.fit import REFIT_EVERY, OnlineFit, Rows
from edgeprefill.runtime.policies.cadence.floor import first_token_floor
from edgeprefill.runtime.policies.cadence.margins import TailMargins
from edgeprefill.runtime.policies.cadence.objective import ChatBalance
from edgeprefill.runtime.policies.cadence.share import ShareCredit

COST = CostModel(0.020, 0.007, 0.0028, 0.0001)


def iteration(rng: np.random.Generator, host_s: float | None = 0.001) -> IterationTiming:
    n_decode, n_prefill = int(rng.integers(1, 5)), int(rng.choice([0, 16, 64, 256]))
    ctx = n_prefill * int(rng.integers(0, 8000)) + n_decode * int(rng.integers(200, 900))
    sampled = n_decode + int(n_prefill > 0 and rng.random() < 0.2)
    chunks = int(n_prefill > 0)
    t = COST.predict(n_decode, n_prefill, chunks, ctx, sampled) * (1 + 0.1 * rng.random())
    return IterationTiming(t, n_decode, n_prefill, n_decode, None, chunks, ctx, sampled, host_s)


def test_the_online_fit_is_the_batch_fit_of_the_anchor_and_the_window():
    """Refitted every REFIT_EVERY iterations to exactly what a batch fit gives, and in
    between the last refit's model: never more than REFIT_EVERY - 1 iterations stale."""
    rng = np.random.default_rng(0)
    anchor = [iteration(rng) for _ in range(20)]
    fit = OnlineFit(CostModel(0.01, 0.01, 0.01, 0.01), anchor, window=64)
    seen = [iteration(rng) for _ in range(500)]

    def batch(i: int) -> CostModel:
        return CostModel.fit(anchor + seen[max(0, i - 63) : i + 1])

    for i, t in enumerate(seen):
        refitted = fit.add(t)
        # the first once 8 are in, then every REFIT_EVERY after it
        assert refitted == (i == 7 or (i > 7 and (i - 7) % REFIT_EVERY == 0))
        if refitted and i in (7, 7 + REFIT_EVERY, 7 + 4 * REFIT_EVERY, 7 + 30 * REFIT_EVERY):
            assert fit.model.coef == pytest.approx(batch(i).coef, rel=1e-9)
            assert fit.model.rmse_s == pytest.approx(batch(i).rmse_s, rel=1e-6)
            assert fit.model.n_samples == batch(i).n_samples
        if i in (8, 70, 499):  # between refits: the last one's model
            last = i - (i - 7) % REFIT_EVERY
            assert fit.model.coef == pytest.approx(batch(last).coef, rel=1e-9)


def test_a_cost_the_window_would_make_negative_is_fitted_as_zero_like_the_batch_fit():
    """Iterations that get faster with attention work (a device speeding up as documents
    deepen): the unconstrained solution has a negative cost, and the constrained one is
    what NNLS on the rows gives."""
    rng = np.random.default_rng(1)
    seen = [iteration(rng) for _ in range(64)]
    seen = [replace(t, duration_s=t.duration_s - 2e-7 * t.ctx_work) for t in seen]
    fit = OnlineFit(CostModel(0.01, 0.01, 0.01, 0.01), [], window=64)
    for t in seen[:-1]:
        fit.add(t)
    assert fit.add(seen[-1], refit=True)
    assert fit.model.per_kctx_s == 0.0
    assert fit.model.coef == pytest.approx(CostModel.fit(seen).coef, rel=1e-6, abs=1e-12)


def test_the_online_fit_waits_for_eight_iterations_and_survives_a_degenerate_window():
    start = CostModel(0.01, 0.01, 0.01, 0.01)
    fit = OnlineFit(start, [], window=16)
    same = IterationTiming(0.05, 1, 0, 1, n_sampled=1)  # one shape only: rank 2 of 4
    for _ in range(7):
        fit.add(same)
    assert fit.model is start
    fit.add(same)
    assert fit.model.predict(1, 0, 0, 0) == pytest.approx(0.05)


def test_rows_keep_the_last_cap_iterations():
    rows = Rows(2)
    for d in (0.1, 0.2, 0.3):
        rows.append(IterationTiming(d, 1, 0))
    assert len(rows) == 2 and sorted(rows.rows()[1]) == [0.2, 0.3]


def mixed(duration: float, host_s: float | None = None) -> IterationTiming:
    return IterationTiming(duration, 1, 20, 1, None, 1, 600, 1, host_s)


def test_the_margin_is_the_tail_error_but_one_stall_is_never_the_tail():
    margins, rows = TailMargins(99.0, cap_s=0.050), Rows(256)
    exact = COST.predict(1, 20, 1, 600)
    for duration in [exact] * 7 + [exact + 0.5]:
        margins.add(mixed(duration))
        rows.append(mixed(duration))
    margins.update(COST, rows)
    assert margins.margin_s == pytest.approx(0.0)
    margins.add(mixed(exact + 0.5))
    rows.append(mixed(exact + 0.5))
    margins.update(COST, rows)
    assert margins.margin_s == pytest.approx(0.050)  # two stalls: the tail, capped


def test_the_host_median_is_taken_off_and_deviations_from_it_enter_the_margin():
    margins, rows = TailMargins(90.0, cap_s=1.0), Rows(256)
    exact = COST.predict(1, 20, 1, 600)
    for i in range(20):
        t = mixed(exact, host_s=0.002 if i % 7 else 0.012)  # 3 of 20 hosts 10 ms slow
        margins.add(t)
        rows.append(t)
    margins.update(COST, rows)
    assert margins.host.base_s == pytest.approx(0.002)
    assert margins.margin_s == pytest.approx(0.010)  # 15% of samples: more than the 10% tail


def test_each_row_sampled_under_a_grammar_is_host_time_of_its_own_not_a_deviation():
    """JSON chats' iterations take the host 12 ms a constrained row; plain ones 2 ms.
    Counted per row, the host's time is predicted for each iteration's rows, and what
    the grammar costs is not the margin every iteration pays."""
    margins, rows = TailMargins(90.0, cap_s=1.0), Rows(256)
    exact = COST.predict(1, 20, 1, 600)
    for i in range(30):
        n = i % 3  # 0, 1 or 2 rows under a grammar
        t = replace(mixed(exact, host_s=0.002 + 0.012 * n), n_constrained=n)
        margins.add(t)
        rows.append(t)
    margins.update(COST, rows)
    assert margins.host.per_constrained_s == pytest.approx(0.012)
    assert margins.host.predict(2) == pytest.approx(0.026)
    assert margins.margin_s == pytest.approx(0.0, abs=1e-9)


def test_the_background_spends_at_most_its_share_of_foreground_iterations():
    credit = ShareCredit(0.25, itl_s=0.1)
    alone = COST.predict(1, 0, 0, 0)
    assert credit.spent(1)  # a spell of foreground decodes starts with nothing to spend
    for _ in range(4):  # foreground alone: earns a quarter of each, up to one share
        credit.add(IterationTiming(alone, 1, 0, 1), COST)
    assert credit.credit_s == pytest.approx(0.025) and not credit.spent(1)
    credit.add(IterationTiming(alone + 0.06, 1, 64, 1, n_chunks=1), COST)  # 60 ms of prompt
    assert credit.spent(1)
    credit.add(IterationTiming(0.2, 1, 64, 1, n_chunks=1, n_prefill_foreground=64), COST)
    assert credit.spent(1)  # a foreground prompt neither earns nor spends
    credit.add(IterationTiming(0.2, 0, 512, 0, n_chunks=1), COST)
    assert credit.credit_s == 0.0 and not credit.spent(0)  # no foreground: no limit
    assert not ShareCredit(1.0, itl_s=0.1).spent(1)


def test_the_first_token_floor_guarantees_a_rate_and_meets_an_absolute_target_in_time():
    cost = CostModel(0.010, 0.030, 0.003, 0.0)
    chat = SchedState(1, 0, 1, 1, 2048, decode_ctx=500, foreground_prompt_left=200)
    base = cost.predict(1, 0, 1, 500)  # 50 ms: the decode and the chunk's pass
    alone = 0.003 * 200
    # No absolute target: the budget alone at first; once it has waited 2/3 of its time
    # alone, the guaranteed rate, each chunk costing at least half of the rest of its
    # iteration (3x its time alone), and never slowing down past halfway.
    assert first_token_floor(cost, chat, None) is None
    late = replace(chat, foreground_waited_s=alone * 2 / 3)
    paced = first_token_floor(cost, late, None)
    assert paced == -(-200 // int((FOREGROUND_SLOWDOWN - 1) * alone / base))
    assert 0.003 * paced >= base / (FOREGROUND_SLOWDOWN - 1)
    half = replace(late, foreground_prompt_left=100, foreground_prompt_pos=100)
    assert first_token_floor(cost, half, None) == pytest.approx(paced, abs=1)
    # A request's own multiple sets the rate: 2x its time alone, chunks as costly as the rest.
    two = first_token_floor(cost, replace(late, foreground_ttft_slowdown=2.0), None)
    assert two == -(-200 // int(alone / base)) > paced

    # An absolute target: spread over the slack while it can be met (1 s: 200 tokens cost
    # 0.6 s, the rest holds floor(0.4 / base) iterations), all at once with one left.
    assert first_token_floor(cost, chat, 1.0) == -(-200 // int(0.4 / base))
    assert first_token_floor(cost, chat, alone + 1.5 * base) == 200
    # Lost: back to the guaranteed rate, never nothing.
    assert first_token_floor(cost, late, alone) == paced
    # A slack longer than the rate needs does not slow a late prompt below it.
    assert first_token_floor(cost, late, 100.0) == paced


def test_the_guaranteed_rate_stays_within_the_itl_target_and_waits_for_a_slot_that_frees_soon():
    cost = CostModel(0.001, 0.020, 0.002, 0.0)  # as at one thread: a sampled row 20 ms
    itl = 0.100
    four = SchedState(1, 0, 4, 4, 2048, foreground_prompt_left=300, foreground_waited_s=10.0)
    rate = first_token_floor(cost, four, None)
    capped = first_token_floor(cost, four, None, itl)
    assert capped < rate  # the rate alone: 1.5x the four decodes' ~83 ms
    assert cost.predict(4, capped, 1, 0) <= itl < cost.predict(4, capped + 1, 1, 0)
    # A chunk that ends the prompt is priced with its first token's row.
    end = replace(four, foreground_prompt_left=capped)
    assert cost.predict(4, capped, 1, 0, n_sampled=5) > itl
    assert first_token_floor(cost, end, None, itl) == capped - 1
    # Five decodes fill the target: one piece an iteration while one of them is certain to
    # end within twice the prompt's allowance (3x its 0.6 s alone), else the rate.
    five = replace(four, n_decode=5, n_decode_foreground=5, foreground_decode_ends=20)
    assert first_token_floor(cost, five, None, itl) == 1
    for ends in (40, None):  # 40 x 102 ms > 3.6 s; unknown
        slow = replace(five, foreground_decode_ends=ends)
        assert first_token_floor(cost, slow, None, itl) == first_token_floor(cost, slow, None)
    # An absolute target is the caller's: not capped.
    fresh = replace(four, foreground_waited_s=0.0)  # 0.6 s alone, 0.2 s of slack: 2 iterations
    assert first_token_floor(cost, fresh, 0.8, itl) == first_token_floor(cost, fresh, 0.8) == 150


def test_a_waiting_chat_and_the_running_ones_are_slowed_alike_within_the_readable_floor(caplog):
    """The gap where both slowdowns meet, computed here from its definition: the running
    chats' gap over their decode alone equals the waiting chat's first token (on that
    course) over its prompt alone. Never under the ITL target, never over the floor."""
    zen3 = CostModel(0.0099, 0.0167, 0.0035, 0.00013)  # tests/devices/zen3-2core-avx2.json
    balance = ChatBalance(itl_s=0.100, readable_s=0.150, device=zen3)
    chat = dict(n_batch=2048, foreground_prompt_left=200, foreground_prompt_pos=0)

    def both(n_decode: int, waited_s: float) -> tuple[float, float, float]:
        state = SchedState(
            0,
            1,
            n_decode,
            n_decode,
            decode_ctx=300 * n_decode,
            foreground_waited_s=waited_s,
            **chat,
        )
        gap = balance.gap_s(zen3, state)
        base = zen3.predict(n_decode, 0, 1, state.decode_ctx)
        alone = zen3.per_prefill_s * 200 + zen3.per_kctx_s * 200 * 100 / 1000
        reference = zen3.per_pass_s + zen3.per_sampled_s + alone
        first_token = waited_s + alone * gap / (gap - base)
        return gap, gap / base, first_token / reference

    gap, running, waiting = both(2, 0.0)  # 2 decodes (~50 ms with the chunk's pass)
    assert 0.1 < gap < 0.15 and running == pytest.approx(waiting) and running < 2.5
    later, running, waiting = both(2, 0.3)  # it has waited: a longer gap, still both alike
    assert gap < later < 0.15 and running == pytest.approx(waiting)
    assert both(1, 0.0)[0] == 0.100  # 2x one decode is under the ITL target: the target
    assert both(3, 2.0)[0] == 0.150  # long late: the floor
    queued = SchedState(0, 2, 1, 1, 2048, foreground_prompt_left=200, foreground_prompts_behind=1)
    assert balance.gap_s(zen3, queued) == 0.150  # the chats behind it wait for it too
    with caplog.at_level("WARNING", logger="edgeprefill"):
        for n in (5, 6, 6, 5):
            balance.note(SchedState(0, 0, n, n, 2048, decode_ctx_foreground=300 * n))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("6 chats decoding take 110 ms an iteration")
