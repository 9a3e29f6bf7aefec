"""Name -> factory maps that list the valid names when given a bad one.

Policies (and later backends and arrival processes) are chosen on the command line as
`name:args`; a typo must answer with the names that exist, not a KeyError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from edgeprefill.runtime.core.errors import UserError

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Factories (of type F: a class, or a callable object) registered under unique names,
    for one kind of thing."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(factory: F) -> F:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            return factory

        return add

    def get(self, name: str) -> F:
        try:
            return self._factories[name]
        except KeyError:
            raise UserError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._factories)
