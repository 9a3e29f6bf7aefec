"""Live progress while a run goes: requests done per class and the budget in force."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from edgeprefill.runtime.core.iteration import Iteration
from edgeprefill.runtime.core.request import CLASSES, Request

# rich redraws 10 times a second: counting more often than that is host time a token waits
# for (~0.05 ms an iteration) that nobody sees.
REDRAW_S = 0.1


class LiveProgress:
    """Requests done per class and the budget in force, as of the latest iteration."""

    def __init__(self, requests: list[Request], enabled: bool = True) -> None:
        self._requests = requests
        self._enabled = enabled
        self._progress = Progress(
            TextColumn("{task.description:<11}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self._tasks = {
            c: self._progress.add_task(c, total=sum(r.cls == c for r in requests), info="")
            for c in CLASSES
        }
        self._counted = -REDRAW_S
        self._last: Iteration | None = None

    def update(self, it: Iteration | None) -> None:
        """Called after every iteration; counts at most once per redraw."""
        if not self._enabled:
            return
        self._last = it
        if time.monotonic() - self._counted >= REDRAW_S:
            self._count(it)

    def _count(self, it: Iteration | None) -> None:
        self._counted = time.monotonic()
        for c, task in self._tasks.items():
            done = sum(r.done for r in self._requests if r.cls == c)
            self._progress.update(task, completed=done)
            if c == "background" and it is not None:
                cap = "none" if it.plan.budget is None else it.plan.budget
                info = f"budget {cap}  prefill {it.plan.n_prefill}  decode {it.plan.n_decode}"
                self._progress.update(task, info=info)

    def __enter__(self) -> Callable[[Iteration | None], None]:
        self._progress.start()
        return self.update

    def __exit__(self, *exc: object) -> None:
        if self._enabled:
            self._count(self._last)  # the final counts, whenever the last redraw was
        self._progress.stop()
