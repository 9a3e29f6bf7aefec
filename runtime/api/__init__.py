"""The embedding API: `Runtime` (one engine thread, requests from any thread) and the
`RequestHandle` each request returns."""

from edgeprefill.runtime.api.handle import Piece, RequestHandle
from edgeprefill.runtime.api.runtime import Runtime

__all__ = ["Piece", "RequestHandle", "Runtime"]
