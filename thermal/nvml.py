"""NVIDIA GPUs through NVML (nvidia-ml-py, `import pynvml`).

Per GPU: temperature, power (instant and averaged), energy, SM and memory clocks and the
clock-event (throttle) reasons. Energy comes from the total-energy counter where the GPU has
one (Volta and newer, `nvml_energy`); elsewhere power is integrated over the samples and
labelled `nvml_power_integrated`. The pynvml calls are the whole seam: tests replace them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pynvml

from edgeprefill.thermal.sensor import Sensor, SensorStatus

# Clock-event reasons (nvmlClocksEventReason*): the bits that mean the GPU was held back.
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
THROTTLING = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
THERMAL = 0x20 | 0x40


def decode_reasons(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit]


@dataclass
class _Gpu:
    index: int
    name: str
    handle: Any
    energy_counter: bool
    first_mj: int = 0
    integrated_j: float = 0.0
    last: tuple[float, float] | None = None  # (t_s, watts) of the previous sample


class NvmlSensor(Sensor):
    name = "gpu"

    def __init__(self) -> None:
        self._gpus: list[_Gpu] = []
        self._initialised = False

    def open(self) -> SensorStatus:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            return SensorStatus.unavailable(f"NVML cannot start: {e} (no NVIDIA driver)")
        self._initialised = True
        try:
            count = pynvml.nvmlDeviceGetCount()
            for i in range(count):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                try:
                    first = pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
                    self._gpus.append(_Gpu(i, str(name), h, True, first))
                except pynvml.NVMLError:  # older than Volta: integrate power instead
                    self._gpus.append(_Gpu(i, str(name), h, False))
        except pynvml.NVMLError as e:
            self.close()
            return SensorStatus.unavailable(f"NVML cannot list GPUs: {e}")
        if not self._gpus:
            self.close()
            return SensorStatus.unavailable("NVML found no NVIDIA GPU")
        sources = (f"gpu{g.index}:{self._energy_source(g)} ({g.name})" for g in self._gpus)
        return SensorStatus(True, ",".join(sources))

    @staticmethod
    def _energy_source(gpu: _Gpu) -> str:
        return "nvml_energy" if gpu.energy_counter else "nvml_power_integrated"

    def _power(self, gpu: _Gpu) -> tuple[float | None, float]:
        """(instant, averaged) watts; instant where the driver has the field (Ampere+)."""
        fields = [pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_FI_DEV_POWER_AVERAGE]
        instant = average = None
        try:
            values = pynvml.nvmlDeviceGetFieldValues(gpu.handle, fields)
            instant, average = (
                v.value.uiVal / 1000 if v.nvmlReturn == pynvml.NVML_SUCCESS else None
                for v in values
            )
        except pynvml.NVMLError:
            pass
        if average is None:  # the driver's (averaged) power reading, every GPU has it
            average = pynvml.nvmlDeviceGetPowerUsage(gpu.handle) / 1000
        return instant, average

    def read(self, t_s: float) -> dict[str, Any]:
        out = []
        for g in self._gpus:
            instant, average = self._power(g)
            watts = instant if instant is not None else average
            if g.energy_counter:
                energy = (pynvml.nvmlDeviceGetTotalEnergyConsumption(g.handle) - g.first_mj) / 1000
            else:
                if g.last is not None:
                    g.integrated_j += (t_s - g.last[0]) * (watts + g.last[1]) / 2
                g.last = (t_s, watts)
                energy = g.integrated_j
            mask = int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(g.handle))
            out.append(
                {
                    "index": g.index,
                    "temp_c": pynvml.nvmlDeviceGetTemperature(
                        g.handle, pynvml.NVML_TEMPERATURE_GPU
                    ),
                    "power_w": instant,
                    "power_avg_w": average,
                    "energy_j": energy,
                    "energy_source": self._energy_source(g),
                    "sm_mhz": pynvml.nvmlDeviceGetClockInfo(g.handle, pynvml.NVML_CLOCK_SM),
                    "mem_mhz": pynvml.nvmlDeviceGetClockInfo(g.handle, pynvml.NVML_CLOCK_MEM),
                    "clock_reasons": mask,
                    "clock_reason_names": decode_reasons(mask),
                    "throttled": bool(mask & THROTTLING),
                    "thermal_throttled": bool(mask & THERMAL),
                }
            )
        return {"gpus": out}

    def close(self) -> None:
        if self._initialised:
            self._initialised = False
            self._gpus = []
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass
