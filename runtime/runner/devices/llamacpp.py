"""`--backend llamacpp` (the default): llama.cpp through llama-cpp-python's batch API."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.load import ExpectedLoad
from edgeprefill.runtime.runner.devices.kind import (
    DEVICES,
    DeviceKind,
    Opened,
    Options,
    device_profile,
    option,
)


class Size(click.ParamType[int | None]):
    """A size in bytes: 512MiB, 2GiB, 1.5G (binary units), or a plain number of bytes;
    with `auto`, also "auto" (None: the backend chooses)."""

    name = "SIZE"

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | None:
        if isinstance(value, int) or value is None:
            return value
        if self.auto and str(value).lower() == "auto":
            return None
        import humanfriendly

        try:
            return int(humanfriendly.parse_size(str(value), binary=True))
        except humanfriendly.InvalidSize:
            self.fail(f"{value!r} is not a size: write it as 512MiB, 2GiB or bytes", param, ctx)


@contextmanager
def open_llamacpp(o: Options, load: ExpectedLoad | None) -> Iterator[Opened]:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise UserError(
            "the llama.cpp backend needs llama-cpp-python, which is not installed: "
            "pip install 'edgeprefill[llamacpp]' (or use --backend sim)"
        ) from None
    from edgeprefill.backends.bundled_model import default_model_path
    from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
    from edgeprefill.backends.llamacpp.native import release_openmp_threads

    # A command's saved prefixes live in a folder of its own unless one is named, so one
    # run never starts from what another left (see RunOptions.fresh_kv_cache).
    kv_dir = o["kv_cache_dir"]
    scratch = None
    if o["kv_cache"] and kv_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix=f"kv-{os.getpid()}-", dir=_scratch_parent())
        kv_dir = Path(scratch.name)
    config = LlamaCppConfig(
        model=o["model"] if o["model"] is not None else default_model_path(),
        n_ctx=o["n_ctx"],
        n_batch=o["n_batch"],
        n_seq_max=o["n_seq_max"],
        n_threads=o["threads"],
        kv_unified=o["kv_unified"],
        batching=o["batching"],
        n_ubatch=o["n_ubatch"],
        flash_attn=o["flash_attn"],
        max_decode_group=o["max_decode_group"],
        refresh_probe=o["reprobe"],
        expected_load=load,
        kv_cache=o["kv_cache"],
        kv_cache_dir=kv_dir,
        kv_cache_ram=o["kv_cache_ram"],
        kv_cache_disk=o["kv_cache_disk"],
    )
    try:
        with LlamaCppBackend(config) as backend:
            profile = device_profile(o["calibration"], backend)
            release_openmp_threads()  # `serve` computes on its engine thread, not this one
            yield (lambda: backend), profile
    finally:
        if scratch is not None:
            scratch.cleanup()


def _scratch_parent() -> Path | None:
    """The user's KV cache folder (on disk, unlike a tmpfs /tmp); else the system's. The
    scratch folders of processes that died there (kill -9, power loss) are removed: they
    hold what documents said, up to the disk budget each."""
    import psutil

    from edgeprefill.backends.cache import kv_cache_dir

    folder = kv_cache_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    for stale in folder.glob("kv-*-*"):
        pid = stale.name.split("-")[1]
        if stale.is_dir() and pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return folder


LLAMACPP = DEVICES.register("llamacpp")(
    DeviceKind(
        "llamacpp",
        "llama.cpp, several sequences per llama_decode (CPUs)",
        open_llamacpp,
        "llama.cpp backend",
        options=(
            option(
                "--flash-attn/--no-flash-attn",
                help="llama.cpp's flash attention [default: the device probe's choice]",
            ),
            option(
                "--max-decode-group",
                help="most decode tokens in one llama_decode pass [default: exact batching: "
                "the largest group the device probe measured bit-identical; fast: all]",
                type=int,
            ),
            option(
                "--reprobe",
                False,
                "measure the device probe again instead of reading it from the cache",
                is_flag=True,
            ),
            option(
                "--kv-cache-dir",
                help="folder for saved KV states, kept across runs [default: one of this "
                "command's own, deleted at its end, each run starting empty]",
                type=click.Path(path_type=Path),
            ),
            option(
                "--kv-cache-ram",
                "auto",
                "memory for saved KV states (e.g. 512MiB, 2GiB; auto: a quarter of the memory "
                "available at start, at most 8GiB)",
                type=Size(auto=True),
            ),
            option(
                "--kv-cache-disk",
                "4GiB",
                "disk for saved KV states, least recently used deleted first",
                type=Size(),
            ),
        ),
    )
)
