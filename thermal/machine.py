"""What device a run ran on, so results from laptops and servers can be told apart."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import psutil

# Vector extensions that change which kernels llama.cpp runs (and how fast): results from
# an AVX2-only CPU and an AVX-512 one do not compare.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def cpu_isa(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """Which of ISA_FLAGS the CPU has (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return [f for f in ISA_FLAGS if f in flags]


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names(root: Path = Path("/proc/driver/nvidia/gpus")) -> list[str]:
    """NVIDIA GPUs as the kernel driver lists them; empty where there is none."""
    names = []
    for info in sorted(root.glob("*/information")):
        for line in info.read_text().splitlines():
            if line.startswith("Model:"):
                names.append(line.split(":", 1)[1].strip())
    return names


def describe_machine() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "cpu_isa": cpu_isa(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "gpus": gpu_names(),
    }
