"""What a loopback server checks before it does any work for a request, in this order: the
Host header (a web page in the user's browser can reach 127.0.0.1 through DNS rebinding, but
its requests then name the attacker's host), the Origin header (a page's requests carry
its own: only this server's page, or an origin allowed by name, may call it), the API key,
the number of requests being answered, then the body's size, refused from its
Content-Length before a byte is read and counted as it streams in when there is none.
A key checked by a route would come after the body is read, so a client without it could
fill the server's memory.

Requests are counted, not connections: an idle socket costs a file descriptor until its
deadline closes it (`connections`), and must not take the place of a request. /health is
answered past the limit, for a supervisor to tell a busy server from a dead one.

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
        origins: frozenset[str] = frozenset(),
        max_requests: int | None = None,
    ) -> None:
        """`hosts`: the names the Host header may carry (any port); None: any (a server
        bound beyond loopback, whose names are the network's). `origins`: web origins
        besides the server's own whose pages may call it ("http://localhost:3000").
        `max_requests`: most requests answered at once; past it 503."""
        self.app, self.max_body_bytes, self.hosts = app, max_body_bytes, hosts
        self.origins, self.max_requests = origins, max_requests
        self._bearer = None if api_key is None else f"Bearer {api_key}".encode()
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # latin-1 bytes; the last of repeated ones
        scope.setdefault("state", {})["keyed"] = self.keyed(headers)  # for /health's detail
        refusal = self._refusal(scope["path"], headers)
        if refusal is not None:
            await _answer(send, *refusal)
            return
        busy = self.max_requests is not None and self.active >= self.max_requests
        if busy and scope["path"] != "/health":
            message = f"{self.active} requests are being answered (--max-connections): retry"
            await _answer(send, 503, message, "server_error")
            return
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await _answer(send, 413, self._too_large(), "invalid_request_error")
            return
        self.active += 1
        try:
            await self.app(scope, self._counted(receive), send)
        finally:
            self.active -= 1

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
        origin = headers.get(b"origin")
        if origin is not None and not self._same_origin(origin, host):
            return (
                403,
                f"Origin {origin.decode('latin-1')!r} is not this server's: another web page "
                "may not call it (start the server with --allowed-origin ORIGIN to let it)",
                "permission_error",
            )
        if self._bearer is None or path in OPEN_PATHS:
            return None
        if not self.keyed(headers):
            return (
                401,
                "missing or wrong API key (Authorization: Bearer KEY)",
                "authentication_error",
            )
        return None

    def keyed(self, headers: dict[bytes, bytes]) -> bool:
        """The request carries this server's key (False where it has none)."""
        given = headers.get(b"authorization", b"")
        return self._bearer is not None and secrets.compare_digest(given, self._bearer)

    def _same_origin(self, origin: bytes, host: bytes | None) -> bool:
        """The page at this server's own address (its Host, checked above), or one allowed."""
        text = origin.decode("latin-1").strip().lower()
        if text in self.origins:
            return True
        own = None if host is None else host.decode("latin-1").strip().lower()
        return own is not None and text in (f"http://{own}", f"https://{own}")

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
