"""Battery charge, whether the machine is plugged in, and the power it draws.

Read from /sys/class/power_supply: a supply of type Battery gives capacity, status and
power_now (µW), or current_now (µA) times voltage_now (µV) where power_now is missing; the
machine counts as plugged when a Mains or USB supply is online, or when the battery says it
is charging or full.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgeprefill.thermal.sensor import Sensor, SensorStatus, read_optional_int, read_text


class BatterySensor(Sensor):
    name = "battery"

    def __init__(self, root: Path = Path("/")) -> None:
        self.base = root / "sys/class/power_supply"
        self._battery: Path | None = None
        self._mains: list[Path] = []

    def open(self) -> SensorStatus:
        for supply in sorted(self.base.glob("*")):
            try:
                kind = read_text(supply / "type")
            except OSError:
                continue
            if kind == "Battery" and self._battery is None:
                self._battery = supply
            elif kind in ("Mains", "USB"):
                self._mains.append(supply)
        if self._battery is None:
            return SensorStatus.unavailable(
                f"no battery under {self.base} (a desktop, server or virtual machine)"
            )
        return SensorStatus(True, f"power_supply:{self._battery.name}")

    def read(self, t_s: float) -> dict[str, Any]:
        bat = self._battery
        assert bat is not None
        status = read_text(bat / "status")
        power_uw = read_optional_int(bat / "power_now")
        if power_uw is None:
            current, voltage = (
                read_optional_int(bat / "current_now"),
                read_optional_int(bat / "voltage_now"),
            )
            if current is not None and voltage is not None:
                power_uw = current * voltage // 1_000_000
        online = any(read_optional_int(m / "online") == 1 for m in self._mains)
        return {
            "percent": read_optional_int(bat / "capacity"),
            "status": status,
            "plugged": online or status in ("Charging", "Full", "Not charging"),
            "power_w": None if power_uw is None else power_uw / 1e6,
        }
