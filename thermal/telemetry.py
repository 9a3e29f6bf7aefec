"""What a run samples: the sensors of this machine, their settings, and the summary blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeprefill.thermal.battery import BatterySensor
from edgeprefill.thermal.cpu import CpuFrequencySensor, CpuLoadSensor, CpuTemperatureSensor
from edgeprefill.thermal.energy import IterationSpan, energy_summary, throttle_intervals
from edgeprefill.thermal.nvml import NvmlSensor
from edgeprefill.thermal.rapl import RaplSensor
from edgeprefill.thermal.sampler import DEFAULT_PERIOD_S, TelemetrySampler
from edgeprefill.thermal.sensor import Sensor


@dataclass(frozen=True)
class TelemetryConfig:
    period_s: float = DEFAULT_PERIOD_S
    tdp_w: float | None = None  # estimate CPU energy from load where nothing measures it
    root: Path = Path("/")  # where sysfs and procfs are found (tests: a fake tree)

    def __post_init__(self) -> None:
        if self.period_s <= 0:
            raise ValueError(f"telemetry period must be positive, got {self.period_s}")
        if self.tdp_w is not None and self.tdp_w <= 0:
            raise ValueError(f"TDP must be positive watts, got {self.tdp_w}")


def default_sensors(config: TelemetryConfig) -> list[Sensor]:
    """Every sensor this machine may have. CPU load only for a TDP estimate: psutil's
    /proc/stat read is the costliest sample (0.4 ms cold, most of a 1%-of-a-core budget)."""
    root = config.root
    sensors: list[Sensor] = [
        RaplSensor(root),
        CpuTemperatureSensor(root),
        CpuFrequencySensor(root),
        BatterySensor(root),
        NvmlSensor(),
    ]
    if config.tdp_w is not None:
        sensors.append(CpuLoadSensor())
    return sensors


def summarize(
    sampler: TelemetrySampler,
    config: TelemetryConfig,
    spans: Sequence[IterationSpan],
    requests: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """The `telemetry` and `energy` blocks of summary.json."""
    st = sampler.status
    reasons = {}
    if "rapl" in st and not st["rapl"].available:
        reasons["cpu"] = st["rapl"].reason or ""
        if config.tdp_w is None:
            reasons["cpu"] += "; pass --tdp-watts to estimate from CPU load"
    if "gpu" in st and not st["gpu"].available:
        reasons["gpu"] = st["gpu"].reason or ""
    return {
        "telemetry": {
            **sampler.describe(),
            "throttle_intervals": throttle_intervals(sampler.samples),
        },
        "energy": energy_summary(
            sampler.samples, spans, requests, tdp_w=config.tdp_w, reasons=reasons
        ),
    }
