"""What a loopback server checks before it does any work for a request, in this order: the
Host header (a web page in the user's browser can reach 127.0.0.1 through DNS rebinding, but
its requests then name the attacker's host), the API key, then the body's size, refused from
its Content-Length before a byte is read and counted as it streams in when there is none.
FastAPI reads and parses the whole body before a route's dependencies run, so a key checked
there let a client without it fill the server's memory.

A plain ASGI middleware: it wraps the app, not each route, so /openapi.json and every other
route but /health need the key too."""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from edgeprefill.runtime.server.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Answered without the key: a supervisor's probe, and the page (which holds no data; its
# own calls carry the key typed into it).
OPEN_PATHS = frozenset({"/health", "/"})


class Guard:
    def __init__(
        self,
        app: App,
        *,
        api_key: str | None,
        max_body_bytes: int,
        hosts: frozenset[str] | None,
    ) -> None:
        """`hosts`: the names the Host header may carry (any port); None: any (a server
        bound beyond loopback, whose names are the network's)."""
        self.app, self.max_body_bytes, self.hosts = app, max_body_bytes, hosts
        self._bearer = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # latin-1 bytes; the last of repeated ones
        refusal = self._refusal(scope["path"], headers)
        if refusal is not None:
            await _answer(send, *refusal)
            return
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await _answer(send, 413, self._too_large(), "invalid_request_error")
            return
        await self.app(scope, self._counted(receive), send)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> tuple[int, str, str] | None:
        host = headers.get(b"host")
        if self.hosts is not None and host is not None and _name(host) not in self.hosts:
            names = ", ".join(sorted(self.hosts))
            return (
                400,
                f"Host {host.decode('latin-1')!r} is not this server's ({names}): a page "
                "reached through DNS rebinding, or start the server with --allowed-host NAME",
                "invalid_request_error",
            )
        if self._bearer is None or path in OPEN_PATHS:
            return None
        given = headers.get(b"authorization", b"")
        if not secrets.compare_digest(given, self._bearer):
            return (
                401,
                "missing or wrong API key (Authorization: Bearer KEY)",
                "authentication_error",
            )
        return None

    def _too_large(self) -> str:
        return f"the request body is over this server's {self.max_body_bytes} bytes (--max-body-mb)"

    def _counted(self, receive: Receive) -> Receive:
        """`receive`, refusing once the body streamed in passes the limit (a chunked body
        has no Content-Length): FastAPI answers the HTTPException with its 413."""
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise HTTPException(413, self._too_large())
            return message

        return counted


def _name(host: bytes) -> str:
    """The host name of a Host header, without its port: "[::1]:8080" -> "::1"."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


async def _answer(send: Send, status: int, message: str, kind: str) -> None:
    body = json.dumps(error_body(message, kind)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
