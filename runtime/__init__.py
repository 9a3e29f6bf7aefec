"""edgeprefill's runtime: `from edgeprefill.runtime import Runtime` is the embedding API.

The names are loaded on first use, so importing a layer (the policies inside vLLM's engine
core, say) loads nothing above it.
"""

from typing import Any

__all__ = ["Piece", "RequestHandle", "Runtime"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from edgeprefill.runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'edgeprefill.runtime' has no attribute {name!r}")
