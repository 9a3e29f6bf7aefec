"""Live progress while a run goes: requests done per class and the budget in force."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from edgeprefill.runtime.core.iteration import Iteration
from edgeprefill.runtime.core.request import CLASSES, Request


class LiveProgress:
    """Requests done per class and the budget in force, redrawn after every iteration."""

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

    def update(self, it: Iteration | None) -> None:
        if not self._enabled:
            return  # called after every iteration: nothing to draw, nothing to count
        for c, task in self._tasks.items():
            done = sum(r.done for r in self._requests if r.cls == c)
            info = ""
            if c == "background" and it is not None:
                cap = "none" if it.plan.budget is None else it.plan.budget
                info = f"budget {cap}  prefill {it.plan.n_prefill}  decode {it.plan.n_decode}"
            self._progress.update(task, completed=done, **({"info": info} if info else {}))

    def __enter__(self) -> Callable[[Iteration | None], None]:
        self._progress.start()
        return self.update

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()
