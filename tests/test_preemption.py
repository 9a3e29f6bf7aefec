"""A chat that arrives while a document is being read stops the document's iteration at
the next graph node (in exact batching, where the rollback is exact); what finished is
kept, nothing else changes (real model)."""

from __future__ import annotations

import numpy as np
import pytest

from edgeprefill.runtime.core.contract import SeqWork
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.request import Request, Status
from edgeprefill.runtime.policies import UnlimitedPolicy, parse_policy
from edgeprefill.runtime.replay.loop import run_requests
from edgeprefill.runtime.results.writer import RunWriter
from edgeprefill.runtime.traffic.prompts import PromptBuilder

pytestmark = pytest.mark.slow


class StopAfter:
    """An abort flag that turns true after llama.cpp has asked `n` times (it asks once per
    graph node), so a test stops an iteration at an exact point whatever the CPU's speed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.asked = 0

    def is_set(self) -> bool:
        self.asked += 1
        return self.asked > self.n

    def clear(self) -> None:
        self.n = 10**12


def nodes_per_micro_batch(backend, seq_id: int) -> int:
    """How often llama.cpp asks while computing one full micro-batch of a prompt."""
    count = StopAfter(10**12)
    n = backend.settings.n_ubatch
    work = [SeqWork(seq_id, tokens(backend, n, 9), 0, None)]
    backend.execute(work, abort=count)
    backend.release(seq_id)
    return count.asked


def tokens(backend, n: int, seed: int) -> list[int]:
    return PromptBuilder(backend.tokenizer).synthetic(n, np.random.default_rng(seed))


def run_alone(engine: Engine, req: Request) -> list[int]:
    engine.add(req)
    while engine.has_work:
        assert engine.iterate() is not None
    return req.output


def test_a_document_aborted_part_way_resumes_with_the_same_greedy_output(make_backend):
    # Fast batching: a chunk spans several micro-batches (exact batching caps a chunk at
    # one, so there an iteration is the unit of preemption). Prompt pieces of whole
    # micro-batches are exact without flash attention (with it, on an AVX-512 EPYC, no
    # piece size was), so outputs must match. The micro-batch is set, not measured
    # fastest: a device that picks 2048 would hold the document in one.
    be = make_backend(n_ctx=2048, batching="fast", n_ubatch=512, flash_attn=False)
    doc = tokens(be, 1500, 1)
    reference = run_alone(Engine(be, UnlimitedPolicy()), Request("ref", "background", 0, doc, 8))

    nodes = nodes_per_micro_batch(be, seq_id=5)
    engine = Engine(be, UnlimitedPolicy())
    req = Request("doc", "background", 0, doc, 8)
    engine.add(req)
    engine._abort = StopAfter(nodes + nodes // 2)  # type: ignore[assignment]
    it = engine.iterate()  # stops in its second micro-batch
    n_ubatch = be.settings.n_ubatch
    assert it is not None and it.preempted == {**it.preempted, "kept": n_ubatch}
    assert it.preempted["lost"] == len(doc) - n_ubatch
    assert it.plan.n_prefill == n_ubatch and req.num_computed == n_ubatch
    assert be.seq_pos_max(req.seq_id) == n_ubatch - 1  # the stopped one left no cells
    assert req.status is Status.PREFILL and not req.output
    while engine.has_work:  # positions go on from the sequence's real end
        engine.iterate()
    assert req.output == reference


def test_in_fast_batching_no_micro_batch_wraps_the_ring_so_a_stop_lands_mid_graph(make_backend):
    """Stopped mid-graph, a micro-batch that wrapped the sliding-window ring had already
    given up cells of earlier positions: the sequence's cells ended short of its computed
    prompt and its next pass failed (`llama_decode` -1; seen in the server soak, history
    section E); made to finish instead, it kept a chat waiting for all of it. In fast
    batching a chunk's micro-batches now end where the ring turns: the stop lands in the
    first node, and the document still ends with the output of a run never stopped."""
    be = make_backend(n_ctx=2048, batching="fast", n_ubatch=512, flash_attn=False)
    if not be.ring.n_swa:
        pytest.skip("the model has no sliding-window layers")
    doc = tokens(be, 1500, 1)
    reference = run_alone(Engine(be, UnlimitedPolicy()), Request("ref", "background", 0, doc, 8))
    engine = Engine(be, parse_policy("static:800"))
    req = Request("doc", "background", 0, doc, 8)
    engine.add(req)
    engine.iterate()
    p0 = req.num_computed
    assert p0 < be.ring.size < p0 + 512  # a 512-token micro-batch from here would wrap
    engine._abort = StopAfter(3)  # type: ignore[assignment]  # set from the first node on
    it = engine.iterate()
    assert it is not None and it.preempted is not None and it.preempted["kept"] == 0
    assert req.num_computed == p0 == be.seq_pos_max(req.seq_id) + 1
    while engine.has_work:
        engine.iterate()
    assert req.error is None and req.output == reference


def test_documents_decodes_finish_and_only_their_prompt_work_stops(make_backend):
    """A chat arriving while one document decodes beside another's prompt chunk stops the
    chunk, not the decode: the decode token is kept, the chunk's remainder computed later,
    and both documents end with the outputs of a run never stopped."""
    be = make_backend(n_ctx=4096, n_ubatch=512, flash_attn=False)  # exact batching
    short, long = tokens(be, 40, 11), tokens(be, 3000, 12)

    def pair() -> tuple[Request, Request]:
        return (
            Request("short", "background", 0, short, 6, ignore_eos=True),
            Request("long", "background", 0, long, 4, ignore_eos=True),
        )

    reference = Engine(be, UnlimitedPolicy())
    ref = pair()
    for r in ref:
        reference.add(r)
    while reference.has_work:
        reference.iterate()

    engine = Engine(be, UnlimitedPolicy())
    a, b = pair()
    engine.add(a)
    engine.add(b)
    engine.iterate()  # both prompts start; the short one ends and samples its first token
    engine.preempt()  # a chat arrives before the next iteration's prompt pass
    it = engine.iterate()
    assert it is not None and it.plan.decode == ("short",) and it.preempted is not None
    assert len(a.output) == 2 and a.token_times_s[-1] >= it.t_start_s  # the decode kept
    assert it.preempted == {**it.preempted, "kept": 0, "lost": be.settings.n_ubatch}
    assert b.num_computed == be.seq_pos_max(b.seq_id) + 1  # no cells past what is kept
    while engine.has_work:
        engine.iterate()
    assert (a.output, b.output) == (ref[0].output, ref[1].output)


@pytest.mark.parametrize("where", ["before", "wrapping", "first node", "middle node", "last node"])
def test_an_abort_anywhere_in_a_micro_batch_keeps_exact_outputs_exact(make_backend, where):
    """In exact batching, wherever a chat's arrival lands in a document's chunk (one
    micro-batch there), the document ends with the output of a run never stopped: a chunk
    is stopped mid-graph and recomputed only where llama.cpp's rollback is exact; one that
    wraps the sliding-window cache's ring is not asked while it computes and finishes."""
    be = make_backend(n_ctx=4096, n_ubatch=512, flash_attn=False)  # exact batching
    assert be.settings.exact and be.ring.n_swa and be.ring.size == 1024  # window + micro-batch
    doc = tokens(be, 1500, 13)

    def run(stop) -> tuple[list[int], list[dict]]:
        engine = Engine(be, parse_policy("static:300"))  # pieces at 0, 300, ..., 1200
        req = Request("doc", "background", 0, doc, 4, ignore_eos=True)
        engine.add(req)
        while req.num_computed < 900:
            engine.iterate()
        assert not be.ring.abortable(req.seq_id, 900, 300)  # [900, 1200) wraps at 1024
        assert be.ring.abortable(req.seq_id, 1200, 300)
        engine._abort = stop  # type: ignore[assignment]
        stops = []
        while engine.has_work:
            it = engine.iterate()
            if it is not None and it.preempted:
                stops.append({**it.preempted, "at": req.num_computed})
        return req.output, stops

    reference, never = run(StopAfter(10**12))
    assert never == []
    nodes = nodes_per_micro_batch(be, seq_id=7) - 1  # less the ask before it starts
    # The flag is read before each chunk, not while the wrapping one computes, and after
    # every graph node of the next.
    asks = {"before": 0, "wrapping": 1, "first node": 2, "middle node": 2 + nodes // 2}
    output, stops = run(StopAfter(asks.get(where, 2 + nodes - 1)))
    at = 900 if where == "before" else 1200
    assert [(s["kept"], s["lost"], s["at"]) for s in stops] == [(0, 300, at)]
    assert output == reference


def test_a_chats_prompt_is_never_stopped_and_a_chats_decode_outlives_a_stop(make_backend):
    """A stop pending while a chat's prompt computes waits; in the next iteration the
    chat's decode is computed and sampled, then the document's prompt work stops."""
    be = make_backend(n_ctx=4096)
    engine = Engine(be, parse_policy("static:256"))
    chat = Request("chat", "foreground", 0, tokens(be, 40, 2), 6, ignore_eos=True)
    doc = Request("doc", "background", 0, tokens(be, 3000, 3), 4)
    engine.add(chat)
    engine.add(doc)
    engine.preempt()  # pending while the chat's prompt computes beside the document
    first = engine.iterate()
    assert first.plan.n_prefill_foreground and first.preempted is None
    assert len(chat.output) == 1
    engine.preempt()
    it = engine.iterate()
    assert it.plan.decode == ("chat",) and it.preempted is not None
    assert len(chat.output) == 2 and it.plan.n_prefill == it.preempted["kept"]
    assert it.preempted["kept"] + it.preempted["lost"] == min(256, be.capacity.max_chunk or 256)
    nxt = engine.iterate()  # the stop was used up: the next iteration runs whole
    assert nxt.preempted is None and nxt.plan.n_prefill > 0 and len(chat.output) == 3


def ttft_of_a_chat_arriving_during_a_long_document_chunk(
    backend, writer_dir, beside_a_chat: bool
) -> tuple[float, dict]:
    """The first-token time of a chat that arrives while a 2,048-token document chunk
    computes, alone or beside a running chat's decode (the document arriving once that chat
    decodes). P-PAS sets no budget while fewer than two prompts compute, and caps them at
    64 tokens, the chat's first, once the chat arrives."""
    doc_at, chat_at = (0.2, 1.0) if beside_a_chat else (0.0, 0.4)
    doc = Request("doc", "background", doc_at, tokens(backend, 3000, 5), 4, ignore_eos=True)
    chat = Request("chat", "foreground", chat_at, tokens(backend, 60, 6), 4, ignore_eos=True)
    requests = [doc, chat]
    if beside_a_chat:  # 200 tokens: still decoding when the document comes, on any CPU
        requests.append(
            Request("running", "foreground", 0.0, tokens(backend, 40, 7), 200, ignore_eos=True)
        )
    engine = Engine(backend, parse_policy("ppas:bcap=64"))
    with RunWriter(writer_dir) as writer:
        run_requests(engine, requests, writer)
        summary = writer.summary({}, 0.0, False, 0)
    assert all(len(r.output) == r.max_tokens for r in requests)  # no token lost to a stop
    return chat.token_times_s[0] - chat.arrival_s, summary


@pytest.mark.parametrize("beside_a_chat", [False, True], ids=["document-only", "document-heavy"])
def test_a_chat_arriving_during_a_long_document_chunk_gets_its_first_token_sooner(
    make_backend, tmp_path, beside_a_chat
):
    be = make_backend(n_ctx=4096, batching="fast")  # 2,048-token chunks
    with_abort, summary = ttft_of_a_chat_arriving_during_a_long_document_chunk(
        be, tmp_path / "a", beside_a_chat
    )
    be.supports_abort = False  # the same run without preemption
    without, base = ttft_of_a_chat_arriving_during_a_long_document_chunk(
        be, tmp_path / "b", beside_a_chat
    )
    assert summary["preemption"]["count"] >= 1 and base["preemption"]["count"] == 0
    assert summary["accounting"]["reconciled"]
    # Without: the chat waits for the rest of a 2,048-token chunk (seconds on a CPU); with:
    # for the micro-batch in flight. Large margin: this is behaviour, not a benchmark.
    assert with_abort < 0.6 * without, (with_abort, without)
    assert summary["preemption"]["max_abort_latency_ms"] < 1000
