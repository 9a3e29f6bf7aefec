"""`--backend vllm`: the same policies inside vLLM's scheduler (a GPU, or vLLM's CPU build)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click

from edgeprefill.runtime.core.work import ExpectedWork
from edgeprefill.runtime.runner.devices.kind import (
    DEVICES,
    DeviceKind,
    Opened,
    Options,
    device_profile,
)


@contextmanager
def open_vllm(o: Options, work: ExpectedWork | None) -> Iterator[Opened]:
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
        yield (lambda: backend), device_profile(o["calibration"], backend)


VLLM = DEVICES.register("vllm")(
    DeviceKind(
        "vllm",
        "the same policies inside vLLM's scheduler (GPU, or its CPU build)",
        open_vllm,
        "vLLM backend",
        options=(
            click.option(
                "--dtype",
                default="auto",
                show_default=True,
                help="weight and activation dtype (auto, float32, bfloat16, float16)",
            ),
            click.option(
                "--tensor-parallel-size",
                type=click.IntRange(min=1),
                default=1,
                show_default=True,
                help="GPUs one model is split across",
            ),
            click.option(
                "--enforce-eager/--no-enforce-eager",
                default=False,
                show_default=True,
                help="skip torch.compile and CUDA graphs (starts in seconds, steps slower)",
            ),
            click.option(
                "--kv-cache-gib",
                type=float,
                default=None,
                help="memory for the KV cache [default: vLLM's share of the device]",
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
