"""Latency definitions checked against numbers computed by hand."""

from __future__ import annotations

import pytest

from edgeprefill.runtime.analysis.metrics import class_summary, request_latencies


def rec(arrival, times, prompt=10, error=None, finish="length"):
    return {
        "arrival_s": arrival,
        "token_times_s": times,
        "prompt_tokens": prompt,
        "output_token_ids": list(range(len(times))),
        "error": error,
        "finish_reason": None if error else finish,
    }


def test_one_request_by_hand():
    # arrival 1.0; tokens at 1.5, 1.7, 2.2, 2.3
    lat = request_latencies(rec(1.0, [1.5, 1.7, 2.2, 2.3]))
    assert lat["ttft"] == pytest.approx([0.5])
    assert lat["itl"] == pytest.approx([0.2, 0.5, 0.1])
    assert lat["e2el"] == pytest.approx([1.3])
    assert lat["tpot"] == pytest.approx([(1.3 - 0.5) / 3])


def test_class_summary_by_hand():
    recs = [
        rec(0.0, [1.0, 2.0, 4.0], prompt=100),  # ttft 1, itl 1 and 2, e2e 4, tpot 1.5
        rec(1.0, [2.0], prompt=50),  # ttft 1, no itl, e2e 1, no tpot
        rec(0.0, [], prompt=999, error="interrupted"),  # failed: no latency, no tokens
    ]
    s = class_summary(recs, duration_s=10.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["mean_ttft_ms"] == pytest.approx(1000.0)
    assert s["mean_itl_ms"] == pytest.approx(1500.0)
    assert s["median_itl_ms"] == pytest.approx(1500.0)
    assert s["p99_itl_ms"] == pytest.approx(1000 * (1 + 0.99 * 1))  # linear between 1 and 2
    assert s["p95_e2el_ms"] == pytest.approx(1000 * (1 + 0.95 * 3))
    assert s["mean_tpot_ms"] == pytest.approx(1500.0)
    assert s["input_tokens"] == 150 and s["output_tokens"] == 4
    assert s["prefill_tok_s"] == pytest.approx(15.0) and s["output_tok_s"] == pytest.approx(0.4)
    assert s["makespan_s"] == pytest.approx(4.0)  # first arrival 0.0 to last token 4.0
    assert s["span_prefill_tok_s"] == pytest.approx(150 / 4.0)


def test_a_class_with_no_completed_requests_reports_none_not_zero():
    s = class_summary([rec(0.0, [], error="boom")], duration_s=5.0)
    assert s["mean_ttft_ms"] is None and s["p99_itl_ms"] is None
    assert s["completed"] == 0 and s["failed"] == 1


def test_ttft_attainment_counts_first_tokens_in_time_and_misses_failures():
    records = [
        rec(0.0, [0.5, 0.6]) | {"ttft_target_s": 1.0},  # met
        rec(1.0, [2.5]) | {"ttft_target_s": 1.0},  # 1.5 s: missed
        rec(2.0, [], error="cancelled") | {"ttft_target_s": 1.0},  # no token: missed
        rec(3.0, [3.1]),  # no target: not counted
    ]
    s = class_summary(records, 10.0)
    assert s["ttft_attainment"] == {
        "relative": None,
        "absolute": {
            "targets_s": [1.0],
            "requests": 3,
            "met": 1,
            "rate": 1 / 3,
            "infeasible_alone": 0,
        },
    }
    assert class_summary([rec(0.0, [0.5])], 1.0)["ttft_attainment"] is None


def test_ttft_attainment_against_the_device_relative_target_and_the_absolute_one_apart():
    records = [
        # 0.4 s alone, 3x: 1.2 s; first token at 1.0 s: met, 2.5x its time alone
        rec(0.0, [1.0]) | {"ttft_slowdown": 3.0, "ttft_alone_s": 0.4, "ttft_target_s": 0.5},
        # 1.5 s alone: no absolute 0.5 s could be met here; 3x: 4.5 s, met at 2.0 s
        rec(1.0, [3.0]) | {"ttft_slowdown": 3.0, "ttft_alone_s": 1.5, "ttft_target_s": 0.5},
        # 0.1 s alone, 3x: 0.3 s; first token after 0.9 s: missed, 9x (starved)
        rec(2.0, [2.9]) | {"ttft_slowdown": 3.0, "ttft_alone_s": 0.1},
    ]
    att = class_summary(records, 10.0)["ttft_attainment"]
    rel, ab = att["relative"], att["absolute"]
    assert (rel["requests"], rel["met"], rel["slowdowns"]) == (3, 2, [3.0])
    assert rel["max_over_alone"] == pytest.approx(9.0)
    assert (ab["requests"], ab["met"], ab["infeasible_alone"]) == (2, 0, 1)
    # Against the reference the third waited for the second's prompt (free from 2.5 s): its
    # reference is 0.6 s and 0.9 s is within 3x of it; the first, at 2.5x, is the worst.
    ref = rel["reference"]
    assert (ref["requests"], ref["met"]) == (3, 3)
    assert ref["mean_reference_ms"] == pytest.approx(1e3 * (0.4 + 1.5 + 0.6) / 3)
    assert ref["max_over_reference"] == pytest.approx(2.5)
