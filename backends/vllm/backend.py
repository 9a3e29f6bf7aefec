"""Opening vLLM for a run: settings, the engine with the edgeprefill scheduler and timed
worker, the model's tokenizer, and the facts summary.json records."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from edgeprefill.backends.vllm.check import require_vllm
from edgeprefill.backends.vllm.engine import VllmEngine
from edgeprefill.backends.vllm.iterations import TIMED_WORKERS
from edgeprefill.backends.vllm.probe import probe_timings
from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.contract import Capacity
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.plan import IterationTiming
from edgeprefill.runtime.core.request import SamplingParams
from edgeprefill.runtime.core.resource import Closeable

SCHEDULERS = {
    False: "edgeprefill.backends.vllm.scheduler.EdgeprefillScheduler",
    True: "edgeprefill.backends.vllm.scheduler.EdgeprefillAsyncScheduler",
}


@dataclass(frozen=True)
class VllmSettings:
    model: Path  # a Hugging Face model folder
    n_ctx: int = 4096  # max_model_len: the longest sequence
    n_batch: int = 2048  # max_num_batched_tokens: the most tokens in one step
    n_seq_max: int = 16  # max_num_seqs (as the llama.cpp backend)
    n_threads: int | None = None  # torch threads on the CPU build (None: every core)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # `--dtype`'s choices
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # skip torch.compile / CUDA graphs (fast start, slower steps)
    kv_cache_gib: float | None = None  # None: vLLM's default share of the device memory
    # vLLM's automatic prefix caching: a prompt that starts with blocks still cached (a
    # conversation's earlier turn, a document the indexer read) computes only the rest;
    # hits are reported per request (`prefix_reused_tokens`, `cached_tokens`).
    prefix_caching: bool = True
    seed: int = 0


def _first_error(e: Exception) -> str:
    """The first of a pydantic validation's errors (which field, what was wrong), else the
    message's first line."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        return (
            f"{'.'.join(map(str, first['loc'])) or 'value'} {first.get('input')!r}: {first['msg']}"
        )
    return str(e).splitlines()[0]


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _check_memory(settings: VllmSettings, on_gpu: bool) -> None:
    """Refuse a `--kv-cache-gib` that cannot fit beside the weights before vLLM allocates
    it: on a CPU it would be OOM-killed, not refused. Without it vLLM sizes the cache from
    the memory it finds itself."""
    if settings.kv_cache_gib is None:
        return
    weights = sum(
        f.stat().st_size for f in settings.model.iterdir() if f.suffix in (".safetensors", ".bin")
    )
    if on_gpu:
        import torch

        available, where = torch.cuda.mem_get_info()[0] * settings.tensor_parallel_size, "GPU"
    else:
        import psutil

        available, where = psutil.virtual_memory().available, "system"
    need = settings.kv_cache_gib * 2**30 + weights
    if need > available:
        fits = max((available - weights) / 2**30, 0)
        raise UserError(
            f"--kv-cache-gib {settings.kv_cache_gib:g} plus the weights ({weights / 2**30:.1f} "
            f"GiB) needs {need / 2**30:.1f} GiB but {available / 2**30:.1f} GiB of {where} "
            f"memory is available: use --kv-cache-gib {fits:.1f} or less"
        )


def _set_threads(n_threads: int | None) -> None:
    """An in-process engine core (the driver reads the scheduler's step records directly),
    offline, with the threads asked for: vLLM's CPU build cuts torch to one thread unless
    OMP_NUM_THREADS is set (fp32 decoding was 10x slower with one thread on a 2-core CPU)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder; never the hub
    threads = n_threads or os.cpu_count() or 1
    if n_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _engine_config(settings: VllmSettings, on_gpu: bool) -> Any:
    """vLLM's engine config for `settings`, with edgeprefill's scheduler and timed worker."""
    from vllm import EngineArgs

    args = EngineArgs(
        model=str(settings.model),
        # Prompts are token ids, built by the runtime, and outputs are not detokenized,
        # but structured outputs compile a format's grammar over the tokenizer's vocabulary.
        skip_tokenizer_init=False,
        max_model_len=settings.n_ctx,
        max_num_batched_tokens=settings.n_batch,
        max_num_seqs=settings.n_seq_max,
        enable_chunked_prefill=True,
        enable_prefix_caching=settings.prefix_caching,
        scheduling_policy="priority",
        dtype=settings.dtype,
        seed=settings.seed,
        tensor_parallel_size=settings.tensor_parallel_size,
        enforce_eager=settings.enforce_eager,
        kv_cache_memory_bytes=(
            None if settings.kv_cache_gib is None else int(settings.kv_cache_gib * 2**30)
        ),
        gpu_memory_utilization=0.9 if on_gpu else 0.3,
        disable_log_stats=True,
    )
    try:
        config = args.create_engine_config()
    except (ValueError, TypeError) as e:
        raise UserError(f"vLLM rejected the settings: {_first_error(e)}") from None
    sched = config.scheduler_config
    sched.scheduler_cls = SCHEDULERS[bool(sched.async_scheduling)]
    worker = config.parallel_config.worker_cls
    if worker not in TIMED_WORKERS:
        raise UserError(
            f"vLLM chose worker {worker}, which edgeprefill cannot time; supported: "
            f"{', '.join(TIMED_WORKERS)}"
        )
    config.parallel_config.worker_cls = TIMED_WORKERS[worker]
    return config


class VllmBackend(Closeable):
    """An open vLLM engine (in this process, so the driver reaches its scheduler). One
    backend serves several runs in turn (`compare`, `sweep`), each with its own policy."""

    name = "vllm"
    clock = None

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Everything is vLLM's to sample (its structured outputs enforce a format); what
        it refuses fails the request with vLLM's reason."""

    def __init__(self, settings: VllmSettings) -> None:
        # vLLM logs pages at INFO, some before its logging is set up; the run prints its own
        # summary. VLLM_LOGGING_LEVEL set by the user wins.
        level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        logging.getLogger("vllm").setLevel(level.upper())
        self.version = require_vllm()
        if not (settings.model / "config.json").is_file():
            raise UserError(
                f"--model {settings.model}: not a Hugging Face model folder (no config.json); "
                "vLLM 0.32 cannot load a GGUF file, see README 'vLLM'"
            )
        on_gpu = _cuda_available()
        if settings.tensor_parallel_size > 1 and not on_gpu:
            raise UserError(
                f"--tensor-parallel-size {settings.tensor_parallel_size} needs NVIDIA GPUs "
                "here and none is visible: drop it, or run vLLM's own server with "
                "edgeprefill's scheduler (README, 'Serving it')"
            )
        _check_memory(settings, on_gpu)
        self.settings = settings
        _set_threads(settings.n_threads)
        from vllm.v1.engine.llm_engine import LLMEngine

        from edgeprefill.backends.vllm.tokenizer import HFTokenizer

        self.tokenizer = HFTokenizer(settings.model)
        config = _engine_config(settings, on_gpu)
        sched = config.scheduler_config
        self.async_scheduling = bool(sched.async_scheduling)
        self.dtype = str(config.model_config.dtype).removeprefix("torch.")
        self.device = "cuda" if on_gpu else "cpu"
        self.llm = LLMEngine.from_vllm_config(config, disable_log_stats=True)
        # In-process (multiprocessing off, above): the client is vLLM's InprocClient, which
        # holds the EngineCore; its declared type, the client base class, does not.
        self.scheduler = self.llm.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
        self.timer_clock = self.llm.collective_rpc("edgeprefill_clock")[0]
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.prefix_cache = _VllmPrefixCaching(self.llm) if settings.prefix_caching else None
        self._closed = False

    @property
    def capacity(self) -> Capacity:
        """What a server admits by: vLLM's own step and sequence limits."""
        s = self.settings
        n_batch = self.max_num_batched_tokens
        return Capacity(n_batch, s.n_ctx * s.n_seq_max, s.n_seq_max, s.n_ctx, max_chunk=n_batch)

    def engine(self, policy: BudgetPolicy, **options: Any) -> VllmEngine:
        """A driver for one run, with `policy` installed in vLLM's scheduler (`options`:
        `VllmEngine`'s guard, clock and device profile)."""
        return VllmEngine(
            self.llm, self.scheduler, policy, self.tokenizer.eog_ids, self.settings.n_ctx, **options
        )

    def probe_timings(self, seed: int = 0) -> list[IterationTiming]:
        return probe_timings(self, seed)

    def describe(self) -> dict[str, Any]:
        s = self.settings
        return {
            "name": "vllm",
            "vllm_version": self.version,
            "model": str(s.model),
            "device": self.device,
            "clock": self.timer_clock,
            "scheduler": type(self.scheduler).__name__,
            "async_scheduling": self.async_scheduling,
            "dtype": self.dtype,
            "max_model_len": s.n_ctx,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "n_batch": self.max_num_batched_tokens,  # the runtime's name, for calibrate
            "max_num_seqs": s.n_seq_max,
            "tensor_parallel_size": s.tensor_parallel_size,
            "threads": os.environ.get("OMP_NUM_THREADS"),
            "enforce_eager": s.enforce_eager,
            "prefix_caching": s.prefix_caching,
            # Nothing measures vLLM's kernels for batch invariance, so `compare` reports how
            # often outputs agree across policies rather than expecting them equal.
            "batching": {
                "mode": "vllm",
                "exact": False,
                "reason": "vLLM's kernels are not measured for batch invariance",
            },
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.llm.engine_core.shutdown()


class _VllmPrefixCaching:
    """vLLM keeps prefixes itself (in the KV blocks it has not reused yet); a run can only
    start it empty."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def clear(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running)")

    def flush(self) -> None:
        """Nothing to write: vLLM's blocks live in device memory only."""

    def describe(self) -> dict[str, Any]:
        return {"kind": "vLLM automatic prefix caching (GPU/CPU KV blocks while they last)"}
