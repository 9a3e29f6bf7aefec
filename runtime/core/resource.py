"""One way to own a resource: `close()`, and `with` closes it."""

from __future__ import annotations

from typing import Self


class Closeable:
    def close(self) -> None:
        """Free what the object holds; idempotent."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
