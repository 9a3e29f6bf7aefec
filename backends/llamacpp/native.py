"""Owners of llama.cpp's native resources: model, context, batch, sampler.

Each class wraps one pointer, turns native failures into exceptions that carry the return
code, and frees it in an idempotent `close()`. The backend closes them in reverse order of
creation (samplers and batch, then context, then model) through an ExitStack.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

from edgeprefill.backends.llamacpp.first_chars import FirstChars
from edgeprefill.runtime.core.contract import SeqWork
from edgeprefill.runtime.core.request import SamplingParams

_GGML_LOG_ERROR, _GGML_LOG_CONT = 4, 5  # ggml.h; llama-cpp-python's own table predates them
# What llama.cpp logs as errors when an abort we asked for lands (ggml status 1, decode 2);
# not shown while an abort callback is armed.
_ABORTED = ("failed with error 1", "compute status: 1", "failed to decode, ret = 2")
# llama_get_logits returning the address as an int: llama-cpp-python's binding returns a
# ctypes pointer, and NumPy's view of one (`np.ctypeslib.as_array`) cost ~60 us a call on
# the caches a decode has just emptied. Its own function object, so the binding is untouched.
_get_logits = lc.llama_cpp._lib["llama_get_logits"]
_get_logits.argtypes = [lc.llama_context_p_ctypes]
_get_logits.restype = ctypes.c_void_p


class _LlamaLog:
    """llama.cpp's log, which is one per process (`llama_log_set` is global), and so is
    this: it initialises ggml once, shows a user only llama.cpp's errors (it logs every load
    and context detail, and warns about this model's `</s>` token), hides the errors an
    abort we asked for causes, and captures every message while asked to."""

    def __init__(self) -> None:
        self.initialised = False
        self.last_level = 0
        self.armed = 0  # contexts whose abort callback is armed
        self.captured: list[str] | None = None
        self.callback = lc.llama_log_callback(self._on_message)  # kept alive with this

    def init(self) -> None:
        if not self.initialised:
            lc.llama_log_set(self.callback, ctypes.c_void_p(0))
            lc.llama_backend_init()
            self.initialised = True

    def _on_message(self, level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level != _GGML_LOG_CONT:
            self.last_level = level
        message = text.decode(errors="replace")
        if self.captured is not None:
            self.captured.append(message)
        aborted = self.armed and any(a in message for a in _ABORTED)
        if self.last_level >= _GGML_LOG_ERROR and not aborted:
            sys.stderr.write(message)


_LOG = _LlamaLog()


def init_llama() -> None:
    """Initialise ggml once per process, logging errors only."""
    _LOG.init()


@contextmanager
def captured_log() -> Iterator[list[str]]:
    """llama.cpp's messages of every level while the block runs (what it reports only in
    its log, such as the sizes of the KV caches it allocates)."""
    _LOG.init()
    lines: list[str] = []
    _LOG.captured = lines
    try:
        yield lines
    finally:
        _LOG.captured = None


def ggml_build() -> str:
    """The version and commit of the ggml (llama.cpp's tensor library) llama-cpp-python
    built, which its own version does not say."""
    text = []
    for name in ("ggml_version", "ggml_commit"):
        fn = getattr(lc.llama_cpp._lib, name)  # from libggml-base, which libllama loads
        fn.restype = ctypes.c_char_p
        text.append(fn().decode())
    return "{} ({})".format(*text)


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_int8" in f.read()
    except OSError:
        return False


def release_openmp_threads() -> None:
    """End the OpenMP worker threads the calling thread's `llama_decode` calls started.

    llama.cpp built with OpenMP keeps a team of workers for each thread that ran a graph,
    until that thread ends. A team left idle on one thread (a probe run before the engine
    thread took over) makes libgomp count more threads than cores, and then every team's
    barriers sleep instead of spinning: on 2 cores each compute thread slept ~5,000 times a
    second and a one-row decode took 28-34 ms against 19 ms (benchmarks/history.md, section
    F). `omp_pause_resource_all` (OpenMP 5) releases the caller's team; without OpenMP, or
    on an older runtime, there is nothing to release."""
    path = _loaded_library(("libgomp.so", "libgomp-", "libomp.so", "libomp-"))
    if path is None:
        return
    try:
        ctypes.CDLL(path).omp_pause_resource_all(1)  # omp_pause_soft
    except (OSError, AttributeError):
        pass


def _loaded_library(prefixes: tuple[str, ...]) -> str | None:
    """The path of a shared library this process has loaded whose file name starts with one
    of `prefixes` (a wheel may carry its own renamed copy), from /proc/self/maps; None
    where there is none or no such file."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "/" in line})
    except OSError:
        return None
    return next((p for p in paths if Path(p).name.startswith(prefixes)), None)


class Native:
    """Owns one object llama.cpp allocated, at `ptr`; `close()` frees it with `free` once
    (a second call, or one after a failed allocation, does nothing)."""

    ptr: Any = None
    free: Any  # the llama.cpp function that frees `ptr`

    def close(self) -> None:
        if self.ptr:
            type(self).free(self.ptr)
            self.ptr = None


class LlamaModel(Native):
    """GGUF weights. `repack=None` repacks weights into llama.cpp's extra CPU buffer types
    except on CPUs with AMX, where the AMX Q4_K matmul segfaults on the first decode
    (ggml-org/llama.cpp#20824, seen here with llama-cpp-python 0.3.36)."""

    free = lc.llama_model_free

    def __init__(self, path: Path, repack: bool | None = None) -> None:
        init_llama()
        params = lc.llama_model_default_params()
        params.use_extra_bufts = (not cpu_has_amx()) if repack is None else repack
        self.repacked = bool(params.use_extra_bufts)
        self.ptr = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not load the model {path}")
        self.vocab = lc.llama_model_get_vocab(self.ptr)
        self.n_ctx_train = lc.llama_model_n_ctx_train(self.ptr)
        self.n_swa = lc.llama_model_n_swa(self.ptr)  # sliding window of SWA layers (0: none)

    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        lc.llama_model_desc(self.ptr, buf, len(buf))
        return buf.value.decode(errors="replace")

    def chat_template(self) -> bytes | None:
        return lc.llama_model_chat_template(self.ptr, None)


class LlamaContext(Native):
    """One context holding `n_seq_max` sequences of up to `n_ctx` cells each.

    By default every sequence has its own KV stream (`kv_unified=False`): a token then
    attends only over its own sequence's cells. In one shared pool (`kv_unified=True`) every
    token of a batch attends over every resident sequence's cells, masked; with documents
    resident that made mixed iterations about 1.5-2x slower on this model and CPU.
    """

    free = lc.llama_free

    def __init__(
        self,
        model: LlamaModel,
        *,
        n_ctx: int,
        n_batch: int,
        n_ubatch: int,
        n_seq_max: int,
        n_threads: int,
        kv_unified: bool = False,
        flash_attn: bool = False,
    ) -> None:
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx if kv_unified else n_ctx * n_seq_max
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.kv_unified = kv_unified
        # Keep only the sliding window in sliding-window layers (Gemma 3): a full-size SWA
        # cache makes every layer attend over every resident document (~20% slower here).
        params.swa_full = False
        # Whether flash attention is used, and the micro-batch size, change both speed and
        # which batch shapes give bit-identical logits: the device probe measures both.
        params.flash_attn_type = (
            lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.no_perf = True
        self.model = model  # held, as llama-cpp-python's context does: the weights outlive it
        self.ptr = lc.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise RuntimeError(
                f"llama.cpp could not create a context (n_ctx={n_ctx}, n_batch={n_batch}, "
                f"n_seq_max={n_seq_max}); try a smaller n_ctx"
            )
        self.memory = lc.llama_get_memory(self.ptr)
        # What the abort callback reads at every graph node while armed (and only then).
        self._abort_flag = threading.Event()
        self._armed = False
        self._abort_cb = lc.ggml_abort_callback(lambda _data: self._abort_flag.is_set())
        self.n_ctx = lc.llama_n_ctx(self.ptr)  # all sequences together
        self.n_ctx_seq = lc.llama_n_ctx_seq(self.ptr)
        self.n_vocab = lc.llama_vocab_n_tokens(model.vocab)
        self._logits_view: tuple[tuple[int, int], np.ndarray] | None = None

    def decode(self, batch: lc.llama_batch) -> int:
        """0 ok, 1 no KV slot, 2 aborted, < 0 error (llama.h)."""
        return lc.llama_decode(self.ptr, batch)

    def arm_abort(self, flag: threading.Event | None) -> None:
        """While armed, llama.cpp's CPU backend asks after every graph node whether to stop;
        the answer is the flag, read and nothing else (the callback holds the GIL for that
        moment, so it is armed only for iterations that may be aborted). An aborted
        `llama_decode` returns 2 and keeps the micro-batches that finished."""
        _LOG.armed += (flag is not None) - self._armed
        self._armed = flag is not None
        if flag is not None:
            self._abort_flag = flag
        callback = self._abort_cb if flag is not None else lc.ggml_abort_callback()
        lc.llama_set_abort_callback(self.ptr, callback, None)

    def logits(self, batch_index: int) -> np.ndarray:
        """A copy of the logits row computed for a batch index of the last decode."""
        row = lc.llama_get_logits_ith(self.ptr, batch_index)
        if not row:
            raise RuntimeError(f"no logits were computed for batch index {batch_index}")
        return np.ctypeslib.as_array(row, shape=(self.n_vocab,)).copy()

    def argmax_rows(self, n_rows: int) -> list[int]:
        """Greedy sampling without a sampler: the first highest logit of each of the last
        decode's `n_rows` output rows (in batch order), as llama.cpp's greedy sampler picks
        it, at a fraction of its host time (it copies the 262k-entry vocabulary into a
        candidate array per call). One NumPy call for all rows; the view of llama.cpp's
        output buffer is rebuilt only when llama.cpp moves or grows the buffer."""
        address = _get_logits(self.ptr)
        if not address:
            raise RuntimeError("no logits were computed by the last decode")
        key = (address, n_rows)
        if self._logits_view is None or self._logits_view[0] != key:
            buf = (ctypes.c_float * (n_rows * self.n_vocab)).from_address(address)
            rows = np.frombuffer(buf, dtype=np.float32).reshape(n_rows, self.n_vocab)
            self._logits_view = (key, rows)
        return self._logits_view[1].argmax(axis=1).tolist()

    def seq_rm(self, seq_id: int, from_pos: int = -1) -> None:
        """Drop a sequence's cells from `from_pos` on (-1: all of them)."""
        lc.llama_memory_seq_rm(self.memory, seq_id, from_pos, -1)

    def seq_pos_max(self, seq_id: int) -> int:
        """The highest position held for `seq_id`, or -1 when it holds no cells."""
        return lc.llama_memory_seq_pos_max(self.memory, seq_id)

    def seq_truncate(self, seq_id: int, n_tokens: int) -> int:
        """Cut a sequence back to its first `n_tokens` positions. Returns `n_tokens` where
        it then holds exactly them, 0 where it cannot (it is emptied): a sliding-window
        layer keeps only the window's last cells, so the next position attends to cells
        already overwritten unless the cut is near the sequence's end (the check
        llama-server makes before it reuses a slot's cache)."""
        self.seq_rm(seq_id, n_tokens)
        n_swa = self.model.n_swa
        # pos_min is the sliding-window cache's lowest position where there is one.
        lost = n_swa and lc.llama_memory_seq_pos_min(self.memory, seq_id) > max(0, n_tokens - n_swa)
        if n_tokens == 0 or lost or self.seq_pos_max(seq_id) != n_tokens - 1:
            self.seq_rm(seq_id)
            return 0
        return n_tokens

    def seq_state_size(self, seq_id: int) -> int:
        """Bytes `seq_state_read` needs for the sequence's KV cells (every layer)."""
        return lc.llama_state_seq_get_size(self.ptr, seq_id)

    def seq_state_read(self, seq_id: int, buf: np.ndarray) -> int:
        """Copy the sequence's state into `buf` (uint8); the bytes written, 0 on failure."""
        return lc.llama_state_seq_get_data(self.ptr, _bytes_ptr(buf), buf.nbytes, seq_id)

    def seq_state_write(self, seq_id: int, state: np.ndarray) -> int:
        """Put a state `seq_state_read` copied into the empty sequence `seq_id` of a context
        with the same model and KV layout; the bytes read, 0 where llama.cpp refused it."""
        return lc.llama_state_seq_set_data(self.ptr, _bytes_ptr(state), state.nbytes, seq_id)


def _bytes_ptr(a: np.ndarray) -> Any:
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


class LlamaBatch:
    """A reusable `llama_batch` of at most `size` tokens, filled in place every iteration:
    a chunk by slices, a decode's one token by single stores.

    Filled token by token, a 256-token chunk took ~240 us and a 2,048-token one ~2 ms of
    host time between device calls; by slices ~70 and ~270 (on the caches a decode has just
    emptied). The arrays are our own: each token's sequence id is read through a pointer,
    set once to its entry of `seq`. llama.cpp copies the batch in `llama_decode`.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        # Any: a ctypes array takes any sequence in a slice assignment (a range, bytes),
        # where typeshed's stubs accept only a list of its element type.
        self.token: Any = (lc.llama_token * size)()
        self.pos: Any = (lc.llama_pos * size)()
        self.n_seq_id = (ctypes.c_int32 * size)(*[1] * size)  # each token in one sequence
        self.seq: Any = (lc.llama_seq_id * size)()
        base, width = ctypes.addressof(self.seq), ctypes.sizeof(lc.llama_seq_id)
        self.seq_ptrs = (ctypes.c_void_p * size)(*[base + width * i for i in range(size)])
        self.logits: Any = (ctypes.c_int8 * size)()
        self.n_filled = 0
        # The batch from its first token, reused: most groups start there.
        self.struct = self._at(0)

    def fill(self, work: Sequence[SeqWork]) -> list[tuple[int, int]]:
        """Write every slice into the batch; logits only where a token is sampled.
        Returns (sequence id, batch index) for each slice that samples."""
        token, pos, seq, logits = self.token, self.pos, self.seq, self.logits
        i = 0
        outputs: list[tuple[int, int]] = []
        for w in work:
            n = len(w.tokens)
            if i + n > self.size:  # checked as it goes: no pass over the work before
                raise ValueError(f"batch of more than {self.size} tokens would abort llama.cpp")
            if n == 1:
                token[i], pos[i], seq[i], logits[i] = w.tokens[0], w.pos, w.seq_id, 0
            else:
                token[i : i + n] = w.tokens
                pos[i : i + n] = range(w.pos, w.pos + n)
                seq[i : i + n] = [w.seq_id] * n
                logits[i : i + n] = bytes(n)
            i += n
            if w.sample is not None:
                logits[i - 1] = 1
                outputs.append((w.seq_id, i - 1))
        self.n_filled = i
        return outputs

    def view(self, start: int, n_tokens: int) -> lc.llama_batch:
        """Tokens [start, start + n_tokens) of the filled batch, sharing its memory."""
        batch = self.struct if start == 0 else self._at(start)
        batch.n_tokens = n_tokens
        return batch

    def _at(self, start: int) -> lc.llama_batch:
        def at(arr: Any, ctype: Any) -> Any:
            address = ctypes.addressof(arr) + start * ctypes.sizeof(arr._type_)
            return ctypes.cast(address, ctypes.POINTER(ctype))

        return lc.llama_batch(
            n_tokens=0,
            token=at(self.token, lc.llama_token),
            embd=None,
            pos=at(self.pos, lc.llama_pos),
            n_seq_id=at(self.n_seq_id, ctypes.c_int32),
            seq_id=at(self.seq_ptrs, ctypes.POINTER(lc.llama_seq_id)),
            logits=at(self.logits, ctypes.c_int8),
        )

    def close(self) -> None:
        """Nothing native to free (Python owns the arrays): kept so every owner closes alike."""


class LlamaSampler(Native):
    """A sampler chain for one request, in llama.cpp's order (its server's defaults
    otherwise): logit bias, penalties over the output so far, the output's grammar, top-k,
    top-p, min-p, temperature, then the seeded draw (or greedy at temperature 0)."""

    free = lc.llama_sampler_free
    grammar: _GrammarCheck | None = None

    def __init__(
        self,
        params: SamplingParams,
        vocab: Any,
        grammar: str | None = None,
        first_chars: FirstChars | None = None,
    ) -> None:
        """`grammar`: GBNF the output must match (root rule `root`); `first_chars`: the
        vocabulary's, where read (the grammar then filters only the tokens they leave)."""
        n_vocab = lc.llama_vocab_n_tokens(vocab)
        if grammar is not None:
            self.grammar = _GrammarCheck(vocab, n_vocab, grammar, params.greedy, first_chars)
        self.ptr = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if params.logit_bias:
            biases = (lc.llama_logit_bias * len(params.logit_bias))(
                *(lc.llama_logit_bias(token, bias) for token, bias in params.logit_bias)
            )
            self._add(lc.llama_sampler_init_logit_bias(n_vocab, len(biases), biases))
        if params.penalized:
            penalties = (params.repeat_penalty, params.frequency_penalty, params.presence_penalty)
            # The last 64 tokens, as llama-server counts them by default (`--repeat-last-n`).
            self._add(lc.llama_sampler_init_penalties(n_vocab, 64, *penalties))
        if params.greedy:
            self._add(lc.llama_sampler_init_greedy())
            return
        if params.top_k:
            self._add(lc.llama_sampler_init_top_k(params.top_k))
        self._add(lc.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p:
            self._add(lc.llama_sampler_init_min_p(params.min_p, 1))
        self._add(lc.llama_sampler_init_temp(params.temperature))
        # llama.cpp's seed is 32 bits, and its all-ones value means "random".
        self._add(lc.llama_sampler_init_dist(params.seed % 0xFFFFFFFF))

    def _add(self, sampler: Any) -> None:
        lc.llama_sampler_chain_add(self.ptr, sampler)  # the chain owns it from here

    def sample(self, ctx: LlamaContext, batch_index: int) -> int:
        if self.grammar is not None:
            return self.grammar.sample(self.ptr, ctx, batch_index)
        return lc.llama_sampler_sample(self.ptr, ctx.ptr, batch_index)

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()
        super().close()


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


# Candidates a greedy sampler's grammar checks, likeliest first, where it rejected the
# likeliest token: a few hundred cover what a model asked for JSON considers, a few
# thousand most of what is left (a closing quote the model does not want yet); the grammar's
# time grows with the candidates it checks.
_BLOCKS = (256, 4096)


class _GrammarCheck(Native):
    """The output's grammar, applied as llama-server applies it: the chain samples from
    the raw logits, the grammar checks the one token drawn, and only a token it rejects
    has the grammar filter the vocabulary before the chain samples again: the grammar
    matches each of the 262k tokens' text, which filtering first made ~75 ms a token on a
    2-core Zen 3 (one run), and a model asked for JSON mostly writes what it allows.

    A greedy chain's token is the likeliest the grammar allows, so where the grammar
    rejected its first choice it checks the likeliest candidates (`_BLOCKS`), in order,
    and only filters the whole vocabulary where none of them passes: the same token,
    without the whole vocabulary's pass (that pass put a chat's P99 host time per
    iteration at 130 ms beside documents, and its P99 token gap at x1.6 of unconstrained
    chats', benchmarks/history.md section AL)."""

    free = lc.llama_sampler_free

    def __init__(
        self, vocab: Any, n_vocab: int, grammar: str, greedy: bool, first_chars: FirstChars | None
    ) -> None:
        self.ptr = lc.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if not self.ptr:
            raise ValueError("llama.cpp could not parse the output's grammar")
        self.n_vocab, self.greedy, self.first_chars = n_vocab, greedy, first_chars
        if first_chars is not None:
            self.probes = np.zeros(len(first_chars.probe_ids), _TOKEN_DATA)
            self.probes["id"] = first_chars.probe_ids
        self.one = np.zeros(1, _TOKEN_DATA)
        self._one = self._array(self.one)
        self.blocks = [np.zeros(min(n, n_vocab), _TOKEN_DATA) for n in _BLOCKS]

    @staticmethod
    @functools.cache
    def _scratch(n_vocab: int) -> tuple[np.ndarray, np.ndarray, Any]:
        """Token ids and a candidate array of the vocabulary's size (4 MB for 262k tokens),
        one for every sampler: they sample one at a time, on the engine thread."""
        candidates = np.zeros(n_vocab, _TOKEN_DATA)
        return np.arange(n_vocab, dtype=np.int32), candidates, _GrammarCheck._array(candidates)

    @staticmethod
    def _array(data: np.ndarray) -> Any:
        pointer = ctypes.cast(data.ctypes.data, lc.llama_token_data_p)
        return lc.llama_token_data_array(data=pointer, size=len(data), selected=-1, sorted=False)

    def sample(self, chain: Any, ctx: LlamaContext, batch_index: int) -> int:
        logits = lc.llama_get_logits_ith(ctx.ptr, batch_index)
        row = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
        token = self._draw(chain, row, constrained=False)
        if not self._allows(token):
            best = self._likeliest_allowed() if self.greedy else None
            token = self._draw(chain, row, constrained=True) if best is None else best
        lc.llama_sampler_accept(self.ptr, token)
        lc.llama_sampler_accept(chain, token)
        return token

    def _draw(self, chain: Any, row: np.ndarray, constrained: bool) -> int:
        """The chain's token from the row's logits (filtered by the grammar first)."""
        ids, data, array = self._scratch(self.n_vocab)
        data["id"], data["logit"], data["p"] = ids, row, 0.0
        array.size, array.selected, array.sorted = self.n_vocab, -1, False
        if constrained:
            self._filter(data, array)
        lc.llama_sampler_apply(chain, ctypes.byref(array))
        return int(array.data[array.selected].id)  # a sampler may have moved the data

    def _filter(self, data: np.ndarray, array: Any) -> None:
        """The grammar's filter over the vocabulary (`data`, in id order): over only the
        tokens whose first character it allows, where the first characters are known
        (`first_chars`: the same tokens left, for a fraction of the time)."""
        first_chars = self.first_chars
        if first_chars is None:
            lc.llama_sampler_apply(self.ptr, ctypes.byref(array))
            return
        probes = self.probes
        probes["logit"], probes["p"] = 0.0, 0.0
        lc.llama_sampler_apply(self.ptr, ctypes.byref(self._array(probes)))
        ids = first_chars.candidates(np.isfinite(probes["logit"]))
        kept = data[ids]
        lc.llama_sampler_apply(self.ptr, ctypes.byref(self._array(kept)))
        data["logit"] = -np.inf
        data["logit"][ids] = kept["logit"]

    def _likeliest_allowed(self) -> int | None:
        """Among the candidates the greedy chain just scored highest (its logit bias and
        penalties applied, in the scratch array), the first the grammar allows, in the
        greedy sampler's order (highest logit, then lowest id); None if none is."""
        _, data, _ = self._scratch(self.n_vocab)
        logits = data["logit"]
        for block in self.blocks:
            n = len(block)
            top = np.argpartition(-logits, n - 1)[:n] if n < len(logits) else np.arange(n)
            top = top[np.lexsort((data["id"][top], -logits[top]))]
            block["id"], block["logit"], block["p"] = data["id"][top], logits[top], 0.0
            lc.llama_sampler_apply(self.ptr, ctypes.byref(self._array(block)))
            allowed = np.flatnonzero(np.isfinite(block["logit"]))
            if len(allowed):
                return int(block["id"][allowed[0]])
        return None

    def _allows(self, token: int) -> bool:
        one, array = self.one, self._one
        one["id"], one["logit"], one["p"] = token, 1.0, 0.0
        array.size, array.selected, array.sorted = 1, -1, False
        lc.llama_sampler_apply(self.ptr, ctypes.byref(array))
        return bool(np.isfinite(one["logit"][0]))
