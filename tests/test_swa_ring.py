"""Which prompt micro-batches may be stopped mid-graph (the rule; the real-model proof is
`test_preemption.py::test_an_abort_anywhere_in_a_micro_batch_keeps_greedy_outputs_exact`)."""

from __future__ import annotations

from edgeprefill.backends.llamacpp.swa_ring import SwaRing


def test_the_ring_is_the_window_plus_a_micro_batch_padded_and_at_most_the_context():
    assert SwaRing.of(512, 16384, 512, kv_unified=False).size == 1024
    assert SwaRing.of(512, 16384, 300, kv_unified=False).size == 1024  # 812, padded to 256
    assert SwaRing.of(4096, 2048, 512, kv_unified=False).size == 2048


def test_only_micro_batches_inside_one_turn_of_a_known_ring_may_stop_mid_graph():
    ring = SwaRing.of(512, 16384, 512, kv_unified=False)
    ring.placed(3, 0)
    assert ring.abortable(3, 1024, 512) and ring.abortable(3, 1100, 512)
    assert not ring.abortable(3, 2008, 512)  # cells 984..1023, then 0..471
    assert ring.room(2008) == 40 and ring.abortable(3, 2008, ring.room(2008))
    assert not ring.abortable(4, 1024, 512)  # restored from a saved prefix: cells unknown
    ring.placed(4, 96)
    assert not ring.abortable(4, 1024, 512)
    ring.released(3)
    assert not ring.abortable(3, 1024, 512)


def test_one_stream_for_all_sequences_never_stops_mid_graph_and_no_window_always_may():
    shared = SwaRing.of(512, 16384, 512, kv_unified=True)
    shared.placed(0, 0)
    assert not shared.abortable(0, 0, 8)
    plain = SwaRing.of(0, 4096, 512, kv_unified=False)
    assert plain.abortable(9, 4000, 512)
