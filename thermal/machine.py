"""What device a run ran on, so results from laptops and servers can be told apart."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import psutil


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
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "gpus": gpu_names(),
    }
