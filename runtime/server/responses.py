"""An answer as OpenAI's clients read it: one JSON body, or server-sent events (`data:
{...}` chunks, then `data: [DONE]`), cut at stop strings, with `usage`. A client that goes
away cancels its request on either path, whenever it leaves: its sequence is freed at the
next iteration rather than held to `max_tokens`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from edgeprefill.runtime.api.handle import RequestHandle
from edgeprefill.runtime.core.request import Request as EngineRequest
from edgeprefill.runtime.core.request import TokenLogprob
from edgeprefill.runtime.server.errors import ApiError, error_body
from edgeprefill.runtime.server.schema import Generation
from edgeprefill.runtime.server.tools import CallReader, ToolUse


async def respond(
    body: Generation,
    handle: RequestHandle,
    kind: str,
    model_id: str,
    request: Request,
    sent: Callable[[float], None] = lambda stamp: None,
    stops: list[str] | None = None,
    tools: ToolUse | None = None,
) -> Any:
    """`kind`: "chat.completion" or "text_completion". `sent` gets, each time a streamed
    chunk has been handed to the connection, the engine's stamp of its newest token.
    `stops`: where the answer ends besides the body's own stop strings. `tools`: the answer
    is a reply or calls in the tools' form, read as `_Calls` says."""
    rid = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{handle.id}"
    base = {"id": rid, "created": int(time.time()), "model": model_id}
    logprobs = None if body.logprobs_asked is None else Logprobs(kind, handle.token_bytes)
    pieces = _Stream(handle, [*body.stops, *(stops or [])], logprobs)
    if not body.stream:
        text = await _whole(pieces, request)
        if text is None:
            return Response(status_code=499)  # nobody reads it: the client went away
        if (error := pieces.failure()) is not None:
            raise ApiError(503, f"the request failed: {error}", "server_error")
        choice = _choice(kind, text, pieces.finish_reason(), pieces.logprobs(), whole=True)
        return {
            **base,
            "object": kind,
            "choices": [choice if tools is None else _called(choice, tools)],
            "usage": pieces.usage(),
        }
    chunk = {**base, "object": "chat.completion.chunk" if kind == "chat.completion" else kind}
    if tools is not None:
        pieces = _Calls(handle, pieces, tools)
    events = _events(chunk, kind, pieces, body.include_usage, sent)
    # The task runs after the stream ends or the client leaves, even one that left before
    # the first chunk was pulled (the events' own `finally` never runs then).
    cancel = BackgroundTask(handle.cancel)
    return StreamingResponse(events, media_type="text/event-stream", background=cancel)


async def _whole(pieces: _Stream, request: Request) -> str | None:
    """The answer's text, or None (and the request cancelled) if the client disconnects
    first: the body was read, so the next ASGI message is the disconnect."""

    async def collect() -> str:
        return "".join([p async for p in pieces])

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    text, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((text, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not text.done():
            text.cancel()
            pieces.handle.cancel()
    return text.result() if text.done() and not text.cancelled() else None


async def _events(
    base: dict[str, Any],
    kind: str,
    pieces: _Stream,
    include_usage: bool,
    sent: Callable[[float], None],
) -> AsyncIterator[bytes]:
    handle = pieces.handle
    try:
        if kind == "chat.completion":
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            yield sse({**base, "choices": [{**first, "finish_reason": None}]})
        async for text in pieces:
            if text:
                choice = _choice(kind, text, None, pieces.logprobs(), whole=False)
                yield sse({**base, "choices": [choice]})
                sent(pieces.stamp_s)  # resumed once the server took the chunk
        if isinstance(pieces, _Calls) and pieces.calls:
            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(pieces.calls)]}
            yield sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        last = _choice(kind, "", pieces.finish_reason(), pieces.logprobs(), whole=False)
        yield sse({**base, "choices": [last]})
        if (error := pieces.failure()) is not None:  # the openai client raises APIError on it
            yield sse(error_body(f"the request failed: {error}", "server_error"))
        if include_usage:
            yield sse({**base, "choices": [], "usage": pieces.usage()})
        yield b"data: [DONE]\n\n"
    finally:
        handle.cancel()  # the client went away: free its sequence (no-op once ended)


def _called(choice: dict[str, Any], tools: ToolUse) -> dict[str, Any]:
    """A whole chat answer read as the tools' JSON: its reply, or its calls."""
    content, calls = tools.answer(choice["message"]["content"])
    choice["message"] = {"role": "assistant", "content": content}
    if calls:
        choice["message"]["tool_calls"] = calls
        choice["finish_reason"] = "tool_calls"
    return choice


def usage(req: EngineRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": req.prompt_len,
        "completion_tokens": len(req.output),
        "total_tokens": req.prompt_len + len(req.output),
        "prompt_tokens_details": {"cached_tokens": req.prefix_reused_tokens},
    }


# Characters JSON leaves unescaped that Python's `str.splitlines` (and so httpx's
# `iter_lines`) ends a line at: a token's text holding one cut a client's event in two.
_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def sse(obj: dict[str, Any]) -> bytes:
    """One event, framed as bytes by orjson in one C call (json.dumps took several Python
    frames, and Starlette then encoded its text): a stream's chunks are written while the
    device is idle, waiting for them. Within the JSON, NEL and the Unicode line and
    paragraph separators are written escaped (the same string), so every client that reads
    the stream line by line sees one line per event."""
    data = orjson.dumps(obj)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


def _choice(
    kind: str, text: str, finish: str | None, logprobs: dict[str, Any] | None, whole: bool
) -> dict[str, Any]:
    if kind == "chat.completion":
        key = "message" if whole else "delta"
        body = (
            {"role": "assistant", "content": text} if whole else ({"content": text} if text else {})
        )
        return {"index": 0, key: body, "logprobs": logprobs, "finish_reason": finish}
    return {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}


class _Stream:
    """A request's text as it streams, cut at the first stop string (which is not sent, as
    OpenAI does); text that could still become a stop string is held back until it cannot."""

    def __init__(
        self, handle: RequestHandle, stops: list[str], logprobs: Logprobs | None = None
    ) -> None:
        self.handle, self.stops, self._format = handle, stops, logprobs
        self.stopped = False
        self.stamp_s = 0.0  # when the engine stamped the newest token read
        self.tokens_read = 0
        self._logprobs: list[tuple[int, TokenLogprob]] = []  # read, not yet taken

    async def __aiter__(self) -> AsyncIterator[str]:
        held = ""
        async for piece in self.handle:
            held += piece.text
            self.stamp_s = piece.time_s
            if piece.token is not None:
                self.tokens_read += 1
                if piece.logprob is not None:
                    self._logprobs.append((piece.token, piece.logprob))
            if self.stops:
                cut = min((held.find(s) for s in self.stops if s in held), default=-1)
                if cut >= 0:
                    self.stopped = True
                    self.handle.finish(self.tokens_read)
                    yield held[:cut]
                    return
                keep = max((len(s) - 1 for s in self.stops), default=0)
                safe = len(held) - keep
                if safe > 0:
                    yield held[:safe]
                    held = held[safe:]
            else:
                yield held
                held = ""
        yield held

    def logprobs(self) -> dict[str, Any] | None:
        """The log-probabilities of the tokens read since the last call, in the endpoint's
        shape (None where the request did not ask): those of every token the answer
        counts (`usage`), the one that completed a stop string included."""
        if self._format is None:
            return None
        taken, self._logprobs = self._logprobs, []
        return self._format(taken)

    def usage(self) -> dict[str, Any]:
        """As `usage`, the answer's tokens counted to the one that completed its stop
        string: the engine may have sampled more before the finish reached it, a number
        that would differ from run to run."""
        counts = usage(self.handle.request)
        if self.stopped:
            counts["completion_tokens"] = self.tokens_read
            counts["total_tokens"] = counts["prompt_tokens"] + self.tokens_read
        return counts

    def failure(self) -> str | None:
        """Why the request failed (the engine, a shutdown), or None: it ended as asked, or
        its own client cancelled it."""
        error = self.handle.request.error
        return None if self.stopped or error in (None, "cancelled") else error

    def finish_reason(self) -> str:
        req = self.handle.request
        if self.stopped or req.finish_reason == "stop":
            return "stop"
        if req.error:
            return "error" if req.error != "cancelled" else "stop"
        return "length"


class _Calls(_Stream):
    """A streamed answer that may hold tool calls (`CallReader`): sent as its calls or,
    where it holds none, as text (none streams in the JSON form, whose reply is JSON)."""

    def __init__(self, handle: RequestHandle, stream: _Stream, tools: ToolUse) -> None:
        super().__init__(handle, stream.stops, stream._format)
        self.tools = tools
        self.calls: list[dict[str, Any]] = []

    async def __aiter__(self) -> AsyncIterator[str]:
        reader = CallReader(self.tools)
        async for text in super().__aiter__():
            yield reader.feed(text)
        rest, self.calls = reader.end()
        yield rest

    def finish_reason(self) -> str:
        return "tool_calls" if self.calls else super().finish_reason()


class Logprobs:
    """Tokens' log-probabilities in the shape of the endpoint's choices: chat's
    `logprobs.content` entries, or the completions API's parallel lists (whose
    `text_offset` counts characters from the start of the answer, across chunks)."""

    def __init__(self, kind: str, token_bytes: Callable[[int], bytes]) -> None:
        self.chat = kind == "chat.completion"
        self._bytes = token_bytes
        self._offset = 0

    def __call__(self, entries: list[tuple[int, TokenLogprob]]) -> dict[str, Any]:
        if self.chat:
            content = [
                {**self._token(t, lp.logprob), "top_logprobs": [self._token(*a) for a in lp.top]}
                for t, lp in entries
            ]
            return {"content": content, "refusal": None}
        texts = [self._text(t) for t, _ in entries]
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [lp.logprob for _, lp in entries],
            "top_logprobs": [{self._text(a): v for a, v in lp.top} for _, lp in entries],
            "text_offset": offsets,
        }

    def _text(self, token: int) -> str:
        return self._bytes(token).decode("utf-8", errors="replace")

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self._bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}
