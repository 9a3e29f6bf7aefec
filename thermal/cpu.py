"""CPU temperature, thermal-throttle events and clock frequency.

Temperature comes from hwmon (the CPU's own sensor driver: coretemp, k10temp, zenpower,
cpu_thermal), else from a CPU thermal zone, else from psutil where there is no sysfs
(psutil reads the same hwmon files on Linux). Intel CPUs also count thermal-throttle events
per core; a count that rises between two samples marks the interval as throttled.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil

from edgeprefill.thermal.sensor import (
    Sensor,
    SensorStatus,
    read_int,
    read_optional_int,
    read_text,
)

CPU_HWMON = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal")
CPU_ZONES = ("x86_pkg_temp", "cpu-thermal", "cpu_thermal", "TCPU", "soc_thermal", "acpitz")
PACKAGE_LABELS = ("Package id", "Tctl", "Tdie", "CPU")


class CpuTemperatureSensor(Sensor):
    name = "cpu_temp"

    def __init__(self, root: Path = Path("/")) -> None:
        self.root = root
        self._paths: list[Path] = []
        self._throttle: list[Path] = []
        self._last_throttle: int | None = None
        self._use_psutil = False

    def open(self) -> SensorStatus:
        self._throttle = sorted(
            self.root.glob("sys/devices/system/cpu/cpu*/thermal_throttle/package_throttle_count")
        )
        if self._throttle:
            self._last_throttle = self._throttle_count()
        hwmon = self.root / "sys/class/hwmon"
        for chip, name in _named(hwmon.glob("hwmon*"), "name", CPU_HWMON):
            inputs = sorted(chip.glob("temp*_input"))
            package = [p for p in inputs if self._label(p).startswith(PACKAGE_LABELS)]
            self._paths = package or inputs
            if self._paths:
                return SensorStatus(True, f"hwmon:{name}")
        zones = self.root / "sys/class/thermal"
        for zone, kind in _named(zones.glob("thermal_zone*"), "type", CPU_ZONES):
            self._paths = [zone / "temp"]
            return SensorStatus(True, f"thermal_zone:{kind}")
        if self.root == Path("/") and not sys.platform.startswith("linux"):
            if getattr(psutil, "sensors_temperatures", None) and psutil.sensors_temperatures():
                self._use_psutil = True
                return SensorStatus(True, "psutil")
        return SensorStatus.unavailable(
            f"no CPU temperature sensor: no {'/'.join(CPU_HWMON)} chip under {hwmon} and no "
            f"CPU thermal zone under {zones} (virtual machines expose neither)"
        )

    @staticmethod
    def _label(path: Path) -> str:
        try:
            return read_text(path.with_name(path.name.replace("_input", "_label")))
        except OSError:
            return ""

    def _throttle_count(self) -> int:
        return sum(read_optional_int(p) or 0 for p in self._throttle)

    def read(self, t_s: float) -> dict[str, Any]:
        if self._use_psutil:
            temps = [t.current for ts in psutil.sensors_temperatures().values() for t in ts]
        else:
            temps = [read_int(p) / 1000 for p in self._paths]
        out: dict[str, Any] = {"c": max(temps)}
        if self._throttle:
            count = self._throttle_count()
            out["throttle_events"] = count
            out["throttled"] = count > (self._last_throttle or 0)
            self._last_throttle = count
        return out


class CpuFrequencySensor(Sensor):
    """Live per-core clocks from cpufreq; else /proc/cpuinfo's figure, flagged static
    (on a VM or without a cpufreq driver it is the nominal clock and never moves)."""

    name = "cpu_freq"

    def __init__(self, root: Path = Path("/")) -> None:
        self.root = root
        self._paths: list[Path] = []
        self._static: list[float] = []  # read once: parsing /proc/cpuinfo is not free

    def open(self) -> SensorStatus:
        self._paths = sorted(
            self.root.glob("sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_cur_freq")
        )
        if self._paths:
            return SensorStatus(True, "cpufreq")
        self._static = self._cpuinfo_mhz()
        if self._static:
            return SensorStatus(True, "proc_cpuinfo_static")
        return SensorStatus.unavailable(
            "no cpufreq driver under /sys/devices/system/cpu and no 'cpu MHz' in /proc/cpuinfo"
        )

    def _cpuinfo_mhz(self) -> list[float]:
        try:
            text = (self.root / "proc/cpuinfo").read_text()
        except OSError:
            return []
        return [
            float(line.split(":", 1)[1]) for line in text.splitlines() if line.startswith("cpu MHz")
        ]

    def read(self, t_s: float) -> dict[str, Any]:
        live = bool(self._paths)
        mhz = [read_int(p) / 1000 for p in self._paths] if live else self._static
        return {"mean_mhz": sum(mhz) / len(mhz), "max_mhz": max(mhz), "live": live}


class CpuLoadSensor(Sensor):
    """System-wide CPU utilisation since the previous sample (psutil); it scales a declared
    TDP into an energy estimate where no energy counter exists."""

    name = "cpu_load"

    def open(self) -> SensorStatus:
        psutil.cpu_percent(interval=None)  # starts psutil's interval
        return SensorStatus(True, "psutil")

    def read(self, t_s: float) -> dict[str, Any]:
        return {"percent": psutil.cpu_percent(interval=None)}


def _named(
    folders: Iterable[Path], file: str, wanted: tuple[str, ...]
) -> Iterator[tuple[Path, str]]:
    """The folders, in order, whose `file` names one of `wanted` (unreadable ones skipped)."""
    for folder in sorted(folders):
        try:
            name = read_text(folder / file)
        except OSError:
            continue
        if name in wanted:
            yield folder, name
