"""The backend seam: one planned iteration in, sampled tokens and completed time out.

The runtime owns all scheduling; a backend only owns the device's resources (weights, KV
cache, batch buffers, samplers) and runs exactly the batch it is given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

from edgeprefill.runtime.scheduler import Capacity, SeqWork


class Tokenizer(Protocol):
    """The model's own tokenizer, as workloads need it to build prompts."""

    vocab_size: int

    def encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]: ...

    def chat_parts(self, system: str | None) -> tuple[str, str]:
        """The model's chat template around one user message: (text before, text after)."""
        ...

    def is_normal(self, token: int) -> bool:
        """A plain text token (not control, byte or unused), for synthetic prompts."""
        ...

    def is_eog(self, token: int) -> bool: ...


@dataclass(frozen=True)
class StepResult:
    duration_s: float  # the completed forward pass, measured where the work finishes
    sampled: dict[int, int]  # sequence id -> sampled token, for work that asked for one


class BackendError(RuntimeError):
    """The device refused an iteration; the requests in it fail, the run goes on."""


class Backend(ABC):
    name: str
    capacity: Capacity
    tokenizer: Tokenizer
    # A backend with its own clock (the simulated one's is virtual) sets it; runs on it
    # then stamp every time with that clock instead of the wall clock.
    clock: Any = None

    @abstractmethod
    def execute(self, work: Sequence[SeqWork]) -> StepResult:
        """Run one iteration holding every slice of `work` in one forward pass."""

    @abstractmethod
    def release(self, seq_id: int) -> None:
        """Forget a finished or cancelled sequence: its KV cells and sampler state."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Backend and model facts for summary.json."""

    @abstractmethod
    def close(self) -> None:
        """Free native resources; idempotent."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
