"""The CPU backend: one llama.cpp context, one batch per iteration, timed synchronously.

`llama_decode` is synchronous on the CPU, so `perf_counter` around it measures exactly the
completed forward pass (not the host's cadence, which is what made DLFP fail on GPUs).
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as lc

from edgeprefill.backends.cache import kv_cache_dir
from edgeprefill.backends.llamacpp.first_chars import FirstChars
from edgeprefill.backends.llamacpp.grammar import output_grammar
from edgeprefill.backends.llamacpp.logprobs import token_logprob
from edgeprefill.backends.llamacpp.memory import KvFootprint, check_fits
from edgeprefill.backends.llamacpp.model_file import check_model_file
from edgeprefill.backends.llamacpp.native import (
    LlamaBatch,
    LlamaContext,
    LlamaModel,
    LlamaSampler,
    ggml_build,
)
from edgeprefill.backends.llamacpp.prefix_cache import LlamaPrefixCache
from edgeprefill.backends.llamacpp.probe_cache import model_identity, probe
from edgeprefill.backends.llamacpp.shapes import Batching, Overrides, choose_settings
from edgeprefill.backends.llamacpp.state_store import StateStore, default_kv_ram
from edgeprefill.backends.llamacpp.swa_ring import SwaRing
from edgeprefill.backends.llamacpp.tokenizer import LlamaTokenizer
from edgeprefill.runtime.core.contract import (
    Backend,
    BackendError,
    Capacity,
    IterationResult,
    SeqWork,
)
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.load import ExpectedLoad
from edgeprefill.runtime.core.request import OutputFormat, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)
_SEQ_ID = operator.attrgetter("seq_id")
LLAMA_MAX_SEQ = 256  # llama.h: sequences one context can hold


def default_threads() -> int:
    """Physical cores: llama.cpp slows down on hyper-threads."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@dataclass(frozen=True)
class LlamaCppConfig:
    model: Path
    n_ctx: int = 16384  # KV cells per sequence; at most the model's trained context
    n_batch: int = 2048  # llama-server's default: the most tokens one iteration can hold
    n_seq_max: int = 16  # half may be background: chats keep 8 even while documents are read
    n_threads: int = 0  # 0: physical cores
    kv_unified: bool = False  # one pool of n_ctx cells shared by all sequences
    # exact: only batch shapes the device probe found bit-identical to decoding each
    # sequence alone (paired comparisons need it); fast: the fastest shapes it found;
    # auto: exact where that costs under 3% on this CPU, else fast.
    batching: Batching = "auto"
    # Each of these replaces what the probe would choose (None: the probe's choice).
    n_ubatch: int | None = None
    flash_attn: bool | None = None
    max_decode_group: int | None = None
    probe_cache: Path | None = None  # None: the user's cache folder
    # The run's expected work: flash attention and n_ubatch are chosen fastest for it
    # (None: for prefill, deep chunks and decodes alike, e.g. an assistant not yet used).
    expected_load: ExpectedLoad | None = None
    # Saved prompt prefixes (documents the indexer read, reused by questions about them):
    # in memory up to kv_cache_ram bytes, then in kv_cache_dir (None: the user's cache
    # folder) up to kv_cache_disk bytes. kv_cache False: every prompt is computed.
    kv_cache: bool = True
    kv_cache_dir: Path | None = None
    kv_cache_ram: int | None = None  # None: a quarter of the memory available, at most 8 GiB
    kv_cache_disk: int = 4 << 30
    refresh_probe: bool = False  # measure again even when a cached result exists

    def __post_init__(self) -> None:
        checks = [
            (self.n_ctx >= 1, f"`n_ctx` must be at least 1, got {self.n_ctx}"),
            (self.n_batch >= 1, f"`n_batch` must be at least 1, got {self.n_batch}"),
            (
                self.n_ubatch is None or 1 <= self.n_ubatch <= self.n_batch,
                f"`n_ubatch` must be between 1 and `n_batch` ({self.n_batch}), got {self.n_ubatch}",
            ),
            (
                self.max_decode_group is None or self.max_decode_group >= 1,
                f"`max_decode_group` must be at least 1, got {self.max_decode_group}",
            ),
            (
                self.batching in ("auto", "exact", "fast"),
                f"batching must be auto, exact or fast, got {self.batching!r}",
            ),
            (
                1 <= self.n_seq_max <= min(LLAMA_MAX_SEQ, self.n_batch),
                f"`n_seq_max` must be between 1 and {min(LLAMA_MAX_SEQ, self.n_batch)}, "
                f"got {self.n_seq_max}",
            ),
            (self.n_threads >= 0, f"`n_threads` must not be negative, got {self.n_threads}"),
            (
                min(self.kv_cache_ram or 0, self.kv_cache_disk) >= 0,
                "`kv_cache_ram` and `kv_cache_disk` must not be negative",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)

    @property
    def overrides(self) -> Overrides:
        return Overrides(self.flash_attn, self.n_ubatch, self.max_decode_group)


class LlamaCppBackend(Backend):
    name = "llamacpp"

    def __init__(self, config: LlamaCppConfig) -> None:
        self.config = config
        path = check_model_file(config.model)
        self._stack = ExitStack()
        self._samplers: dict[int, LlamaSampler] = {}
        self._parsed_formats: set[OutputFormat] = set()
        self._first_chars: FirstChars | None = None  # read at the first output format
        try:
            self.model = self._stack.enter_context(closing(self._load(path)))
            self.n_threads = config.n_threads or default_threads()
            footprint = KvFootprint.measure(self.model)
            if footprint is None:
                log.warning("llama.cpp did not report its KV cache size: memory is not checked")
            # before the probe (a minute on a first run) at the smallest micro-batch, then
            # exactly at the one it chooses
            self._check_memory(footprint, config.n_ubatch or 1, config.n_ubatch or config.n_batch)
            self.probe = probe(
                self.model,
                path,
                n_threads=self.n_threads,
                kv_unified=config.kv_unified,
                refresh=config.refresh_probe,
                folder=config.probe_cache,
            )
            self.settings = choose_settings(
                self.probe.facts,
                config.batching,
                n_seq_max=config.n_seq_max,
                n_batch=config.n_batch,
                overrides=config.overrides,
                load=config.expected_load,
            )
            self._check_memory(footprint, self.settings.n_ubatch)
            self.ctx = self._stack.enter_context(closing(self._context()))
            self.ring = SwaRing.of(
                self.model.n_swa, self.ctx.n_ctx_seq, self.settings.n_ubatch, config.kv_unified
            )
            self.batch = self._stack.enter_context(closing(LlamaBatch(config.n_batch)))
            self._stack.callback(self._close_samplers)
            if config.kv_cache:
                self.prefix_cache = self._stack.enter_context(closing(self._prefix_cache(path)))
        except BaseException:
            self._stack.close()
            raise
        self.capacity = Capacity(
            n_batch=config.n_batch,
            n_ctx=self.ctx.n_ctx,
            n_seq_max=config.n_seq_max,
            n_ctx_seq=self.ctx.n_ctx_seq,
            min_chunk=self.settings.min_chunk,
            max_chunk=self.settings.max_chunk,
            chunk_quantum=self.settings.chunk_quantum,
        )
        self.tokenizer = LlamaTokenizer(self.model)

    supports_abort = True
    prefix_cache: LlamaPrefixCache | None = None

    def _load(self, path: Path) -> LlamaModel:
        try:
            model = LlamaModel(path)
        except RuntimeError:
            raise UserError(
                f"llama.cpp could not load {path}: the GGUF file is damaged or its "
                "architecture is not supported by this llama.cpp"
            ) from None
        n_ctx = self.config.n_ctx
        if n_ctx > model.n_ctx_train:
            model.close()
            raise UserError(
                f"`n_ctx` {n_ctx} exceeds the model's trained context "
                f"({model.n_ctx_train}); use `n_ctx` {model.n_ctx_train} or less"
            )
        return model

    def _check_memory(
        self, footprint: KvFootprint | None, n_ubatch: int, largest_ubatch: int | None = None
    ) -> None:
        if footprint is None:
            return
        c = self.config
        check_fits(
            footprint,
            c.n_ctx,
            c.n_seq_max,
            n_ubatch,
            self.model.n_swa,
            c.kv_unified,
            largest_ubatch,
        )

    def _context(self) -> LlamaContext:
        c = self.config
        return LlamaContext(
            self.model,
            n_ctx=c.n_ctx,
            n_batch=c.n_batch,
            n_ubatch=self.settings.n_ubatch,
            n_seq_max=c.n_seq_max,
            n_threads=self.n_threads,
            kv_unified=c.kv_unified,
            flash_attn=self.settings.flash_attn,
        )

    def _prefix_cache(self, path: Path) -> LlamaPrefixCache:
        c = self.config
        store = StateStore(
            self._kv_identity(path),
            ram_bytes=default_kv_ram() if c.kv_cache_ram is None else c.kv_cache_ram,
            disk_bytes=c.kv_cache_disk,
            folder=c.kv_cache_dir or kv_cache_dir(),
        )
        return LlamaPrefixCache(self.ctx, store)

    def _kv_identity(self, path: Path) -> dict[str, Any]:
        """What a saved state is valid for: the model file, the llama.cpp build, the KV
        layout, and the batch shapes it was computed with (an exact run reuses only states
        computed with the shapes its probe found bit-identical)."""
        s = self.settings
        return {
            "model": model_identity(self.model, path),
            "llama_cpp": lc.__version__,
            "flash_attn": s.flash_attn,
            "kv_unified": self.config.kv_unified,
            "swa_full": False,
            "exact": s.exact,
            "pieces": [s.min_chunk, s.chunk_quantum] if s.exact else None,
        }

    def execute(
        self, work: Sequence[SeqWork], abort: threading.Event | None = None
    ) -> IterationResult:
        """One batch, decoded as groups: the decode tokens (in exact batching at most the
        probe's largest bit-identical group to a pass), then one group per prompt chunk.

        With a KV stream per sequence llama.cpp splits a batch into runs of consecutive
        sequence ids with equal token counts, which would compute a chunk's first token
        beside the decodes, alone, deep in its context: a one-row piece, computed by other
        kernels than the same token in its chunk. The groups are the ubatches llama.cpp
        would have run anyway, plus the passes that splitting decode groups adds.

        With an `abort` flag, read before each chunk and, while one computes, after every
        graph node (see `_chunk`)."""
        # Plain loops, no sort for one decode: this runs between two device calls, where
        # a chat's next token waits (~15 us less than a sort by a lambda and a flattening).
        decodes = [w for w in work if w.is_decode]
        chunks = [w for w in work if not w.is_decode] if len(decodes) < len(work) else []
        if len(decodes) > 1:
            decodes.sort(key=_SEQ_ID)
        step = self.settings.max_decode_group or len(decodes) or 1
        groups = [decodes[i : i + step] for i in range(0, len(decodes), step)]
        self.batch.fill(decodes + chunks if chunks else decodes)
        for w in chunks:
            self.ring.placed(w.seq_id, w.pos)
        result = IterationResult(0.0, {})
        start = 0
        for group in groups:
            result.duration_s += self._decode(start, len(group))
            self._sample(group, result)
            start += len(group)
        try:
            for w in chunks:
                spent, last_row = self._chunk(w, start, abort)
                result.duration_s += spent
                if last_row is None:  # the decodes are done and sampled: stop here
                    result.kept = self._kept(chunks)
                    return result
                if w.sample is not None:  # a chunk at its prompt's end
                    self._sample([w], result, last_row)
                start += len(w.tokens)
        finally:
            if abort is not None:
                self.ctx.arm_abort(None)
        return result

    def _decode(self, start: int, n: int) -> float:
        t0 = time.perf_counter()
        rc = self.ctx.decode(self.batch.view(start, n))
        spent = time.perf_counter() - t0
        self._check(rc)
        return spent

    def _chunk(
        self, w: SeqWork, start: int, abort: threading.Event | None
    ) -> tuple[float, int | None]:
        """Decode a prompt chunk: (seconds, its last row's index in the last call), or
        (seconds, None) where the abort stopped it. With an abort flag it goes in
        micro-batches (`_pieces`), each stopped mid-graph only where its
        rollback is exact and leaves the sequence's earlier cells in place (`SwaRing`): a
        stopped micro-batch that wrapped the sliding-window ring had already given up cells
        the retry needs, and the sequence's next pass failed (`llama_decode` -1: its cells
        ended before its computed prompt). Another micro-batch finishes first."""
        spent = 0.0
        for off, m in self._pieces(w, abort is not None):
            if abort is not None:
                if abort.is_set():
                    return spent, None
                stoppable = self.ring.abortable(w.seq_id, w.pos + off, m)
                self.ctx.arm_abort(abort if stoppable else None)
            t0 = time.perf_counter()
            rc = self.ctx.decode(self.batch.view(start + off, m))
            spent += time.perf_counter() - t0
            if rc == 2 and abort is not None:
                return spent, None
            self._check(rc)
        return spent, m - 1

    def _pieces(self, w: SeqWork, stoppable: bool) -> list[tuple[int, int]]:
        """(offset, tokens) of each pass of a prompt chunk: the whole chunk (llama.cpp
        splits it), or with an abort flag its micro-batches. In fast batching those end
        where the ring turns too, so none wraps and each may stop mid-graph (a
        sequence computed from position 0 in its own KV stream): one that wrapped ran whole,
        and a chat arriving in it waited 402 ms (a 128-token micro-batch deep in a document,
        a 2-core Zen 3, 7 Dec 2026). Exact batching keeps llama.cpp's own split, the shapes
        the probe measured."""
        n, size = len(w.tokens), self.settings.n_ubatch
        if not stoppable:
            return [(0, n)]
        if self.settings.exact or not self.ring.known(w.seq_id):  # no cut can make it stop
            return [(off, min(size, n - off)) for off in range(0, n, size)]
        pieces, off = [], 0
        while off < n:
            m = min(size, n - off, self.ring.room(w.pos + off))
            pieces.append((off, m))
            off += m
        return pieces

    def _kept(self, chunks: list[SeqWork]) -> dict[int, int]:
        """Prompt tokens of each chunk in the KV cache after an abort: llama.cpp keeps the
        micro-batches that finished and removes the cells of the one it stopped in."""
        return {w.seq_id: max(self.ctx.seq_pos_max(w.seq_id) + 1 - w.pos, 0) for w in chunks}

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            what = {1: "no KV slot for the batch", 2: "aborted"}.get(rc, "error")
            raise BackendError(f"llama_decode returned {rc} ({what})")

    def _sample(self, group: list[SeqWork], result: IterationResult, last_row: int = 0) -> None:
        """The tokens of a group that samples every row it computed: decodes (one token
        each), or a prompt chunk that ends its prompt. Greedy rows are read from the decode's
        outputs together, the others each by its own sampler. One row, the usual case, takes
        no loop and no list: the call's host time for a chat's decode alone went ~165 to
        ~145 us (medians of 200 alternated calls), time its next token waits for."""
        ctx, sampled = self.ctx, result.sampled
        if len(group) == 1:
            w = group[0]
            s = w.sample
            assert s is not None
            if s.argmax:
                sampled[w.seq_id] = ctx.argmax_rows(1)[0]
            else:
                sampled[w.seq_id] = self._sampler(w.seq_id, s).sample(ctx, last_row)
            if s.logprobs is not None:
                result.logprobs[w.seq_id] = self._logprob(w, sampled, last_row)
            return
        greedy = (
            ctx.argmax_rows(len(group)) if any(w.sample and w.sample.argmax for w in group) else []
        )
        for row, w in enumerate(group):  # decodes, one row each
            s = w.sample
            assert s is not None
            sampled[w.seq_id] = (
                greedy[row] if s.argmax else self._sampler(w.seq_id, s).sample(ctx, row)
            )
            if s.logprobs is not None:
                result.logprobs[w.seq_id] = self._logprob(w, sampled, row)

    def _logprob(self, w: SeqWork, sampled: dict[int, int], row: int) -> TokenLogprob:
        assert w.sample is not None and w.sample.logprobs is not None
        return token_logprob(self.ctx.logits(row), sampled[w.seq_id], w.sample.logprobs)

    def _sampler(self, seq_id: int, params: SamplingParams) -> LlamaSampler:
        """The sequence's sampler, created at its first token (it keeps the RNG state)."""
        sampler = self._samplers.get(seq_id)
        if sampler is None:
            fmt = params.output_format
            grammar = None if fmt is None else output_grammar(fmt)
            sampler = LlamaSampler(params, self.model.vocab, grammar, self._first_chars)
            self._samplers[seq_id] = sampler
        return sampler

    def check_sampling(self, sampling: SamplingParams) -> None:
        """An output format's grammar is converted and parsed by llama.cpp here, once for
        the last few hundred formats (a converted grammar is kept for the request's own
        sampler), so a format that cannot be enforced fails its request up front."""
        fmt = sampling.output_format
        if fmt is None or fmt in self._parsed_formats:
            return
        if self._first_chars is None:  # read here, off the engine thread, once
            vocab = self.model.vocab
            self._first_chars = FirstChars(vocab, lc.llama_vocab_n_tokens(vocab))
        LlamaSampler(sampling, self.model.vocab, output_grammar(fmt)).close()
        if len(self._parsed_formats) >= 256:
            self._parsed_formats.clear()
        self._parsed_formats.add(fmt)

    def release(self, seq_id: int) -> None:
        self.ctx.seq_rm(seq_id)
        self._forget(seq_id)

    keeps_sequences = True

    def park(self, seq_id: int) -> None:
        sampler = self._samplers.pop(seq_id, None)
        if sampler is not None:
            sampler.close()

    def reuse(self, seq_id: int, n_tokens: int) -> int:
        """A parked sequence for a new request (see `Backend.reuse`). Its ring is no longer
        known from position 0, so its micro-batches finish rather than stop mid-graph."""
        self.ring.released(seq_id)
        return self.ctx.seq_truncate(seq_id, n_tokens)

    def _forget(self, seq_id: int) -> None:
        self.ring.released(seq_id)
        self.park(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Highest KV position held by a sequence; -1 once it is released."""
        return self.ctx.seq_pos_max(seq_id)

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "name": self.name,
            "model": str(c.model),
            "model_description": self.model.description(),
            "n_ctx": self.capacity.n_ctx,
            "n_ctx_seq": self.capacity.n_ctx_seq,
            "llama_cpp": lc.__version__,
            "ggml": ggml_build(),
            "n_ctx_train": self.model.n_ctx_train,
            "n_batch": c.n_batch,
            "n_ubatch": self.settings.n_ubatch,
            "n_seq_max": c.n_seq_max,
            "min_chunk": self.capacity.min_chunk,
            "chunk_quantum": self.capacity.chunk_quantum,
            "n_threads": self.n_threads,
            # libgomp's spin before a waiting compute thread sleeps (None: its default)
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            "kv_unified": c.kv_unified,
            "swa_full": False,
            "preemption": self.ring.describe(),
            "weights_repacked": self.model.repacked,
            "clock": "perf_counter",  # around the synchronous llama_decode
            "batching": self.settings.describe(),
            "expected_load": c.expected_load and c.expected_load.describe(),
            "probe": self.probe.describe(),
        }

    def _close_samplers(self) -> None:
        for sampler in self._samplers.values():
            sampler.close()
        self._samplers.clear()

    def close(self) -> None:
        self._stack.close()
