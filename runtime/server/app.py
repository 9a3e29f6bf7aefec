"""The OpenAI-compatible HTTP app over one `Runtime`.

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events or
whole), GET /v1/models, GET /health, GET /metrics (Prometheus), and the indexer's
/v1/documents (POST 202, GET, DELETE). A request's `priority` (vLLM's field: lower runs
first) makes it foreground at <= 0 (the default: a chat) and background above; the
extension `ttft_target_ms` sets an absolute first-token target, and `document_id` asks about
a document given to /v1/documents (its kept state is restored: only the question is
computed; asked while the document is still read, it waits for the read). With an API key
every route but /health needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgeprefill.runtime.api.handle import RequestHandle
from edgeprefill.runtime.api.runtime import Runtime
from edgeprefill.runtime.core.request import Request as EngineRequest
from edgeprefill.runtime.server.metrics import ServerMetrics
from edgeprefill.runtime.server.schema import (
    ChatRequest,
    CompletionRequest,
    DocumentRequest,
    Generation,
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.retry_after_s = retry_after_s


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def create_app(
    runtime: Runtime,
    model_id: str,
    metrics: ServerMetrics,
    api_key: str | None = None,
    max_queue: int | None = None,
) -> FastAPI:
    """`max_queue`: the most requests that may wait for a sequence; past it, 429."""
    app = FastAPI(title="edgeprefill", docs_url=None, redoc_url=None)
    tokenizer = runtime.backend.tokenizer
    documents: dict[str, RequestHandle] = {}
    in_flight: list[RequestHandle] = []

    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error"
            )

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
        return JSONResponse(
            error_body(e.message, e.kind, e.param), status_code=e.status, headers=headers
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if _is_field(p))
        return JSONResponse(
            error_body(f"{where}: {first['msg']}", "invalid_request_error", where or None),
            status_code=400,
        )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        card = {"id": model_id, "object": "model", "created": 0, "owned_by": "edgeprefill"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    def fits(body: Generation, n_tokens: int) -> int:
        """The model asked for is this one, and prompt and answer fit one sequence's
        context (vLLM refuses the same requests, with 404 and 400). Returns the most tokens
        to generate: as asked, or by default as many as fit, up to MAX_TOKENS_DEFAULT."""
        if body.model is not None and body.model != model_id:
            raise ApiError(
                404, f"the model {body.model!r} does not exist: this server has {model_id!r}",
                "not_found_error", "model",
            )  # fmt: skip
        n_ctx = runtime.backend.capacity.n_ctx_seq
        if n_tokens >= n_ctx:
            raise ApiError(
                400,
                f"the prompt has {n_tokens} tokens; this server's context holds {n_ctx} per "
                "request",
                param="messages" if isinstance(body, ChatRequest) else "prompt",
            )
        if body.max_tokens is None and body.max_completion_tokens is None:
            return min(body.limit, n_ctx - n_tokens)
        if n_tokens + body.limit > n_ctx:
            name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            raise ApiError(
                400,
                f"{name} {body.limit} and the prompt's {n_tokens} tokens exceed this server's "
                f"context of {n_ctx} per request: ask for {n_ctx - n_tokens} or fewer",
                param=name,
            )
        return body.limit

    def options(body: Generation, max_tokens: int) -> dict[str, Any]:
        return {
            "max_tokens": max_tokens,
            "cls": body.cls,
            "sampling": body.sampling(),
            "ttft_target_s": None if body.ttft_target_ms is None else body.ttft_target_ms / 1e3,
        }

    def admitted(submit: Callable[[], RequestHandle]) -> RequestHandle:
        """Submit unless the server is stopping (503) or its queue is full (429)."""
        if not runtime.accepting:
            raise ApiError(503, "the server is shutting down", "server_error")
        in_flight[:] = [h for h in in_flight if not h.done]
        waiting = len(in_flight) - runtime.backend.capacity.n_seq_max
        if max_queue is not None and waiting >= max_queue:
            raise ApiError(
                429, f"{waiting} requests are waiting (--max-queue {max_queue}): retry later",
                "rate_limit_error", retry_after_s=1,
            )  # fmt: skip
        try:
            handle = submit()
        except ValueError as e:  # token ids out of the vocabulary
            raise ApiError(400, str(e), param="prompt") from None
        except RuntimeError:  # stopped between the check and the submit
            raise ApiError(503, "the server is shutting down", "server_error") from None
        in_flight.append(handle)
        return handle

    def submit(body: Generation, prompt: list[int]) -> RequestHandle:
        limit = fits(body, len(prompt))
        return admitted(lambda: runtime.submit(prompt, **options(body, limit)))

    def ask(body: Generation, question: str) -> RequestHandle:
        """A question about a document given to /v1/documents, as `Runtime.ask` asks it."""
        assert body.document_id is not None
        document = find(body.document_id)
        prompt = runtime.question_prompt(document, question)
        limit = fits(body, len(prompt))
        return admitted(
            lambda: runtime.submit(prompt, after_prefix_of=document, **options(body, limit))
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatRequest) -> Any:
        messages = [
            {"role": m.role if m.role != "developer" else "system", "content": m.text()}
            for m in body.messages
        ]
        if body.document_id is not None:  # the conversation's words, after the document
            handle = ask(body, "\n\n".join(m["content"] for m in messages if m["content"]))
        else:
            text = tokenizer.render_chat(messages)
            handle = submit(body, tokenizer.encode(text, add_bos=True, special=True))
        return await respond(body, handle, "chat.completion")

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def complete(body: CompletionRequest) -> Any:
        if body.document_id is not None:
            if not isinstance(body.prompt, str):
                raise ApiError(
                    400, "a question about a document (document_id) must be text", param="prompt"
                )
            handle = ask(body, body.prompt)
        elif isinstance(body.prompt, str):
            handle = submit(body, tokenizer.encode(body.prompt, add_bos=True, special=False))
        else:
            handle = submit(body, list(body.prompt))
        return await respond(body, handle, "text_completion")

    async def respond(body: Generation, handle: RequestHandle, kind: str) -> Any:
        rid = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{handle.id}"
        created = int(time.time())
        pieces = _Stream(handle, body.stops)
        if not body.stream:
            text = "".join([p async for p in pieces])
            req = handle.request
            return {
                "id": rid, "object": kind, "created": created, "model": model_id,
                "choices": [_choice(kind, text, pieces.finish_reason(), whole=True)],
                "usage": usage(req),
            }  # fmt: skip

        async def events() -> AsyncIterator[str]:
            chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
            base = {"id": rid, "object": chunk_kind, "created": created, "model": model_id}
            try:
                if kind == "chat.completion":
                    first = {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                    yield sse({**base, "choices": [first]})
                async for text in pieces:
                    if text:
                        yield sse({**base, "choices": [_choice(kind, text, None, whole=False)]})
                yield sse(
                    {**base, "choices": [_choice(kind, "", pieces.finish_reason(), whole=False)]}
                )
                if body.include_usage:
                    yield sse({**base, "choices": [], "usage": usage(handle.request)})
                yield "data: [DONE]\n\n"
            finally:
                handle.cancel()  # the client went away: free its sequence (no-op once ended)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/documents", status_code=202, dependencies=[Depends(authorized)])
    async def add_document(body: DocumentRequest) -> dict[str, Any]:
        document: str | list[int] = body.text if body.text is not None else list(body.tokens or [])
        extra = {} if body.instruction is None else {"instruction": body.instruction}
        handle = admitted(lambda: runtime.index(document, max_tokens=body.max_tokens, **extra))
        documents[handle.id] = handle
        return {"id": handle.id, "object": "document", "status": "queued"}

    @app.get("/v1/documents/{doc_id}", dependencies=[Depends(authorized)])
    async def get_document(doc_id: str) -> dict[str, Any]:
        req = find(doc_id).request
        status = "failed" if req.error else req.status.name.lower()
        return {
            "id": doc_id, "object": "document", "status": status,
            "prompt_tokens_read": req.num_computed, "prompt_tokens": req.prompt_len,
            "output": tokenizer.decode(req.output) if req.done else None,
            "error": req.error,
        }  # fmt: skip

    @app.delete("/v1/documents/{doc_id}", dependencies=[Depends(authorized)])
    async def cancel_document(doc_id: str) -> dict[str, Any]:
        handle = find(doc_id)
        handle.cancel()
        await asyncio.to_thread(handle.result, 60)
        return {"id": doc_id, "object": "document", "deleted": True}

    def find(doc_id: str) -> RequestHandle:
        handle = documents.get(doc_id)
        if handle is None:
            raise ApiError(404, f"no document {doc_id!r}", "not_found_error")
        return handle

    return app


def _is_field(part: str | int) -> bool:
    """A part of a validation error's location that names a field or an index, not the body
    itself nor the member of a union it was tried as (pydantic's "str", "list[int]")."""
    if isinstance(part, int):
        return True
    return part != "body" and part.isidentifier() and part not in _TYPE_NAMES


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict"}


def usage(req: EngineRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": req.prompt_len,
        "completion_tokens": len(req.output),
        "total_tokens": req.prompt_len + len(req.output),
        "prompt_tokens_details": {"cached_tokens": req.prefix_reused_tokens},
    }


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _choice(kind: str, text: str, finish: str | None, whole: bool) -> dict[str, Any]:
    if kind == "chat.completion":
        key = "message" if whole else "delta"
        body = (
            {"role": "assistant", "content": text} if whole else ({"content": text} if text else {})
        )
        return {"index": 0, key: body, "finish_reason": finish}
    return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}


class _Stream:
    """A request's text as it streams, cut at the first stop string (which is not sent, as
    OpenAI does); text that could still become a stop string is held back until it cannot."""

    def __init__(self, handle: RequestHandle, stops: list[str]) -> None:
        self.handle, self.stops = handle, stops
        self.stopped = False

    async def __aiter__(self) -> AsyncIterator[str]:
        held = ""
        async for piece in self.handle:
            held += piece.text
            if self.stops:
                cut = min((held.find(s) for s in self.stops if s in held), default=-1)
                if cut >= 0:
                    self.stopped = True
                    self.handle.cancel()
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

    def finish_reason(self) -> str:
        req = self.handle.request
        if self.stopped or req.finish_reason == "stop":
            return "stop"
        if req.error:
            return "error" if req.error != "cancelled" else "stop"
        return "length"
