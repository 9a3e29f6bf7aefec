"""A document the indexer read is kept and restored for a question about it (real model,
llama.cpp's per-sequence state API)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgeprefill.backends.llamacpp.state_store import SUFFIX
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.policies import parse_policy
from edgeprefill.runtime.traffic.prompts import generate_text
from tests.helpers import drain

pytestmark = pytest.mark.slow

INSTRUCTION = "Summarize the text above."


def prompts(backend, n_doc: int = 700) -> tuple[Request, Request]:
    """An indexer's request for a document and a question about it, built as the
    workloads and the Runtime build them: chat prefix + document, then their own ends."""
    tok = backend.tokenizer
    before, after = tok.chat_parts(None)
    head = tok.encode(before, add_bos=True, special=True)
    body = tok.encode(generate_text(np.random.default_rng(3), n_doc), add_bos=False, special=False)
    body = body[:n_doc]
    tail = tok.encode(after, add_bos=False, special=True)
    instr = tok.encode("\n\n" + INSTRUCTION, add_bos=False, special=False)
    question = tok.encode("\n\nWhich word comes up most often?", add_bos=False, special=False)
    doc = Request(
        "doc", "background", 0.0, head + body + instr + tail, 8, share_prefix=len(head + body)
    )
    ask = Request("ask", "foreground", 0.0, head + body + question + tail, 12, ignore_eos=True)
    return doc, ask


def fresh(req: Request) -> Request:
    return Request(req.id, req.cls, 0.0, list(req.prompt), req.max_tokens, ignore_eos=True)


def test_a_question_after_indexing_computes_only_the_question_and_answers_the_same(
    make_backend,
):
    plain = make_backend(kv_cache=False)
    doc, ask = prompts(plain)
    before = fresh(ask)
    drain(Engine(plain, parse_policy("static:64")), [before])  # not indexed: all computed
    assert before.prefix_reused_tokens == 0 and before.num_computed == before.prompt_len

    be = make_backend()
    engine = Engine(be, parse_policy("static:64"))
    drain(engine, [doc])
    q = be.capacity.chunk_quantum
    saved = doc.share_prefix // q * q  # cut at a piece boundary, so shapes stay exact
    assert be.prefix_cache.describe()["saved"] == 1
    after = fresh(ask)
    drain(engine, [after])  # continues the document's parked sequence, cut back to it
    assert after.prefix_reused_tokens == saved and after.restore_s is None
    assert after.record()["prefilled_tokens"] == after.prompt_len - saved  # the question
    assert after.output == before.output  # the same greedy tokens as computing it all
    while engine.scheduler.parked:  # gone from the context: restored from the saved state
        engine.scheduler.parked.evict()
    restored = fresh(ask)
    drain(engine, [restored])
    assert restored.prefix_reused_tokens >= saved and restored.restore_s > 0
    assert restored.output == before.output


def test_a_damaged_or_foreign_state_file_is_rejected_and_the_prompt_computed(
    make_backend, kv_cache_folder, caplog
):
    be = make_backend()
    doc, ask = prompts(be)
    drain(Engine(be, parse_policy("static:64")), [doc])
    be.prefix_cache.store.flush()
    be.close()
    (path,) = kv_cache_folder.glob(f"*{SUFFIX}")
    good = path.read_bytes()
    reference = None
    for damage in ("corrupted", "truncated", "foreign"):
        if damage == "corrupted":
            path.write_bytes(good[:-10] + bytes(b ^ 0xFF for b in good[-10:]))
        elif damage == "truncated":
            path.write_bytes(good[: len(good) // 2])
        else:  # the same file claimed by another model file
            cut = 8 + int.from_bytes(good[4:8], "little")
            header = json.loads(good[8:cut])
            header["identity"]["model"] = "another-model"
            raw = json.dumps(header, sort_keys=True).encode()
            path.write_bytes(good[:4] + len(raw).to_bytes(4, "little") + raw + good[cut:])
        other = make_backend()  # a new process's backend: nothing in memory
        q = fresh(ask)
        drain(Engine(other, parse_policy("static:64")), [q])
        assert q.prefix_reused_tokens == 0 and q.record()["prefilled_tokens"] == q.prompt_len
        reference = reference or q.output
        assert q.output == reference
        other.close()
    assert caplog.text.count("computing the prompt instead") >= 2  # the foreign one is skipped


def test_cancelling_a_request_right_after_its_restore_frees_its_cells(make_backend):
    be = make_backend()
    doc, ask = prompts(be)
    engine = Engine(be, parse_policy("static:64"))
    drain(engine, [doc])
    engine.scheduler.parked.evict()  # the document's sequence: its state is in the store
    q = fresh(ask)
    engine.add(q)
    assert engine._admit() is not None  # admitted: the saved document is restored into it
    assert q.prefix_reused_tokens > 0 and be.ctx.seq_pos_max(q.seq_id) >= q.prefix_reused_tokens - 1
    seq = q.seq_id
    free = engine.scheduler.kv_free
    assert engine.cancel(q)
    assert engine.scheduler.kv_free == free + q.kv_cells  # its reservation is returned
    assert engine.scheduler.parked.evict() == seq  # parked, for a prompt that continues it
    assert be.ctx.seq_pos_max(seq) == -1  # its cells are gone once released
