"""`--backend vllm`: the same policies inside vLLM's scheduler (a GPU, or vLLM's CPU build)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click

import edgeprefill.runtime.runner.devices.kind as kind
from edgeprefill.runtime.core.load import ExpectedLoad


@contextmanager
def open_vllm(o: kind.Options, load: ExpectedLoad | None) -> Iterator[kind.Opened]:
    from edgeprefill.backends.vllm.backend import VllmBackend, VllmSettings
    from edgeprefill.backends.vllm.model_folder import default_model_folder

    settings = VllmSettings(
        model=o["model"] if o["model"] is not None else default_model_folder(),
        n_ctx=o["n_ctx"],
        n_batch=o["n_batch"],
        n_seq_max=o["n_seq_max"],
        n_threads=o["threads"] or None,
        dtype=o["dtype"],
        tensor_parallel_size=o["tensor_parallel_size"],
        enforce_eager=o["enforce_eager"],
        kv_cache_gib=o["kv_cache_gib"],
        prefix_caching=o["kv_cache"],
    )
    with VllmBackend(settings) as backend:
        yield (lambda: backend), kind.device_profile(o["calibration"], backend)


VLLM = kind.DEVICES.register("vllm")(
    kind.DeviceKind(
        "vllm",
        "the same policies inside vLLM's scheduler (GPU, or its CPU build)",
        open_vllm,
        "vLLM backend",
        options=(
            kind.option(
                "--dtype",
                "auto",
                "weight and activation dtype",
                type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
            ),
            kind.option(
                "--tensor-parallel-size",
                1,
                "GPUs one model is split across",
                type=click.IntRange(min=1),
            ),
            kind.option(
                "--enforce-eager/--no-enforce-eager",
                False,
                "skip torch.compile and CUDA graphs (starts in seconds, iterations slower)",
            ),
            kind.option(
                "--kv-cache-gib",
                help="memory for the KV cache [default: vLLM's share of the device]",
                type=float,
            ),
        ),
        ignores={
            "max_background": "vLLM admits requests by its own KV-cache accounting",
            "foreground_kv": "vLLM admits requests by its own KV-cache accounting",
            "n_ubatch": "vLLM sizes its own kernels' batches",
            "kv_unified": "vLLM's KV cache is one pool of blocks",
        },
    )
)
