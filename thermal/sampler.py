"""The sampling thread: every sensor, every period, on the run's clock, into telemetry.jsonl.

It starts and stops with the run. A sensor that raises is recorded (when and why) and
skipped from then on, so one failing sensor never ends the sampling or the run. Its own CPU
time is measured, so its overhead is a reported number rather than a claim.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from edgeprefill.thermal.sensor import Sensor, SensorStatus

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 0.2


class TelemetrySampler:
    def __init__(
        self,
        sensors: Sequence[Sensor],
        now: Callable[[], float],
        out: Path | None = None,
        period_s: float = DEFAULT_PERIOD_S,
        keep: int | None = None,
    ) -> None:
        """`keep`: the most samples held in memory (None: all, for a run's summary; a
        server that runs for days keeps the recent ones and `listeners` see each)."""
        if period_s <= 0:
            raise ValueError(f"telemetry period must be positive, got {period_s}")
        self.sensors = list(sensors)
        self.now = now
        self.period_s = period_s
        self.status: dict[str, SensorStatus] = {}
        self.failures: dict[str, str] = {}
        self.samples: deque[dict[str, Any]] = deque(maxlen=keep)
        # Called on the sampling thread with each sample, after it is stored.
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self._out = out
        self._file: IO[str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._cpu_s = 0.0
        self._wall_s = 0.0

    def start(self) -> TelemetrySampler:
        """Open the sensors and the output, then sample every period on a thread."""
        self.open()
        self._thread = threading.Thread(
            target=self._loop, name="edgeprefill-telemetry", daemon=True
        )
        self._thread.start()
        return self

    def open(self) -> None:
        for s in self.sensors:
            try:
                self.status[s.name] = s.open()
            except Exception as e:  # a driver that fails to open is unavailable, not fatal
                self.status[s.name] = SensorStatus.unavailable(f"failed to open: {e}")
        if self._out is not None:
            # Private, as the run's other result files are, and never through a link.
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
            self._file = os.fdopen(os.open(self._out, flags, 0o600), "w", buffering=1)

    @property
    def live(self) -> list[Sensor]:
        return [
            s for s in self.sensors if self.status[s.name].available and s.name not in self.failures
        ]

    def latest(self) -> dict[str, Any] | None:
        """The most recent sample (for decisions taken while the run goes on)."""
        with self._lock:
            return self.samples[-1] if self.samples else None

    def sample_once(self) -> dict[str, Any]:
        t = self.now()
        record: dict[str, Any] = {"t_s": t}
        for s in self.live:
            try:
                record[s.name] = s.read(t)
            except Exception as e:  # keep sampling the others
                self.failures[s.name] = f"failed at t={t:.2f} s: {type(e).__name__}: {e}"
        with self._lock:
            self.samples.append(record)
        if self._file is not None:
            self._write(record)
        for listen in self.listeners:
            listen(record)
        return record

    def _write(self, record: dict[str, Any]) -> None:
        """One line of telemetry.jsonl. A write that fails (a full disk) stops the file,
        with a warning, not the sampling: the samples stay in memory for /metrics."""
        assert self._file is not None
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as e:
            log.warning("telemetry: writing %s failed (%s); sampling goes on", self._out, e)
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:
                pass  # what it buffered cannot reach the disk either

    def _loop(self) -> None:
        # time.sleep, not Event.wait: on a VM a timed wait cost 0.5 ms of CPU per wake-up,
        # a sleep 0.15 ms (half of the 1%-of-a-core budget at 0.2 s). stop() therefore
        # waits up to one period for the thread.
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        next_t = time.perf_counter()
        while not self._stop.is_set():
            self.sample_once()
            self._cpu_s, self._wall_s = time.thread_time() - cpu0, time.perf_counter() - wall0
            next_t += self.period_s
            time.sleep(max(0.0, next_t - time.perf_counter()))

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample_once()  # the run's last instant, so energy covers all of it
        for s in self.sensors:
            s.close()
        if self._file is not None:
            self._file.close()
            self._file = None

    def describe(self) -> dict[str, Any]:
        sensors = {}
        for name, st in self.status.items():
            d = st.describe()
            if name in self.failures:
                d["failed"] = self.failures[name]
            sensors[name] = d
        return {
            "period_s": self.period_s,
            "samples": len(self.samples),
            "overhead_cpu_percent": 100 * self._cpu_s / self._wall_s if self._wall_s else None,
            "sensors": sensors,
        }

    def __enter__(self) -> TelemetrySampler:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
