"""Deadlines for the connections a server holds, so that no client holds one for free.

uvicorn times out a connection only once it has answered a request on it (keep-alive): a
socket opened and left silent, headers sent a byte at a time, a body announced and never
sent, or a client that stops reading a stream kept its connection, and a task, for as long
as the client liked; 260 idle sockets filled uvicorn's connection limit, and one half-sent
body held SIGTERM until its client left. Here each phase of a request has its deadline,
after which the connection is closed (a request under way then sees its client gone, and
is cancelled):

- headers: from the connection's first byte (or its opening) to the end of the headers;
- body: from the end of the headers to the body's last byte;
- writes: how long the connection's send buffer may stay full (the client not reading);
- idle: between requests on a kept-alive connection (uvicorn's own `timeout_keep_alive`).

A subclass of uvicorn's httptools protocol, given to uvicorn as its `http` class: the
protocol sees the socket's phases, which no ASGI middleware can."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass(frozen=True)
class Deadlines:
    """Seconds each phase may take; a client past one has its connection closed."""

    headers_s: float = 10.0
    body_s: float = 30.0
    write_stall_s: float = 30.0
    idle_s: float = 5.0  # between requests (uvicorn's timeout_keep_alive)


def deadline_protocol(deadlines: Deadlines) -> type[HttpToolsProtocol]:
    """uvicorn's `http` protocol class, with `deadlines`."""

    class DeadlineProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(deadlines.headers_s)  # a socket opened and left silent

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm(deadlines.headers_s)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(deadlines.body_s)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        def pause_writing(self) -> None:
            super().pause_writing()
            self._arm(deadlines.write_stall_s)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._disarm()

    return DeadlineProtocol
