"""The simulated backend stops documents-only prompt work for a chat's arrival, as llama.cpp
does: without it, a simulated chat waits for whole 2,048-token chunks that the real engine
aborts, and every first-token number the simulator gives is seconds too long."""

from __future__ import annotations

import numpy as np

from edgeprefill.backends.sim import SimBackend
from edgeprefill.runtime.core.contract import Capacity
from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.policies import parse_policy
from edgeprefill.runtime.replay.loop import run_requests
from edgeprefill.runtime.results.writer import RunWriter

# One pass 10 ms, a sampled row 5 ms, a prompt token 1 ms: a 2,048-token chunk takes ~2 s.
COST = CostModel(per_pass_s=0.010, per_sampled_s=0.005, per_prefill_s=0.001, per_kctx_s=0.0)


def prompt(n: int, seed: int) -> list[int]:
    return [1, *np.random.default_rng(seed).integers(10, 999, n - 1).tolist()]


def backend(n_batch: int = 2048) -> SimBackend:
    return SimBackend(COST, Capacity(n_batch, 8 * 8192, 8, 8192, chunk_quantum=4))


def replay(be: SimBackend, reqs: list[Request], out) -> dict:
    engine = Engine(be, parse_policy("ppas:bcap=64"))  # no budget while nothing decodes
    with RunWriter(out) as writer:
        run_requests(engine, reqs, writer)
        return writer.summary({}, 0.0, False, 0)


def test_a_chat_arriving_during_a_documents_only_chunk_stops_it_at_its_arrival(tmp_path):
    doc = Request("doc", "background", 0.0, prompt(6000, 1), 4, ignore_eos=True)
    chat = Request("chat", "foreground", 0.5, prompt(200, 2), 4, ignore_eos=True)
    summary = replay(backend(), [doc, chat], tmp_path / "a")
    alone = COST.predict(0, 200, 1, 0, n_sampled=1)
    # The chat's prompt starts at its arrival: its first token comes as if the device were
    # idle, not after the rest of the 2,048-token chunk (1.5 s more).
    assert abs(chat.token_times_s[0] - chat.arrival_s - alone) < 1e-9
    pre = summary["preemption"]
    assert pre["count"] == 1 and pre["max_abort_latency_ms"] == 0.0
    # Whole quanta of the stopped chunk are kept: ~490 ms of 1 ms tokens, less the pass.
    assert pre["prompt_tokens_kept"] % 4 == 0 and 400 < pre["prompt_tokens_kept"] < 500
    assert summary["accounting"]["reconciled"] and len(doc.output) == 4


def test_a_one_token_last_piece_computed_with_the_decodes_is_kept_when_the_rest_stops(tmp_path):
    """The piece is shaped as a decode (one token, sampled): llama.cpp and the simulator
    compute it before any chunk, so an abort cannot lose it; the engine must count it
    computed, or its request gets a first token for a prompt it still thinks unfinished."""
    be = backend(n_batch=64)
    first = Request("doc0", "background", 0.0, prompt(65, 3), 4, ignore_eos=True)
    second = Request("doc1", "background", 0.0, prompt(2000, 4), 4, ignore_eos=True)
    engine = Engine(be, parse_policy("ppas:bcap=64"))
    engine.add(first), engine.add(second)
    assert engine.iterate().plan.prefill == {"doc0": 64}
    # Ring halfway through the next iteration: doc0's last token, then doc1's 63.
    alarm = be.clock.alarm(engine.preempt)
    alarm.set(be.clock.now() + COST.predict(1, 63, 1, 0) / 2)
    it = engine.iterate()
    alarm.close()
    assert it.preempted is not None and it.plan.prefill["doc0"] == 1
    assert first.remaining_prompt == 0 and len(first.output) == 1
    assert 0 < it.plan.prefill.get("doc1", 0) < 63 and second.output == []
    while engine.has_work:
        engine.iterate()
    assert len(first.output) == len(second.output) == 4
    assert first.num_computed == 65 and second.num_computed == 2000
