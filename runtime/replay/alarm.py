"""Calls a function when the run's clock reaches a deadline, from its own thread.

The replay submits requests between iterations, but a foreground arrival must be able to
stop a long background-only iteration while it runs: this alarm fires `engine.preempt` at
the next foreground request's arrival time (the arrival itself, not a periodic check).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ArrivalAlarm:
    def __init__(self, now: Callable[[], float], fire: Callable[[], None]) -> None:
        self._now = now
        self._fire = fire
        self._deadline: float | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="edgeprefill-arrivals", daemon=True)
        self._thread.start()

    def set(self, deadline: float | None) -> None:
        """Fire once at `deadline` (run-clock seconds); None disarms. Each call wakes the
        thread: the replay calls it only when the next chat's arrival changes."""
        with self._cond:
            self._deadline = deadline
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - self._now()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._deadline = None
                self._fire()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
