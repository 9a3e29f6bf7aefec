"""Time to first token of a question about a document, with and without the document's
saved KV state, on the llama.cpp backend with the bundled model.

    .venv/bin/python benchmarks/kv_reuse.py [--doc-tokens 4000] [--rounds 3]

Each round, on one backend: the question with nothing saved (the document computed as part
of its prompt), then the document indexed (its state saved), then the same question again
(restored from memory), then once more from a backend that starts with empty memory (the
state read back from disk). Rounds interleave on one machine; ratios compare within them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgeprefill.backends.bundled_model import default_model_path
from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.policies import parse_policy
from edgeprefill.runtime.traffic.prompts import generate_text

QUESTION = "\n\nWhich three subjects does the text above come back to most often?"


def prompts(be: LlamaCppBackend, n_doc: int, seed: int) -> tuple[Request, Request]:
    tok = be.tokenizer
    before, after = tok.chat_parts(None)
    head = tok.encode(before, add_bos=True, special=True)
    text = generate_text(np.random.default_rng(seed), n_doc)
    body = tok.encode(text, add_bos=False, special=False)[:n_doc]
    tail = tok.encode(after, add_bos=False, special=True)
    instr = tok.encode("\n\nSummarize the text above.", add_bos=False, special=False)
    question = tok.encode(QUESTION, add_bos=False, special=False)
    doc = Request(
        "doc", "background", 0.0, head + body + instr + tail, 16, share_prefix=len(head + body)
    )
    ask = Request("ask", "foreground", 0.0, head + body + question + tail, 16, ignore_eos=True)
    return doc, ask


def ttft(engine: Engine, template: Request) -> tuple[float, Request]:
    """Seconds from submitting a copy of `template` to its first token, stepping alone."""
    req = dataclasses.replace(template, output=[], token_times_s=[])
    t0 = time.perf_counter()
    engine.add(req)
    first = None
    while engine.has_work:
        engine.iterate()
        if first is None and req.output:
            first = time.perf_counter() - t0
    assert first is not None
    return first, req


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc-tokens", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/kv_reuse.json"))
    args = ap.parse_args()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        config = LlamaCppConfig(
            model=default_model_path(),
            n_ctx=args.doc_tokens + 512,
            n_seq_max=2,
            kv_cache_dir=Path(folder),
        )
        for r in range(args.rounds):
            with LlamaCppBackend(config) as be:
                cache = be.prefix_cache
                assert cache is not None
                cache.clear()
                engine = Engine(be, parse_policy("unlimited"))
                doc, ask = prompts(be, args.doc_tokens, r)
                cold, cold_req = ttft(engine, ask)
                ttft(engine, doc)  # the indexer reads it: its state is saved
                warm, warm_req = ttft(engine, ask)
                cache.store.flush()
                stats = cache.describe()
                assert cold_req.output == warm_req.output, "restored answer differs"
            with LlamaCppBackend(config) as be:  # a later process: the state is on disk
                disk, disk_req = ttft(Engine(be, parse_policy("unlimited")), ask)
            row = {
                "doc_tokens": doc.share_prefix,
                "ttft_without_s": cold,
                "ttft_with_memory_s": warm,
                "ttft_with_disk_s": disk,
                "restore_memory_s": warm_req.restore_s,
                "restore_disk_s": disk_req.restore_s,
                "reused_tokens": warm_req.prefix_reused_tokens,
                "computed_tokens": warm_req.prompt_len - warm_req.prefix_reused_tokens,
                "state_bytes": stats["ram_bytes"],
                "bytes_per_token": stats["ram_bytes"] / warm_req.prefix_reused_tokens,
                "same_answer": cold_req.output == warm_req.output == disk_req.output,
            }
            rounds.append(row)
            print(json.dumps(row), flush=True)
    summary = {
        k: statistics.median(r[k] for r in rounds)
        for k in (
            "ttft_without_s",
            "ttft_with_memory_s",
            "ttft_with_disk_s",
            "restore_memory_s",
            "restore_disk_s",
            "bytes_per_token",
        )
    }
    summary["speedup_memory"] = summary["ttft_without_s"] / summary["ttft_with_memory_s"]
    summary["speedup_disk"] = summary["ttft_without_s"] / summary["ttft_with_disk_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": rounds, "median": summary}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
