"""Budget policies: how many prompt tokens may ride along with the decodes, per iteration.

A policy sees only `SchedState` and completed `IterationTiming`s and imports nothing from a
backend, so the same objects run under llama.cpp and vLLM. Policies are dataclasses whose
fields are their parameters; `parse_policy("static:64")` or `parse_policy("static:tokens=64")`
builds one from the command line.
"""

from __future__ import annotations

import dataclasses
import typing
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from edgeprefill.runtime.errors import UserError
from edgeprefill.runtime.plan import IterationTiming, SchedState
from edgeprefill.runtime.registry import Registry

if TYPE_CHECKING:
    from edgeprefill.runtime.calibrate import DeviceProfile


class BudgetPolicy(ABC):
    """Chooses the iteration's aggregate prefill-token cap.

    `budget` is called once before each iteration is planned; `observe` once after it
    completed, with the time of the finished work. `None` means no cap beyond `n_batch`.
    """

    name: ClassVar[str]

    @abstractmethod
    def budget(self, state: SchedState) -> int | None: ...

    def observe(self, timing: IterationTiming) -> None:
        """Learn from a completed iteration; stateless policies ignore it."""

    def calibrate(self, profile: DeviceProfile) -> None:
        """Fill the parameters the user left unset from the device's measured profile.
        Called once, before the first iteration."""

    def _need(self, value: Any, what: str) -> Any:
        if value is None:
            raise ValueError(
                f"policy {self.name} has no {what}: give it (e.g. {self.name}:{what}=...) "
                "or run with device calibration"
            )
        return value

    def params(self) -> dict[str, Any]:
        """The parameters the policy runs with, for summary.json."""
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}

    def snapshot(self) -> dict[str, Any]:
        """The policy's own state after an iteration, for iterations.jsonl."""
        return {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.params()}


POLICIES: Registry[BudgetPolicy] = Registry("policy")


@POLICIES.register("static")
@dataclasses.dataclass
class StaticPolicy(BudgetPolicy):
    """A fixed cap of `tokens` prompt tokens per iteration (chunked prefill's chunk size)."""

    name: ClassVar[str] = "static"
    tokens: int = 64

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"tokens must be at least 1, got {self.tokens}")

    def budget(self, state: SchedState) -> int | None:
        return self.tokens


@POLICIES.register("unlimited")
@dataclasses.dataclass
class UnlimitedPolicy(BudgetPolicy):
    """No cap: prompts fill whatever `n_batch` leaves after the decodes, as llama.cpp's
    own server does."""

    name: ClassVar[str] = "unlimited"

    def budget(self, state: SchedState) -> int | None:
        return None


def parse_policy(spec: str) -> BudgetPolicy:
    """Build a policy from `name`, `name:VALUE` (its first parameter) or `name:k=v,k=v`."""
    name, _, argstr = spec.strip().partition(":")
    factory = POLICIES.get(name)
    fields = [f for f in dataclasses.fields(factory) if f.init]  # type: ignore[arg-type]
    hints = typing.get_type_hints(factory)
    usage = ",".join(f"{f.name}=..." for f in fields) or "no parameters"
    kwargs: dict[str, Any] = {}
    for i, part in enumerate(p for p in argstr.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        if not eq:
            if i > 0 or not fields:
                raise UserError(f"--policy {spec!r}: unexpected {part!r}; {name} takes {usage}")
            key, value = fields[0].name, part
        key = key.strip()
        if key not in {f.name for f in fields}:
            raise UserError(f"--policy {spec!r}: unknown parameter {key!r}; {name} takes {usage}")
        kind = next(
            a for a in (typing.get_args(hints[key]) or (hints[key],)) if a is not type(None)
        )
        try:
            kwargs[key] = kind(value.strip())
        except ValueError:
            raise UserError(
                f"--policy {spec!r}: {key} must be {kind.__name__}, got {value!r}"
            ) from None
    try:
        return factory(**kwargs)
    except ValueError as e:
        raise UserError(f"--policy {spec!r}: {e}") from None


# The paper policies and ours register themselves on import.
from edgeprefill.runtime import cadence, dlfp, ppas  # noqa: E402, F401
