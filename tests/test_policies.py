"""The budget policies, on scripted states and on the simulated backend."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from edgeprefill.backends.sim import SimBackend
from edgeprefill.runtime.core.contract import Capacity
from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.plan import IterationTiming, SchedState, riders
from edgeprefill.runtime.core.request import FOREGROUND_SLOWDOWN, Request
from edgeprefill.runtime.policies import parse_policy
from edgeprefill.runtime.policies.cadence import CadencePolicy
from edgeprefill.runtime.policies.cadence.policy import MAX_STARVED
from edgeprefill.runtime.policies.dlfp import DLFPPolicy
from edgeprefill.runtime.policies.ppas import PPASPolicy
from tests.helpers import drain

# A CPU-like device: 20 ms per pass over the weights, 3 ms per prompt token, attention
# 1 ms per 1000 cells attended.
COST = CostModel(per_pass_s=0.020, per_sampled_s=0.002, per_prefill_s=0.003, per_kctx_s=0.001)
CAP = Capacity(
    n_batch=2048, n_ctx=8 * 16384, n_seq_max=8, n_ctx_seq=16384, min_chunk=8, max_chunk=2048
)


def state(n_p_run=0, n_p_wait=0, n_d=0, n_d_fg=0, decode_ctx=0, pos=0) -> SchedState:
    return SchedState(n_p_run, n_p_wait, n_d, n_d_fg, 2048, None, decode_ctx, pos)


def timing(duration, n_decode=1, n_prefill=64) -> IterationTiming:
    return IterationTiming(duration, n_decode, n_prefill, n_chunks=1 if n_prefill else 0)


def profile(cost: CostModel = COST) -> DeviceProfile:
    return DeviceProfile(
        cost, decode_s=0.024, target_s=0.1, n_batch=2048, min_chunk=8, source="test"
    )


def requests(chats=2, docs=2, chat_out=200, doc_len=4000):
    rng = np.random.default_rng(0)
    out = [
        Request(
            f"chat{i}",
            "foreground",
            0.0,
            [1, *rng.integers(10, 999, 200).tolist()],
            chat_out,
            ignore_eos=True,
        )
        for i in range(chats)
    ]
    out += [
        Request(
            f"doc{i}",
            "background",
            0.0,
            [1, *rng.integers(10, 999, doc_len).tolist()],
            16,
            ignore_eos=True,
        )
        for i in range(docs)
    ]
    return out


# --- P-PAS ------------------------------------------------------------------------------
def test_ppas_caps_exactly_from_nth_competing_prefills_while_decoding():
    p = PPASPolicy(nth=3, bmax=512, bcap=32)
    assert p.budget(state(n_p_run=1, n_p_wait=1, n_d=2)) == 512  # 2 < nth
    assert p.budget(state(n_p_run=1, n_p_wait=2, n_d=2)) == 32  # 3 = nth: capped
    assert p.budget(state(n_p_run=0, n_p_wait=5, n_d=1)) == 32  # waiting ones count too
    assert p.budget(state(n_p_run=2, n_p_wait=2, n_d=0)) == 512  # no decode: no cap
    assert PPASPolicy(nth=2, bcap=16).budget(state(n_p_run=1, n_d=1)) is None  # bmax=None


def test_ppas_cap_defaults_from_the_device_not_from_gpu_constants():
    p = PPASPolicy()
    with pytest.raises(UserError, match="policy ppas has no bcap"):  # when the run starts
        Engine(SimBackend(COST, CAP), p)
    with pytest.raises(UserError, match="policy cadence has no cost model"):
        Engine(SimBackend(COST, CAP), parse_policy("cadence:itl_ms=100"))
    Engine(SimBackend(COST, CAP), p, profile=profile())  # calibrated: ready
    # 100 ms at 2k tokens deep beside one decode: (100 - 2*20 - 2 - 0.5) / (3 + 2.05) ms
    assert p.bcap == profile().chunk_for() and 8 <= p.bcap <= 16


def test_ppas_on_the_simulated_backend_caps_only_under_pressure():
    p = PPASPolicy(nth=2, bmax=1024, bcap=32)
    engine = Engine(SimBackend(COST, CAP), p)
    iterations = drain(engine, requests(chats=1, docs=3))
    for it in iterations:
        if it.policy_state["capped"]:
            assert it.plan.n_prefill <= 32
    assert any(it.policy_state["capped"] for it in iterations)
    assert any(it.plan.n_prefill > 32 for it in iterations)  # pressure gone: back to bmax


# --- DLFP -------------------------------------------------------------------------------
def test_dlfp_shrinks_after_a_slow_iteration_and_grows_after_a_fast_one():
    p = DLFPPolicy(target_ms=100, c_initial=64, c_min=8, c_max=256, quantum=8)
    assert p.budget(state(n_p_run=1, n_d=1)) == 64
    p.observe(timing(0.200))  # twice the target: half the chunk
    assert p.budget(state(n_p_run=1, n_d=1)) == 32
    p.observe(timing(0.030))  # 32 * 100/30 = 106.7 -> floor to 8s: 104
    assert p.budget(state(n_p_run=1, n_d=1)) == 104
    p.observe(timing(0.010))  # 1040 -> clamped to c_max
    assert p.budget(state(n_p_run=1, n_d=1)) == 256
    p.observe(timing(5.0))  # clamped to c_min
    assert p.budget(state(n_p_run=1, n_d=1)) == 8


def test_dlfp_ignores_unguarded_cycles_resets_without_decodes_and_never_caps_isolated_prefill():
    p = DLFPPolicy(target_ms=100, c_initial=64, c_min=8, c_max=256, quantum=8)
    p.budget(state(n_p_run=1, n_d=1))
    p.observe(timing(0.5, n_decode=1, n_prefill=0))  # decode only: not guarded
    p.observe(timing(0.5, n_decode=0, n_prefill=64))  # prefill only: not guarded
    assert p.budget(state(n_p_run=1, n_d=1)) == 64
    p.observe(timing(0.2))
    assert p.budget(state(n_p_run=1, n_d=1)) == 32
    assert p.budget(state(n_p_run=1, n_d=0)) is None  # isolated prefill: unrestricted
    assert p.budget(state(n_p_run=1, n_d=1)) == 64  # and the cap was reset


def test_dlfp_defaults_come_from_the_device_profile():
    p = DLFPPolicy()
    p.calibrate(profile())
    assert p.target_ms == pytest.approx(100)
    assert p.c_initial == profile().chunk_for(0.1)
    assert p.quantum == max(8, p.c_initial // 4) and p.c_min == p.quantum and p.c_max == 2048


# --- cadence ----------------------------------------------------------------------------
def margin_s(p: CadencePolicy) -> float:
    return p.snapshot()["margin_ms"] / 1000


def test_cadence_gives_background_everything_when_no_foreground_decodes():
    p = CadencePolicy(itl_ms=150, share=1)
    p.calibrate(profile())
    assert p.decide(state(n_p_run=1, n_d=2, n_d_fg=0)).budget is None
    assert p.decide(state(n_p_run=1, n_d=2, n_d_fg=1, decode_ctx=500, pos=3000)).budget > 0


def test_cadence_budget_shrinks_deeper_into_a_document():
    p = CadencePolicy(itl_ms=150, share=1)
    p.calibrate(profile())
    shallow = p.decide(state(n_p_run=1, n_d=1, n_d_fg=1, decode_ctx=300, pos=0)).budget
    deep = p.decide(state(n_p_run=1, n_d=1, n_d_fg=1, decode_ctx=300, pos=8000)).budget
    assert shallow > deep >= 8


def test_cadence_converges_to_the_target_on_a_known_cost_model():
    # The policy starts from a wrong model (everything half as expensive) and must learn
    # the device's from completed iterations.
    wrong = CostModel(0.010, 0.001, 0.0015, 0.0005)
    p = CadencePolicy(itl_ms=150, share=1)
    p.calibrate(profile(wrong))
    iterations = drain(Engine(SimBackend(COST, CAP), p), requests(chats=2, docs=2))
    mixed = [it for it in iterations if it.timing.n_decode_foreground and it.plan.n_prefill]
    assert len(mixed) > 60
    settled = [it.timing.duration_s for it in mixed[20:]]
    assert max(settled) <= 0.150 * 1.01
    assert np.mean(settled) >= 0.150 * 0.85  # and it uses the room it has
    learned = p._model
    assert learned.per_prefill_s == pytest.approx(COST.per_prefill_s, rel=0.05)


def test_every_policy_parses_from_the_command_line():
    for spec in (
        "ppas:nth=2,bmax=4096,bcap=64",
        "dlfp:target_ms=80,quantum=16",
        "cadence:itl_ms=120,share=0.3",
    ):
        assert parse_policy(spec).name == spec.split(":")[0]


def test_cadence_keeps_its_tail_percentile_under_target_on_a_noisy_device():
    # 15% multiplicative noise the model cannot explain: the margin learned from its errors
    # must keep tail_pct percent of foreground iterations under the target, not just the
    # average, and a looser tail must buy the background more of the room.
    means = {}
    for tail in (99.0, 90.0):
        p = CadencePolicy(itl_ms=150, tail_pct=tail, share=1)
        p.calibrate(profile())
        backend = SimBackend(COST, CAP, noise=0.15, seed=1)
        iterations = drain(Engine(backend, p), requests(chats=2, docs=2, chat_out=400))
        mixed = [
            it.timing.duration_s
            for it in iterations
            if it.timing.n_decode_foreground and it.plan.n_prefill
        ][30:]
        assert len(mixed) > 300
        assert np.percentile(mixed, tail) <= 0.150
        assert margin_s(p) > 0.005
        means[tail] = np.mean(mixed)
    assert means[90.0] > means[99.0] * 1.05


def test_one_stall_is_not_the_margin_and_stalls_cannot_starve_the_documents():
    """One iteration beside a chat far over the model (a stall of the shared machine) is
    not taken for the tail of a few dozen samples; two of eight are, but the margin is
    capped so that prompt work still fits and the documents keep progressing instead of
    waiting for the stalls to age out."""
    p = CadencePolicy(itl_ms=100, share=1)
    p.calibrate(profile())
    model = p._model

    def mixed(duration: float) -> IterationTiming:
        return IterationTiming(duration, 1, 20, n_decode_foreground=1, n_chunks=1, ctx_work=600)

    for _ in range(7):
        p.observe(mixed(model.predict(1, 20, 1, 600)))
    p.observe(mixed(0.5))  # a 0.5 s stall
    assert margin_s(p) < 0.005
    p.observe(mixed(0.5))
    assert margin_s(p) == pytest.approx(0.050)
    chat = SchedState(1, 0, 1, 1, 2048, decode_ctx=600, next_prompt_left=1000)
    assert p.decide(chat).budget > 0


def test_cadence_leaves_room_for_the_host_time_of_chats_sampled_under_a_grammar():
    """Iterations whose chat's token was sampled under a JSON schema's grammar took the
    host 15 ms more: an iteration with two such chats gets fewer document tokens than one
    with plain chats, by about what 30 ms of prompt work costs."""
    p = CadencePolicy(itl_ms=150, share=1)
    p.calibrate(profile())
    model = p._model
    exact = model.predict(2, 20, 1, 600)
    for i in range(32):
        n = i % 2 * 2
        p.observe(
            IterationTiming(
                exact,
                2,
                20,
                n_decode_foreground=2,
                n_chunks=1,
                ctx_work=600,
                host_s=0.001 + 0.015 * n,
                n_constrained=n,
            )
        )
    plain = SchedState(1, 0, 2, 2, 2048, decode_ctx=600, next_prompt_left=4000)
    json_chats = replace(plain, n_constrained=2, n_constrained_foreground=2)
    fewer = p.decide(plain).budget - p.decide(json_chats).budget
    assert fewer == pytest.approx(0.030 / p._model.prompt_tokens_s(1), abs=1)  # as refitted


def test_cadence_sizes_a_chats_prompt_by_the_chats_own_errors():
    """Deep document chunks miss the model by tens of milliseconds, a chat's shallow chunk
    by a few: the documents' margin must not shrink a waiting chat's chunks (its first
    token waits for every one of them), while documents keep theirs."""
    p = CadencePolicy(itl_ms=100)
    p.calibrate(profile())
    model = p._model

    def doc(extra: float) -> IterationTiming:
        return IterationTiming(
            model.predict(1, 40, 1, 200_000) + extra, 1, 40, 1, n_chunks=1, ctx_work=200_000
        )

    def chat() -> IterationTiming:
        return IterationTiming(
            model.predict(1, 40, 1, 5_000),
            1,
            40,
            1,
            n_chunks=1,
            ctx_work=5_000,
            n_prefill_foreground=40,
        )

    for i in range(40):
        p.observe(doc(0.030 if i % 2 else 0.0))
        p.observe(chat())
    assert margin_s(p) > 0.010
    common = dict(decode_ctx=600, next_prompt_pos=0, next_prompt_left=300)
    documents = SchedState(1, 1, 1, 1, 2048, **common)
    waiting_chat = SchedState(1, 1, 1, 1, 2048, foreground_prompt_left=300, **common)
    assert p.snapshot()["prompt_margin_ms"] < 5
    # The margins' difference, spent on prompt tokens (~3 ms each here).
    room = (margin_s(p) - p.snapshot()["prompt_margin_ms"] / 1000) / p._model.per_prefill_s
    for_documents = p.decide(documents).budget
    assert p.decide(waiting_chat).budget >= for_documents + int(room) - 1 > for_documents


def test_cadence_prices_the_end_of_a_prompt():
    # Sampling a row costs as much as eight prompt tokens here (a large vocabulary), and
    # ending a prompt samples its last token and may open a second chunk with its own pass:
    # those iterations must stay under the target too, not form the foreground's tail.
    costly_sampling = CostModel(0.020, 0.025, 0.003, 0.001)
    p = CadencePolicy(itl_ms=150)
    p.calibrate(profile(costly_sampling))
    backend = SimBackend(costly_sampling, CAP)
    its = drain(Engine(backend, p), requests(chats=1, docs=12, chat_out=500, doc_len=300))
    ends = [
        it for it in its if it.timing.n_decode_foreground and it.timing.sampled > it.timing.n_decode
    ]
    assert len(ends) >= 4  # documents finished while the chat was decoding
    assert max(it.timing.duration_s for it in ends) <= 0.150


def test_nothing_rides_after_the_end_of_a_chats_prompt():
    """The chat's first token waits for its whole iteration: room left after the end of a
    chat's prompt is not given to a document (it is after a document's)."""
    p = CadencePolicy(itl_ms=150, share=1)
    p.calibrate(profile())
    document = SchedState(1, 1, 1, 1, 2048, decode_ctx=300, next_prompt_left=10)
    assert p.decide(document).budget > 10
    chat = replace(document, foreground_prompt_left=10)
    assert p.decide(chat).budget == 10


def test_cadence_defers_document_decodes_and_prompt_work_when_the_chat_target_is_at_risk():
    p = CadencePolicy(itl_ms=120, min_tokens=8, share=1)
    # As on a small model: a sampled row costs more than a pass over the weights.
    p.calibrate(profile(CostModel(0.010, 0.030, 0.003, 0.001)))
    # Two chats and two summaries decoding: 166 ms predicted with them, 81 without.
    busy = SchedState(2, 0, 4, 2, 512, decode_ctx=2000, decode_ctx_foreground=1000)
    decision = p.decide(busy)
    assert decision.defers_background_decodes
    assert decision.budget > 0  # the chats alone leave room
    calm = SchedState(2, 0, 2, 1, 512, decode_ctx=1000, decode_ctx_foreground=500)
    assert not p.decide(calm).defers_background_decodes
    assert not p.decide(replace(busy, n_decode_foreground=0)).defers_background_decodes
    # Even the chats' decodes alone over the target: no prompt work, for at most
    # MAX_STARVED iterations in a row, then the floor so documents still progress.
    over = SchedState(1, 0, 6, 6, 512, decode_ctx=3000, decode_ctx_foreground=3000)
    budgets = [p.decide(over).budget for _ in range(MAX_STARVED + 2)]
    assert budgets[:MAX_STARVED] == [0] * MAX_STARVED and budgets[MAX_STARVED] == 8


def test_background_decodes_the_planner_forces_in_ride_only_as_many_as_fit_in_turn():
    p = CadencePolicy(itl_ms=150, min_tokens=8, share=1)
    cost = CostModel(0.010, 0.030, 0.003, 0.001)
    p.calibrate(profile(cost))
    # Two chats decoding (105 ms with a chunk) and three summaries: after MAX_DEFERRED
    # iterations without them they must go, but not all three beside the chats.
    forced = SchedState(
        2, 0, 5, 2, 512, decode_ctx=2500, decode_ctx_foreground=1000, may_defer=False
    )
    decision = p.decide(forced)
    assert not decision.defers_background_decodes
    k = decision.background_decodes
    assert k == 1  # one more row fits the target, two do not
    assert cost.predict(3, 8, 1, 1500) <= 0.150 < cost.predict(4, 8, 1, 2000)
    # Room for all of them, or no chat decoding: every one rides.
    assert p.decide(replace(forced, n_decode=3)).background_decodes is None
    assert p.decide(replace(forced, n_decode_foreground=0)).background_decodes is None
    # Which ones: the fewest output tokens first, so they take turns.
    docs = [("a", 5), ("b", 3), ("c", 4)]
    rode = []
    for _ in range(3):
        (name, n), *_ = riders(docs, replace(decision, background_decodes=1), lambda d: d[1])
        rode.append(name)
        docs = [(d, m + 1 if d == name else m) for d, m in docs]
    assert rode == ["b", "b", "c"]  # ties in their order
    assert riders(docs, replace(decision, background_decodes=None), lambda d: d[1]) == docs
    assert riders(docs, replace(decision, background_decodes=0), lambda d: d[1]) == []


def test_cadence_gives_documents_their_share_of_a_chats_iterations_in_full_chunks():
    """While a chat decodes, documents take at most `share` of the device's time, in
    chunks that fill an iteration to the target rather than in crumbs beside every token,
    so the chat answers sooner; with share=1 they fill every iteration."""
    documents_part, chat_iteration = {}, {}
    for share in (0.25, 1.0):
        p = CadencePolicy(itl_ms=150, share=share)
        p.calibrate(profile())
        iterations = drain(
            Engine(SimBackend(COST, CAP), p), requests(chats=1, docs=1, chat_out=300)
        )
        chatting = [
            it.timing
            for it in iterations
            if it.timing.n_decode_foreground and not it.timing.n_prefill_foreground
        ]
        assert len(chatting) >= 299
        total = sum(t.duration_s for t in chatting)
        alone = sum(COST.predict(t.n_decode_foreground, 0, 0, 0) for t in chatting)
        documents_part[share] = (total - alone) / total
        chat_iteration[share] = total / len(chatting)
        with_chunk = [t.duration_s for t in chatting if t.n_prefill]
        assert max(with_chunk) <= 0.150 * 1.01
        assert np.median(with_chunk) >= 0.150 * 0.8
    assert 0.15 <= documents_part[0.25] <= 0.25 + 0.02  # progressing, within their share
    assert documents_part[1.0] > 0.7
    assert chat_iteration[0.25] < 0.4 * chat_iteration[1.0]


def test_cadence_sizes_a_waiting_chat_prompt_by_the_time_left_to_its_ttft_target():
    p = CadencePolicy(itl_ms=100, ttft_ms=1000)
    p.calibrate(profile(CostModel(0.010, 0.030, 0.003, 0.001)))
    chat = SchedState(1, 0, 1, 1, 2048, decode_ctx=500, foreground_prompt_left=200)
    early = p.decide(replace(chat, foreground_waited_s=0.0)).floor
    late = p.decide(replace(chat, foreground_waited_s=0.2)).floor
    assert 0 < early < late < 200  # less slack, bigger chunks: fewer iterations to wait
    base = p._model.predict(1, 0, 1, 500)
    per_token = 0.003 + 0.001 * 100 / 1000
    one_left = 1.0 - 200 * per_token - 1.5 * base  # time for one iteration, not two
    assert p.decide(replace(chat, foreground_waited_s=one_left)).floor == 200  # all now
    # Too late even for that: no stall of the other chats for a lost cause, but never
    # starved either: chunks at the guaranteed rate, each costing at least half of what
    # the rest of its iteration costs.
    lost = p.decide(replace(chat, foreground_waited_s=0.9)).floor
    paced = math.ceil(200 / math.floor((FOREGROUND_SLOWDOWN - 1) * per_token * 200 / base))
    assert 0 < lost == paced < early
    # Its remaining iterations fit the slack it was sized for.
    assert math.ceil(200 / early) * (base + 0.003 * early) <= 1.0 + 0.05
    # The request's own target, where the policy sets none; no target: the guaranteed rate.
    own = CadencePolicy(itl_ms=100)
    own.calibrate(profile(CostModel(0.010, 0.030, 0.003, 0.001)))
    assert own.decide(replace(chat, foreground_ttft_target_s=1.0)).floor == early
    assert own.decide(replace(chat, foreground_ttft_target_s=0.8)).floor > early
    assert own.decide(chat).floor is None  # the budget first, the rate once it is late
    assert own.decide(replace(chat, foreground_waited_s=0.9)).floor == lost
    # a model fitted with no per-iteration cost (all prompt tokens): the budget decides
    own.calibrate(profile(CostModel(0.0, 0.0, 0.003, 0.0)))
    assert own.decide(replace(chat, foreground_ttft_target_s=1.0)).floor is None


@pytest.mark.parametrize("spec", ["static:64", "unlimited"])
def test_a_documents_decodes_wait_while_a_chats_prompt_computes(spec):
    """Each sampled row costs as much as a chat's own token on a small model: while a
    chat's prompt is being computed its first token should not wait for documents' rows.
    A policy that does not cap (`unlimited`, what llama-server does) leaves them in."""
    engine = Engine(SimBackend(COST, CAP), parse_policy(spec))
    engine.add(Request("doc", "background", 0.0, list(range(100, 150)), 40, ignore_eos=True))
    engine.iterate()  # the document's prompt: it decodes from now on
    chat = Request("chat", "foreground", 0.0, list(range(100, 400)), 8, ignore_eos=True)
    engine.add(chat)
    plans = []
    while not chat.output:
        plans.append(engine.iterate().plan)  # until the chat has its first token
    assert plans and all("chat" in p.prefill for p in plans)
    if spec == "unlimited":
        assert all(list(p.decode) == ["doc"] and not p.deferred for p in plans)
    else:
        assert all(list(p.deferred) == ["doc"] and not p.decode for p in plans)
    after = engine.iterate().plan
    assert "doc" in after.decode  # and it decodes again once the chat's prompt is in
