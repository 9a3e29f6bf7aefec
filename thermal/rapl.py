"""CPU package energy from the RAPL powercap interface.

Only package domains are read (`intel-rapl:N` named `package-N`): psys contains the
packages and a package contains its core, uncore and dram subdomains, so adding domains
would count the same joules twice. Each `energy_uj` counter wraps at
`max_energy_range_uj`; the reader keeps a running total per package across wraps (it is
sampled far more often than the counter can wrap, every few minutes at worst). Since Linux
5.10 `energy_uj` is readable only by root (a side-channel fix), which is reported as such.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeprefill.thermal.sensor import Sensor, SensorStatus, read_int, read_text

PACKAGE_DOMAIN = re.compile(r"intel-rapl:\d+$")


@dataclass
class _Package:
    name: str
    energy_path: Path
    max_range_uj: int
    last_uj: int
    total_uj: int = 0

    def advance(self, now_uj: int) -> None:
        delta = now_uj - self.last_uj
        if delta < 0:  # the counter wrapped since the last read
            delta += self.max_range_uj
        self.total_uj += delta
        self.last_uj = now_uj


class RaplSensor(Sensor):
    name = "rapl"

    def __init__(self, root: Path = Path("/")) -> None:
        self.base = root / "sys/class/powercap"
        self._packages: list[_Package] = []

    def open(self) -> SensorStatus:
        domains = sorted(d for d in self.base.glob("intel-rapl:*") if PACKAGE_DOMAIN.search(d.name))
        packages = []
        for d in domains:
            try:
                name = read_text(d / "name")
            except OSError:
                continue
            if not name.startswith("package"):
                continue  # psys: the whole platform, which contains the packages
            energy = d / "energy_uj"
            try:
                packages.append(
                    _Package(name, energy, read_int(d / "max_energy_range_uj"), read_int(energy))
                )
            except PermissionError:
                return SensorStatus.unavailable(
                    f"permission denied reading {energy} (root-only since Linux 5.10); run as "
                    f"root or `sudo chmod a+r {self.base}/intel-rapl:*/energy_uj`"
                )
            except (OSError, ValueError) as e:
                return SensorStatus.unavailable(f"cannot read {energy}: {e}")
        if not packages:
            return SensorStatus.unavailable(
                f"no RAPL package domains under {self.base} (no powercap driver: not an "
                "Intel/AMD CPU, or a virtual machine)"
            )
        self._packages = packages
        return SensorStatus(True, "+".join(f"rapl:{p.name}" for p in packages))

    def read(self, t_s: float) -> dict[str, Any]:
        out = {}
        for p in self._packages:
            p.advance(read_int(p.energy_path))
            out[p.name] = p.total_uj / 1e6
        return {"energy_j": out}
