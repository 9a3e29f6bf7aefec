"""The device probe: which batch shapes give bit-identical logits on this CPU, and which
settings are fastest, measured with the loaded model (half a minute to several minutes on a 2-core CPU, once
per CPU, llama.cpp build, model and thread count; `probe_cache` keeps the result).

Exactness is checked against what a sequence computes alone: its logits, compared bit for
bit, when its prompt is cut into pieces of each size 1..16 (on two prompts, so that a size
whose rounding agrees by chance on one prompt is caught on the other) and when 2..16
sequences decode in one pass. Speed is prompt tokens per second at each candidate
`n_ubatch`, the time of a 64-token chunk 2,048 tokens deep, and the time of a pass of g
decode rows, for flash attention off and on.
"""

from __future__ import annotations

import logging
import time

import llama_cpp as lc
import numpy as np

from edgeprefill.backends.llamacpp.native import LlamaBatch, LlamaContext, LlamaModel
from edgeprefill.backends.llamacpp.shapes import DEEP_CHUNK, DEEP_DEPTH, AttentionFacts
from edgeprefill.runtime.core.contract import SeqWork
from edgeprefill.runtime.core.request import SamplingParams

log = logging.getLogger(__name__)

GROUPS = 16  # decode groups of up to this many rows are checked and timed
PIECES = 16  # prompt pieces of 1..PIECES tokens are checked
PIECE_PROMPT = 4 * PIECES  # the prompt cut as [PIECES, k, k, rest]; the reference is one piece
PREFILL_PROMPT = DEEP_DEPTH  # prompt tokens timed at each micro-batch size (documents are longer)
UBATCHES = (128, 256, 512, 2048)
_SAMPLE = SamplingParams()  # marks the rows whose logits are compared


def measure(model: LlamaModel, *, n_threads: int, kv_unified: bool) -> list[AttentionFacts]:
    """Facts for flash attention off, then on."""
    tokens = plain_tokens(model, 4 * PREFILL_PROMPT)
    facts = []
    for flash_attn in (False, True):
        check = _InvarianceCheck(model, tokens, n_threads, kv_unified, flash_attn)
        try:
            pieces, tail = check.pieces()
            groups, steps = check.groups()
        finally:
            check.close()
        timed = {
            u: _prefill_rate(model, tokens, n_threads, kv_unified, flash_attn, u) for u in UBATCHES
        }
        rates = {u: rate for u, (rate, _) in timed.items()}
        deep = min(d for _, d in timed.values())
        facts.append(AttentionFacts(flash_attn, groups, pieces, tail, steps, rates, deep))
        log.debug("probe: %s", facts[-1].to_dict())
    return facts


def plain_tokens(model: LlamaModel, n: int) -> list[int]:
    """BOS, then seeded plain-text tokens (no control or byte tokens)."""
    vocab = model.vocab
    normal = [
        t
        for t in range(lc.llama_vocab_n_tokens(vocab))
        if lc.llama_vocab_get_attr(vocab, t) & lc.LLAMA_TOKEN_ATTR_NORMAL
    ]
    rng = np.random.default_rng(0)
    return [lc.llama_vocab_bos(vocab), *(normal[i] for i in rng.integers(0, len(normal), n - 1))]


class _InvarianceCheck:
    """One small context with GROUPS sequences, for exact comparisons of logits."""

    def __init__(
        self,
        model: LlamaModel,
        tokens: list[int],
        n_threads: int,
        kv_unified: bool,
        flash_attn: bool,
    ) -> None:
        self.tokens = tokens
        n_ctx = 2 * PIECE_PROMPT + 2 * GROUPS + 64
        self.ctx = LlamaContext(
            model,
            n_ctx=n_ctx * GROUPS if kv_unified else n_ctx,
            n_batch=2 * PIECE_PROMPT,
            n_ubatch=2 * PIECE_PROMPT,
            n_seq_max=GROUPS,
            n_threads=n_threads,
            kv_unified=kv_unified,
            flash_attn=flash_attn,
        )
        self.batch = LlamaBatch(2 * PIECE_PROMPT)

    def _run(self, work: list[SeqWork]) -> float:
        return _timed_decode(self.ctx, self.batch, work)

    def _cut(self, prompt: list[int], cut: list[int]) -> list[np.ndarray]:
        """Logits of the prompt's last token and of one decode after it, with the prompt
        prefilled in pieces of the sizes in `cut`."""
        pos = 0
        for k in cut:
            last = pos + k == len(prompt)
            self._run([SeqWork(0, prompt[pos : pos + k], pos, _SAMPLE if last else None)])
            pos += k
        rows = [self.ctx.logits(cut[-1] - 1)]
        self._run([SeqWork(0, [self.tokens[-1]], pos, _SAMPLE)])
        rows.append(self.ctx.logits(0))
        self.ctx.seq_rm(0)
        return rows

    def pieces(self) -> tuple[dict[int, bool], bool]:
        ok: dict[int, bool] = {}
        for offset in (0, PIECE_PROMPT):  # a second prompt re-checks the sizes that passed
            prompt = self.tokens[offset : offset + PIECE_PROMPT]
            prompt[0] = self.tokens[0]
            reference = self._cut(prompt, [PIECE_PROMPT])
            for k in range(1, PIECES + 1):
                if ok.get(k, True):
                    cut = [PIECES, k, k, PIECE_PROMPT - PIECES - 2 * k]
                    ok[k] = _same(reference, self._cut(prompt, cut))
        # a last piece of an odd size, after pieces that pass everywhere
        odd = self.tokens[: PIECE_PROMPT + 3]
        tail = _same(self._cut(odd, [len(odd)]), self._cut(odd, [PIECES, PIECES, len(odd) - 32]))
        return ok, tail

    def groups(self) -> tuple[dict[int, bool], dict[int, float]]:
        """Each sequence decoded alone, then g of them in one pass, twice each (the
        faster time is kept; both passes must match)."""
        lens = [PIECES + 3 * s for s in range(GROUPS)]
        for s, n in enumerate(lens):
            self._run([SeqWork(s, self.tokens[100 * s : 100 * s + n], 0, None)])

        def decode(seqs: list[int]) -> tuple[list[np.ndarray], float]:
            """One token for each of `seqs` in one pass; its cells removed after."""
            work = [SeqWork(s, [self.tokens[-1 - s]], lens[s], _SAMPLE) for s in seqs]
            elapsed = self._run(work)
            rows = [self.ctx.logits(i) for i in range(len(seqs))]
            for s in seqs:
                self.ctx.seq_rm(s, lens[s])
            return rows, elapsed

        singles = [decode([s]) for s in range(GROUPS)]
        alone = [rows[0] for rows, _ in singles]
        times = {1: min(t for _, t in singles)}
        ok = {1: True}
        for g in range(2, GROUPS + 1):
            (rows_a, t_a), (rows_b, t_b) = decode(list(range(g))), decode(list(range(g)))
            ok[g] = _same(alone[:g], rows_a) and _same(alone[:g], rows_b)
            times[g] = min(t_a, t_b)
        for s in range(GROUPS):
            self.ctx.seq_rm(s)
        return ok, times

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def _timed_decode(ctx: LlamaContext, batch: LlamaBatch, work: list[SeqWork]) -> float:
    """Seconds of one llama_decode of `work`."""
    batch.fill(work)
    t0 = time.perf_counter()
    rc = ctx.decode(batch.view(0, batch.n_filled))
    elapsed = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc} during the device probe")
    return elapsed


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _prefill_rate(
    model: LlamaModel,
    tokens: list[int],
    n_threads: int,
    kv_unified: bool,
    flash_attn: bool,
    n_ubatch: int,
) -> tuple[float, float]:
    """Prompt tokens per second for one PREFILL_PROMPT-token prompt in one call, and the
    seconds of a DEEP_CHUNK-token chunk after it (the fastest of three): how a chunk deep
    in a document costs, which flash attention changes (on the CPUs tried it was 12% slower
    at depth 2k and 28% at 6k, while it was a little faster for shallow decodes)."""
    ctx = LlamaContext(
        model,
        n_ctx=PREFILL_PROMPT + DEEP_CHUNK + 64,
        n_batch=PREFILL_PROMPT,
        n_ubatch=n_ubatch,
        n_seq_max=1,
        n_threads=n_threads,
        kv_unified=kv_unified,
        flash_attn=flash_attn,
    )
    batch = LlamaBatch(PREFILL_PROMPT)

    try:
        prompt = [SeqWork(0, tokens[:PREFILL_PROMPT], 0, _SAMPLE)]
        rate = PREFILL_PROMPT / _timed_decode(ctx, batch, prompt)
        chunk = tokens[PREFILL_PROMPT : PREFILL_PROMPT + DEEP_CHUNK]
        deep = []
        for _ in range(3):
            deep.append(_timed_decode(ctx, batch, [SeqWork(0, chunk, PREFILL_PROMPT, _SAMPLE)]))
            ctx.seq_rm(0, PREFILL_PROMPT)
        return rate, min(deep)
    finally:
        batch.close()
        ctx.close()
