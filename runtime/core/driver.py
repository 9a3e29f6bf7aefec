"""What replays a workload: the runtime's `Engine` over a backend it schedules, or a
backend's own engine that schedules itself (vLLM) with the same policy objects."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from edgeprefill.runtime.core.budget import BackgroundCap, BudgetPolicy
from edgeprefill.runtime.core.contract import Capacity
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.iteration import Advance
from edgeprefill.runtime.core.plan import IterationTiming
from edgeprefill.runtime.core.request import Request, SamplingParams


class RunClock:
    """Seconds since the run started; every timestamp in a run's results uses it."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Driver(Protocol):
    clock: Any
    guard: BackgroundCap | None  # the thermal guard, which caps background prompt tokens
    # Set by a consumer of streamed tokens; called on the driver's thread once an
    # iteration's tokens are appended to their requests, before the driver's own
    # bookkeeping, which a streamed token would otherwise wait for (history, section C).
    on_tokens: Callable[[], None] | None

    @property
    def policy(self) -> BudgetPolicy: ...

    @property
    def has_work(self) -> bool: ...

    @property
    def has_running(self) -> bool:
        """Some request is decoding: an iteration with nothing scheduled is a wait for
        the device, not a policy that gives no budget to work that cannot otherwise run."""
        ...

    def add(self, req: Request) -> bool: ...

    @property
    def can_preempt(self) -> bool:
        """Whether `preempt` can stop an iteration in flight."""
        ...

    def preempt(self) -> None:
        """A foreground request is arriving: stop background-only prompt work in flight."""
        ...

    def advance(self) -> Advance | None:
        """Run one iteration; None when nothing could be scheduled."""
        ...

    def cancel(self, req: Request) -> bool: ...

    def finish(self, req: Request, kept: int) -> bool:
        """End a request as finished (`finish_reason` "stop") after its first `kept` output
        tokens: its reader found a stop string there. False if it had already ended."""
        ...

    def abort(self, reason: str) -> list[Request]: ...

    def queues(self) -> dict[str, tuple[int, int]]:
        """Requests waiting for a sequence and running, by class (a server's metrics)."""
        ...


class SchedulingBackend(Protocol):
    """A backend that schedules its own batches (vLLM): the runtime hands it the policy
    object and replays the workload through the driver it returns."""

    name: str
    tokenizer: Any
    prefix_cache: Any  # its own prefix caching, which a run can clear and flush (None: off)

    @property
    def capacity(self) -> Capacity:
        """What a server admits requests by: the backend's own batch and sequence limits."""
        ...

    def engine(
        self,
        policy: BudgetPolicy,
        *,
        guard: Any = None,
        clock: Any = None,
        profile: DeviceProfile | None = None,
    ) -> Driver: ...

    def probe_timings(self, seed: int = 0) -> list[IterationTiming]:
        """Timed iterations of a chat alone and beside prompt chunks of several sizes, for
        the startup cost model."""
        ...

    def check_sampling(self, sampling: SamplingParams) -> None:
        """As `Backend.check_sampling`."""

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
