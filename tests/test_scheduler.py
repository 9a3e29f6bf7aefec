"""The scheduler's promises: decode first, budget caps prompt tokens, foreground first,
background preempted at chunk boundaries, admission never over-commits the device."""

from __future__ import annotations

from dataclasses import replace

from edgeprefill.runtime.core.contract import timing_of
from edgeprefill.runtime.core.planner import sched_state
from edgeprefill.runtime.core.request import OutputFormat, SamplingParams, Status
from edgeprefill.runtime.core.scheduler import BackgroundLimits
from tests import helpers
from tests.helpers import EOG, make_request, make_scheduler, run_plan


def test_budget_caps_prompt_tokens_and_chunks_continue_where_they_left_off():
    sched, _ = make_scheduler()
    req = make_request("bg", "background", prompt_len=150)
    sched.add(req)
    sizes, positions = [], []
    while req.status is Status.PREFILL or req.status is Status.WAITING:
        plan, work, _ = run_plan(sched, 64)
        sizes.append(plan.prefill["bg"])
        positions.append(work[0].pos)
        assert work[0].tokens == req.prompt[work[0].pos : work[0].pos + sizes[-1]]
    assert sizes == [64, 64, 22]
    assert positions == [0, 64, 128]
    assert req.status is Status.DECODE and len(req.output) == 1  # sampled after the last chunk


def test_every_running_decode_gets_one_token_before_any_prompt_token():
    sched, _ = make_scheduler(n_batch=16)
    decoders = [make_request(f"d{i}", max_tokens=50) for i in range(3)]
    for r in decoders:
        sched.add(r)
    run_plan(sched, None)  # 30 prompt tokens > 16: finishes over two iterations
    run_plan(sched, None)
    assert all(r.status is Status.DECODE for r in decoders)
    sched.add(make_request("doc", "background", prompt_len=100))
    plan, work, _ = run_plan(sched, None)
    assert plan.decode == ("d0", "d1", "d2")
    assert plan.prefill == {"doc": 13}  # n_batch 16 minus 3 decode tokens
    assert [len(w.tokens) for w in work] == [1, 1, 1, 13]
    plan, _, _ = run_plan(sched, 5)
    assert plan.n_decode == 3 and plan.prefill == {"doc": 5}


def test_unlimited_fills_n_batch_and_budget_zero_still_decodes():
    sched, _ = make_scheduler(n_batch=100)
    sched.add(make_request("chat", max_tokens=10))
    run_plan(sched, None)
    sched.add(make_request("doc", "background", prompt_len=1000))
    plan, _, _ = run_plan(sched, None)
    assert plan.prefill == {"doc": 99}
    plan, _, _ = run_plan(sched, 0)
    assert plan.decode == ("chat",) and plan.prefill == {}


def test_foreground_prompt_preempts_background_at_the_next_chunk_boundary():
    sched, _ = make_scheduler()
    doc = make_request("doc", "background", prompt_len=1000)
    sched.add(doc)
    run_plan(sched, 64)
    sched.add(make_request("chat", "foreground", prompt_len=40))
    plan, _, _ = run_plan(sched, 64)
    assert list(plan.prefill.items()) == [("chat", 40), ("doc", 24)]  # chat first, doc fills
    plan, _, _ = run_plan(sched, 64)
    assert plan.decode == ("chat",) and plan.prefill == {"doc": 64}
    assert doc.num_computed == 64 + 24 + 64  # slowed, never dropped


def test_requests_stop_at_eog_or_max_tokens_and_release_their_sequence():
    sched, released = make_scheduler()
    a = make_request("a", max_tokens=3)
    b = make_request("b", max_tokens=3, prompt_len=5)
    sched.add(a)
    sched.add(b)
    run_plan(sched, None, token=7)
    _, _, finished = run_plan(sched, None, token=EOG)
    assert {r.id for r in finished} == {"a", "b"}
    assert a.finish_reason == "stop" and a.output == [7, EOG]
    assert sorted(released) == sorted([a.seq_id, b.seq_id])
    c = make_request("c", max_tokens=2, ignore_eos=True)
    sched.add(c)
    run_plan(sched, None, token=EOG)
    _, _, finished = run_plan(sched, None, token=EOG)
    assert finished == [c] and c.finish_reason == "length" and c.output == [EOG, EOG]
    assert not sched.has_work and sched.kv_free == sched.capacity.n_ctx


def test_decode_positions_continue_after_the_prompt():
    sched, _ = make_scheduler()
    r = make_request("a", prompt_len=10, max_tokens=5)
    sched.add(r)
    run_plan(sched, None, token=7)
    _, work, _ = run_plan(sched, None, token=8)
    assert work[0].tokens == [7] and work[0].pos == 10
    _, work, _ = run_plan(sched, None, token=9)
    assert work[0].tokens == [8] and work[0].pos == 11


def test_background_may_not_take_every_sequence_or_the_foreground_kv_reserve():
    sched, _ = make_scheduler(
        n_seq_max=4, n_ctx=1000, limits=BackgroundLimits(max_seqs=2, foreground_kv_cells=200)
    )
    docs = [make_request(f"doc{i}", "background", prompt_len=300, max_tokens=1) for i in range(3)]
    for d in docs:
        sched.add(d)
    plan, _, _ = run_plan(sched, None)
    assert set(plan.prefill) == {"doc0", "doc1"}  # two sequences, 600 of 800 usable cells
    assert docs[2].status is Status.WAITING
    chat = make_request("chat", prompt_len=300, max_tokens=1)
    sched.add(chat)
    plan, _, _ = run_plan(sched, None)
    assert "chat" in plan.prefill


def test_a_request_that_can_never_fit_fails_with_a_reason_and_others_run():
    sched, _ = make_scheduler(n_ctx=800, n_seq_max=2, n_ctx_seq=400)
    big = make_request("big", prompt_len=400, max_tokens=8)
    ok = make_request("ok", prompt_len=100)
    assert not sched.add(big)
    assert big.status is Status.FAILED and "407 KV cells" in big.error and "(n_ctx)" in big.error
    assert sched.add(ok)
    plan, _, _ = run_plan(sched, None)
    assert plan.prefill == {"ok": 100}


def test_kv_reservation_delays_admission_until_cells_are_free():
    sched, _ = make_scheduler(
        n_ctx=300, n_seq_max=4, limits=BackgroundLimits(foreground_kv_cells=0)
    )
    a = make_request("a", prompt_len=200, max_tokens=2)
    b = make_request("b", prompt_len=200, max_tokens=2)
    sched.add(a)
    sched.add(b)
    plan, _, _ = run_plan(sched, None)
    assert set(plan.prefill) == {"a"} and b.status is Status.WAITING
    run_plan(sched, None)  # a finishes (2 tokens)
    plan, _, _ = run_plan(sched, None)
    assert set(plan.prefill) == {"b"}


def test_plan_is_a_printable_value():
    sched, _ = make_scheduler()
    sched.add(make_request("chat", max_tokens=9))
    run_plan(sched, None)
    sched.add(make_request("doc", "background", prompt_len=500))
    plan = helpers.plan(sched, 64, reason="static")
    assert str(plan) == "Plan(Decision(budget=64: static), decode=[chat], prefill={doc: 64})"
    assert plan.num_scheduled_tokens == {"chat": 1, "doc": 64}


def test_abort_fails_everything_waiting_or_running_and_releases_it():
    sched, released = make_scheduler(n_seq_max=2, limits=BackgroundLimits(max_seqs=1))
    reqs = [make_request(f"r{i}", "background", max_tokens=5) for i in range(3)]
    for r in reqs:
        sched.add(r)
    run_plan(sched, None)
    failed = sched.abort("interrupted")
    assert {r.id for r in failed} == {"r0", "r1", "r2"}
    assert all(r.status is Status.FAILED and r.error == "interrupted" for r in reqs)
    assert released == [reqs[0].seq_id] and not sched.has_work


def test_chunks_never_shorter_than_min_chunk_nor_leave_a_shorter_remainder():
    sched, _ = make_scheduler(min_chunk=8, max_chunk=100)
    chat = make_request("chat", prompt_len=60, max_tokens=50)
    doc = make_request("doc", "background", prompt_len=130, max_tokens=2)
    sched.add(chat)
    sched.add(doc)
    sizes = []
    while doc.remaining_prompt:
        plan, _, _ = run_plan(sched, 64)
        sizes.append(dict(plan.prefill))
    # 60 for the chat leaves 4 < 8: the doc waits; then the doc's 130 goes as 64 + 58 + 8,
    # never as 64 + 64 + 2.
    assert sizes[0] == {"chat": 60}
    doc_sizes = [s["doc"] for s in sizes if "doc" in s]
    assert doc_sizes == [64, 58, 8]
    assert all(n >= 8 for s in sizes for n in s.values())


def test_max_chunk_caps_one_request_per_iteration_but_not_the_batch():
    sched, _ = make_scheduler(max_chunk=100)
    for i in range(3):
        sched.add(make_request(f"d{i}", "background", prompt_len=250))
    plan, _, _ = run_plan(sched, None)
    assert plan.prefill == {"d0": 100, "d1": 100, "d2": 100}


def test_a_budget_below_min_chunk_still_makes_progress():
    sched, _ = make_scheduler(min_chunk=8)
    req = make_request("a", prompt_len=20)
    sched.add(req)
    plan, _, _ = run_plan(sched, 4)
    assert plan.prefill == {"a": 4}


def test_a_budget_at_min_chunk_finishes_a_prompt_whole_rather_than_in_a_short_piece():
    # 12 tokens left under a budget of 8: 8 + 4 would compute a 4-token piece (another
    # kernel, another greedy output); the 12 go together, 4 over the budget.
    sched, _ = make_scheduler(min_chunk=8)
    req = make_request("a", prompt_len=28)
    sched.add(req)
    sizes = [dict(run_plan(sched, 8)[0].prefill)["a"] for _ in range(3)]
    assert sizes == [8, 8, 12]


def test_prompts_are_cut_only_at_multiples_of_the_chunk_quantum():
    # Repacked weights compute rows in blocks of four: a prompt cut elsewhere computes some
    # rows with another kernel. Every piece but a prompt's last is a multiple of 4, none
    # is shorter than 8, and no remainder is left shorter than 8.
    for budget in (8, 10, 30, 37, 64, 101):
        sched, _ = make_scheduler(min_chunk=8, chunk_quantum=4)
        chat = make_request("chat", prompt_len=13, max_tokens=200)
        doc = make_request("doc", "background", prompt_len=250, max_tokens=2)
        sched.add(chat)
        sched.add(doc)
        pieces = []
        while doc.remaining_prompt:
            plan, _, _ = run_plan(sched, budget)
            assert plan.n_prefill <= max(budget, 15)  # a prompt's last 8-15 may go whole
            pieces.append(plan.prefill.get("doc"))
        doc_pieces = [n for n in pieces if n]
        assert sum(doc_pieces) == 250
        assert all(n % 4 == 0 and n >= 8 for n in doc_pieces[:-1]), (budget, doc_pieces)
        assert doc_pieces[-1] >= 8


def test_with_a_quantum_the_last_tokens_go_whole_when_no_valid_cut_exists():
    # 14 left under a budget of 8 with quantum 4: 8 + 6 leaves 6 < 8 and 12 is over budget,
    # so no cut is valid; the 14 go together.
    sched, _ = make_scheduler(min_chunk=8, chunk_quantum=4)
    req = make_request("a", prompt_len=30)
    sched.add(req)
    assert [dict(run_plan(sched, 8)[0].prefill)["a"] for _ in range(2)] == [8, 8]
    assert dict(run_plan(sched, 8)[0].prefill) == {"a": 14}


def test_with_no_budget_no_background_prompt_rides_beside_a_chat_prompt():
    sched, _ = make_scheduler()
    doc = make_request("doc", "background", prompt_len=1000)
    sched.add(doc)
    run_plan(sched, 100)
    sched.add(make_request("chat", "foreground", prompt_len=40))
    plan, _, _ = run_plan(sched, None)
    assert plan.prefill == {"chat": 40}  # its first token waits for nothing else
    plan, _, _ = run_plan(sched, None)
    assert plan.decode == ("chat",) and plan.prefill == {"doc": 511}  # then the rest
    sched.add(make_request("chat2", "foreground", prompt_len=40))
    plan = helpers.plan(sched, None, foreground_alone=False)  # `unlimited`: as llama-server
    assert plan.prefill == {"chat2": 40, "doc": 389}


def test_background_decodes_are_left_out_when_the_decision_defers_them():
    sched, _ = make_scheduler()
    sched.add(make_request("chat", "foreground", max_tokens=50))
    sched.add(make_request("doc", "background", max_tokens=50))
    run_plan(sched, 100)  # both prompts: both decode from now on
    plan = helpers.plan(sched, 0, background_decodes=0)
    assert plan.decode == ("chat",) and plan.deferred == ("doc",)
    plan = helpers.plan(sched, 0)
    assert set(plan.decode) == {"chat", "doc"} and plan.deferred == ()


def test_a_foreground_floor_beats_the_budget_and_leaves_the_background_less():
    sched, _ = make_scheduler()
    sched.add(make_request("chat0", "foreground", max_tokens=50))
    sched.add(make_request("doc", "background", prompt_len=1000))
    run_plan(sched, 100)  # chat0 decodes from now on; the document has begun
    sched.add(make_request("chat1", "foreground", prompt_len=300, arrival_s=1.0))
    state = sched_state(sched.candidates(), 512, None, now_s=1.5)
    assert state.foreground_prompt_left == 300 and state.foreground_waited_s == 0.5
    plan = helpers.plan(sched, 16, floor=120)
    assert plan.prefill == {"chat1": 120} and plan.decode == ("chat0",)
    plan = helpers.plan(sched, 200, floor=120)
    assert plan.prefill == {"chat1": 200}  # the budget was larger: it decides


def test_rows_sampled_under_a_grammar_are_counted_where_planned_and_where_run():
    """What cadence charges each constrained row's host time by (`costs.host`)."""
    sched, _ = make_scheduler()
    json = SamplingParams(output_format=OutputFormat())
    sched.add(replace(make_request("chat0", max_tokens=50), sampling=json))
    sched.add(make_request("chat1", max_tokens=50))
    sched.add(replace(make_request("doc", "background", max_tokens=50), sampling=json))
    run_plan(sched, 100)  # every prompt: all three decode from now on
    state = sched_state(sched.candidates(), 512, None, now_s=0.0)
    assert (state.n_decode, state.n_constrained, state.n_constrained_foreground) == (3, 2, 1)
    assert state.without_background_decodes().n_constrained == 1
    work = sched.work(helpers.plan(sched, 0))
    assert timing_of(work, 0.1).n_constrained == 2
