"""Turning the device probe's measurements into batch settings (no model needed)."""

from __future__ import annotations

import json

import pytest

from edgeprefill.backends.llamacpp.probe_cache import _read
from edgeprefill.backends.llamacpp.shapes import AttentionFacts, Overrides, choose_settings
from edgeprefill.runtime.core.load import ExpectedLoad, RequestShape


def facts(
    flash_attn=False,
    groups_ok=7,
    pieces_ok=range(8, 17),
    tail_ok=True,
    step_ms=None,
    rates=None,
    deep_ms=100.0,
) -> AttentionFacts:
    step_ms = step_ms or {g: 10.0 + 2.0 * g for g in range(1, 17)}
    return AttentionFacts(
        flash_attn=flash_attn,
        decode_group_ok={g: g <= groups_ok for g in range(1, 17)},
        piece_ok={k: k in set(pieces_ok) for k in range(1, 17)},
        tail_ok=tail_ok,
        decode_step_s={g: ms / 1e3 for g, ms in step_ms.items()},
        prefill_tok_s=rates or {128: 400.0, 256: 420.0, 512: 410.0, 2048: 300.0},
        deep_chunk_s=deep_ms / 1e3,
    )


def test_rules_from_what_was_measured():
    xeon = facts()  # groups up to 7, pieces of 8 or more
    assert xeon.max_decode_group == 7 and xeon.piece_rule == (8, 1) and xeon.exact
    # repacked weights: blocks of four rows; sizes 2 and 9 agreed by chance
    epyc = facts(groups_ok=3, pieces_ok=[2, 8, 9, 12, 16])
    assert epyc.max_decode_group == 3 and epyc.piece_rule == (8, 4) and epyc.exact
    # one passing size is luck, not a rule
    assert facts(pieces_ok=[16]).piece_rule is None
    assert not facts(pieces_ok=[]).exact
    assert not facts(tail_ok=False).exact  # a prompt's last piece must be free
    assert facts(groups_ok=1).max_decode_group == 1


def test_a_group_that_failed_stops_the_count_even_if_larger_ones_passed():
    f = facts(groups_ok=3)
    f.decode_group_ok[6] = True  # by chance
    assert f.max_decode_group == 3


def test_decode_time_adds_the_passes_of_each_group():
    f = facts(step_ms={g: 10.0 * g for g in range(1, 17)})
    assert f.decode_time(8, None) == pytest.approx(0.08)
    assert f.decode_time(8, 3) == pytest.approx(0.03 + 0.03 + 0.02)
    assert f.decode_time(20, None) == pytest.approx(0.16 + 0.04)  # split at 16 measured


def test_auto_is_exact_where_exactness_costs_little_and_fast_where_it_costs_much():
    flat = {g: 30.0 for g in range(1, 17)}  # a pass costs the same whatever its rows
    cheap = [facts(groups_ok=16, step_ms=flat), facts(True, pieces_ok=[], step_ms=flat)]
    s = choose_settings(cheap, "auto", n_seq_max=8, n_batch=2048)
    assert s.mode == "exact" and s.exact and s.max_decode_group == 16
    assert s.n_ubatch == 256 and s.max_chunk == 256 and not s.flash_attn
    assert s.exact_cost == pytest.approx(0.0) and "costs 0%" in s.reason

    # groups of 3 only, and each pass is expensive: 8 decodes take 3 passes instead of 1
    dear = [facts(groups_ok=3, step_ms=flat), facts(True, pieces_ok=[], step_ms=flat)]
    s = choose_settings(dear, "auto", n_seq_max=8, n_batch=2048)
    assert s.mode == "fast" and s.max_decode_group is None and s.min_chunk == 1
    assert s.exact_cost == pytest.approx(2.0) and "costs 200%" in s.reason
    exact = choose_settings(dear, "exact", n_seq_max=8, n_batch=2048)
    assert exact.exact and exact.max_decode_group == 3 and exact.min_chunk == 8


def test_fast_takes_the_fastest_flash_attention_setting_and_micro_batch():
    slow_off = facts(rates={256: 300.0, 512: 310.0})
    quick_on = facts(True, pieces_ok=[], rates={256: 380.0, 512: 420.0})
    s = choose_settings([slow_off, quick_on], "fast", n_seq_max=4, n_batch=2048)
    assert s.flash_attn and s.n_ubatch == 512 and not s.exact
    # a micro-batch larger than the batch cannot be used
    s = choose_settings([slow_off, quick_on], "fast", n_seq_max=4, n_batch=256)
    assert s.n_ubatch == 256


def test_a_setting_slow_deep_in_a_document_loses_even_if_it_decodes_faster():
    # As measured on a Zen 5 EPYC: flash attention decodes ~5% faster but computes a
    # 64-token chunk 2k tokens deep 12% slower (28% at 6k); documents make chunks deep.
    off = facts(step_ms={g: 42.0 for g in range(1, 17)}, deep_ms=100.0)
    on = facts(True, pieces_ok=[], step_ms={g: 40.0 for g in range(1, 17)}, deep_ms=113.0)
    assert not choose_settings([off, on], "fast", n_seq_max=8, n_batch=2048).flash_attn


def test_the_runs_expected_load_decides_flash_attention():
    # As above: decodes 5% faster with flash attention, chunks deep in documents 13% slower.
    off = facts(step_ms={g: 42.0 for g in range(1, 17)}, deep_ms=100.0)
    on = facts(True, pieces_ok=[], step_ms={g: 40.0 for g in range(1, 17)}, deep_ms=113.0)
    chats = ExpectedLoad((RequestShape(14, 300, 96),))
    documents = ExpectedLoad((RequestShape(14, 300, 96), RequestShape(6, 5000, 40)))
    s = choose_settings([off, on], "fast", n_seq_max=8, n_batch=2048, load=chats)
    assert s.flash_attn and "4,200 prompt and 1,344 output tokens" in s.reason
    assert not choose_settings(
        [off, on], "fast", n_seq_max=8, n_batch=2048, load=documents
    ).flash_attn
    # exact batching picks among the settings that are exact, whatever the work
    assert not choose_settings([off, on], "exact", n_seq_max=8, n_batch=2048, load=chats).flash_attn


def test_exact_where_nothing_is_bit_identical_says_so():
    none = [facts(pieces_ok=[]), facts(True, pieces_ok=[])]
    s = choose_settings(none, "exact", n_seq_max=8, n_batch=2048)
    assert s.mode == "exact" and not s.exact and not s.flash_attn
    s = choose_settings(none, "auto", n_seq_max=8, n_batch=2048)
    assert s.mode == "fast" and "no batch shape was bit-identical" in s.reason


def test_hand_set_values_that_leave_the_measured_shapes_are_reported_not_exact():
    measured = [facts(groups_ok=3, pieces_ok=[8, 12, 16]), facts(True, pieces_ok=[])]

    def exact(**kw) -> bool:
        s = choose_settings(measured, "exact", n_seq_max=8, n_batch=2048, overrides=Overrides(**kw))
        return s.exact

    assert exact()
    assert exact(max_decode_group=2)
    assert not exact(max_decode_group=4)
    forced = choose_settings(
        measured, "exact", n_seq_max=8, n_batch=2048, overrides=Overrides(max_decode_group=4)
    )
    assert "not exact: decode groups of up to 4 exceed the 3 measured exact" in forced.reason
    assert not exact(n_ubatch=250)  # not a multiple of the quantum of 4
    assert exact(n_ubatch=512)
    assert not exact(flash_attn=True)


def test_a_probe_file_for_another_setup_or_damaged_is_not_trusted(tmp_path):
    key = {"format": 1, "cpu": "x"}
    good = {
        "key": key,
        "facts": [facts().to_dict()],
        "seconds": 20.0,
        "measured_at": "2026-11-30T00:00:00+00:00",
    }
    path = tmp_path / "p.json"
    path.write_text(json.dumps(good))
    read = _read(path, key)
    assert read is not None and read.source == "cache"
    assert read.facts[0].piece_rule == (8, 1) and read.facts[0].decode_time(2, 1) > 0
    assert _read(path, {**key, "cpu": "y"}) is None
    path.write_text(json.dumps(good)[:-40])
    assert _read(path, key) is None
