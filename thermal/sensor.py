"""One seam for every telemetry source: open once (available, or why not), read each period.

Every reader takes the filesystem root as a parameter, so tests build fake sysfs trees in a
temporary folder and the same code reads the real /sys on a laptop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SensorStatus:
    """Whether a sensor can be read; `source` says what it reads, `reason` why it cannot."""

    available: bool
    source: str | None = None
    reason: str | None = None

    @classmethod
    def unavailable(cls, reason: str) -> SensorStatus:
        return cls(False, None, reason)

    def describe(self) -> dict[str, Any]:
        if self.available:
            return {"available": True, "source": self.source}
        return {"available": False, "source": "unavailable", "reason": self.reason}


class Sensor(ABC):
    name: str  # its key in telemetry.jsonl records and summary.json

    @abstractmethod
    def open(self) -> SensorStatus:
        """Find what to read; called once before sampling starts."""

    @abstractmethod
    def read(self, t_s: float) -> dict[str, Any]:
        """One sample taken at `t_s` on the run's clock. May raise: the sampler records the
        failure and carries on."""

    def close(self) -> None:  # noqa: B027 - most sensors hold nothing open
        """Release what `open` acquired."""


def read_text(path: Path) -> str:
    return path.read_text().strip()


def read_int(path: Path) -> int:
    return int(read_text(path))


def read_optional_int(path: Path) -> int | None:
    try:
        return read_int(path)
    except (OSError, ValueError):
        return None
