"""The driver for an open backend: the runtime's `Engine` over a backend it schedules, or a
self-scheduling backend's own engine (vLLM) with the same policy object. `run`, `compare`,
the embedding API and the server all get theirs here, so they run the same code on both."""

from __future__ import annotations

from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.contract import Backend
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.driver import Driver, SchedulingBackend
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.scheduler import BackgroundLimits


def open_driver(
    backend: Backend | SchedulingBackend,
    policy: BudgetPolicy,
    limits: BackgroundLimits | None,
    profile: DeviceProfile | None,
) -> Driver:
    if isinstance(backend, Backend):
        try:
            return Engine(backend, policy, limits=limits, profile=profile)
        except ValueError as e:
            raise UserError(f"--max-background/--foreground-kv: {e}") from None
    if limits is not None and limits != BackgroundLimits():
        raise UserError(
            f"--max-background/--foreground-kv apply to the llama.cpp backend; {backend.name} "
            "admits requests by its own KV-cache accounting: drop them"
        )
    if profile is not None:
        policy.calibrate(profile)
    policy.check_ready()
    return backend.engine(policy, profile=profile)
