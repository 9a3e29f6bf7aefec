"""Name -> factory maps that list the valid names when given a bad one.

Policies (and later backends and arrival processes) are chosen on the command line as
`name:args`; a typo must answer with the names that exist, not a KeyError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from edgeprefill.runtime.core.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """Factories registered under unique names, for one kind of thing."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def add(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            return factory

        return add

    def get(self, name: str) -> Callable[..., T]:
        try:
            return self._factories[name]
        except KeyError:
            raise UserError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._factories)
