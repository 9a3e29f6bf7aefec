"""The OpenAI-compatible HTTP app over one `Runtime`.

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events or
whole), GET /v1/models, GET /health, GET /metrics (Prometheus), and the indexer's
/v1/documents (POST 202, GET, DELETE). A request's `priority` (vLLM's field: lower runs
first) makes it foreground at <= 0 (the default: a chat) and background above; the
extension `ttft_target_ms` sets an absolute first-token target, and `document_id` asks about
a document given to /v1/documents (its kept state is restored: only the question is
computed; asked while the document is still read, it waits for the read). `Guard` checks
the Host header, the Origin, the key and the body's size before any route runs; bodies are
parsed by `BodyParser`, a large one off the event loop.

Text is tokenized on worker threads, never on the event loop (a long document took the loop
from every stream while it was tokenized): chats on one, documents on another, so a chat's
text never waits behind a document's.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel

from edgeprefill.runtime.api.chat_prompt import encode_chat, turn_stops
from edgeprefill.runtime.api.handle import RequestHandle
from edgeprefill.runtime.api.runtime import INDEX_INSTRUCTION, Runtime
from edgeprefill.runtime.core.request import Request as EngineRequest
from edgeprefill.runtime.core.request import RequestClass, SamplingParams
from edgeprefill.runtime.core.threads import lowest_thread_priority
from edgeprefill.runtime.server.admission import Admission, QueueLimits
from edgeprefill.runtime.server.body import BodyParser, request_body_schemas
from edgeprefill.runtime.server.connections import Deadlines
from edgeprefill.runtime.server.documents import Documents
from edgeprefill.runtime.server.errors import ApiError, add_error_handlers
from edgeprefill.runtime.server.guard import Guard
from edgeprefill.runtime.server.json_tools import JsonTools
from edgeprefill.runtime.server.llama3_tools import Llama3Tools
from edgeprefill.runtime.server.metrics import ServerMetrics
from edgeprefill.runtime.server.responses import respond
from edgeprefill.runtime.server.schema import ChatRequest, CompletionRequest, DocumentRequest
from edgeprefill.runtime.server.tagged_tools import TaggedTools
from edgeprefill.runtime.server.tools import ToolUse

T = TypeVar("T")

# The tokenizer's `tool_calls_form()`: how a chat's tools are described and its calls read.
TOOL_FORMS: dict[str, type[ToolUse]] = {
    "tagged": TaggedTools,
    "llama3": Llama3Tools,
    "json": JsonTools,
}

PAGE = (resources.files(__package__) / "page.html").read_text(encoding="utf-8")
# The page's script talks to this server alone, and no other site may frame it.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class ServerOptions:
    """What `edgeprefill serve` takes beyond the runtime's own options."""

    api_key: str | None = None
    model_id: str = "default"
    queue: QueueLimits = QueueLimits()
    max_body_bytes: int = 8 << 20
    # Names the Host header may carry; None: any (bound beyond loopback).
    hosts: frozenset[str] | None = None
    origins: frozenset[str] = frozenset()  # web origins besides the server's own
    max_requests: int | None = 256  # answered at once; past it 503 (not /health)
    deadlines: Deadlines = Deadlines()
    shutdown_timeout_s: float = 10.0  # for answers in flight at SIGTERM, then they end
    finish_documents: bool = False  # at shutdown, read the queued documents first
    documents_kept: int = 256  # finished documents answerable by id, the oldest dropped
    parse_special: bool = False  # chat text may carry the model's control tokens


BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatRequest,
    "/v1/completions": CompletionRequest,
    "/v1/documents": DocumentRequest,
}


def create_app(routes: Routes, options: ServerOptions) -> Guard:
    app = FastAPI(title="edgeprefill", docs_url=None, redoc_url=None)
    add_error_handlers(app)
    app.get("/", response_class=HTMLResponse)(routes.page)
    app.get("/health")(routes.health)
    app.get("/v1/models")(routes.models)
    app.get("/metrics")(routes.prometheus)
    app.post("/v1/chat/completions")(routes.chat)
    app.post("/v1/completions")(routes.complete)
    app.post("/v1/documents", status_code=202)(routes.add_document)
    app.get("/v1/documents")(routes.list_documents)
    app.get("/v1/documents/{doc_id}")(routes.get_document)
    app.delete("/v1/documents/{doc_id}")(routes.cancel_document)
    _document_bodies(app)
    return Guard(
        app,
        api_key=options.api_key,
        max_body_bytes=options.max_body_bytes,
        hosts=options.hosts,
        origins=options.origins,
        max_requests=options.max_requests,
    )


def _document_bodies(app: FastAPI) -> None:
    """/openapi.json names each POST route's body, which the routes parse themselves."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema, parts = default(), request_body_schemas(BODIES)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                parts["components"]
            )
            for path, body in parts["bodies"].items():
                schema["paths"][path]["post"]["requestBody"] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class Routes:
    """The handlers; what may be submitted is `Admission`'s to say."""

    def __init__(self, runtime: Runtime, metrics: ServerMetrics, options: ServerOptions) -> None:
        self.runtime, self.metrics, self.options = runtime, metrics, options
        self.model_id = options.model_id
        self.admission = Admission(runtime, options.model_id, options.queue)
        self.documents = Documents(options.documents_kept)
        self.tokenizer = runtime.backend.tokenizer
        self.turn_stops = turn_stops(self.tokenizer)  # a chat's answer ends with its turn
        # Tools in the model's own template's form where it has one, else in JSON.
        self.tool_form: type[ToolUse] = TOOL_FORMS[self.tokenizer.tool_calls_form()]
        # Lowest priority: a 100k-token document is ~0.4 s of a core, which the compute
        # threads beside it would lose (benchmarks/history.md, section E).
        self._workers = {
            name: ThreadPoolExecutor(
                1, thread_name_prefix=f"edgeprefill-{name}", initializer=lowest_thread_priority
            )
            for name in ("chats", "documents", "bodies")
        }
        n_ctx = runtime.backend.capacity.n_ctx_seq
        self.bodies = BodyParser(n_ctx, self._workers["bodies"])

    def close(self) -> None:
        for worker in self._workers.values():
            worker.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(
        self, cls: RequestClass, work: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """`work` on the class's tokenizing thread."""
        call = functools.partial(work, *args, **kwargs)
        worker = self._workers["chats" if cls == "foreground" else "documents"]
        return await asyncio.get_running_loop().run_in_executor(worker, call)

    def _sent(self, stamp_s: float) -> None:
        self.metrics.delivery.observe(self.runtime.engine.clock.now() - stamp_s)
        self.runtime.handover.written()

    async def health(self, request: Request) -> Any:
        """200 while requests are taken; 503 once the engine failed (the process then exits
        for a supervisor to restart it) or while shutting down. The failure's text, which
        may name paths, goes to a request with the key alone (and to the log)."""
        if self.runtime.failure is not None:
            body = {"status": "failed"}
            if request.state.keyed:
                body["error"] = self.runtime.failure
            return JSONResponse(body, 503)
        if not self.runtime.accepting:
            return JSONResponse({"status": "stopping"}, 503)
        return {"status": "ok"}

    async def page(self) -> HTMLResponse:
        """A page to look at: a chat that streams, the documents being read, and the
        scheduler live. It holds no data; its calls carry the key typed into it. Framed by
        no other page, and its script may call this server alone."""
        return HTMLResponse(PAGE, headers=PAGE_HEADERS)

    async def models(self) -> dict[str, Any]:
        card = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "edgeprefill"}
        return {"object": "list", "data": [card]}

    async def prometheus(self) -> Response:
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request) -> Any:
        body = await self.bodies.parse(request, ChatRequest)
        self.admission.check(body)
        tool_use = self.tool_form.of(body)
        messages = self.tool_form.conversation(body.messages, tool_use)
        self.admission.check_text(sum(len(m["content"]) for m in messages), "messages")
        sampling = await self._off_loop(body.cls, self.admission.sampling, body, tool_use)
        if body.document_id is not None:  # the conversation's words, after the document
            question = "\n\n".join(m["content"] for m in messages if m["content"])
            handle = await self._ask(body, question, sampling)
        else:
            special = self.options.parse_special
            tools = None if tool_use is None else tool_use.template_tools()
            try:
                prompt = await self._off_loop(
                    body.cls, encode_chat, self.tokenizer, messages, special, tools
                )
            except ValueError as e:  # the template's own check of the conversation
                raise ApiError(400, str(e), param="messages") from None
            handle = self.admission.submit(body, prompt, sampling)
        return await respond(
            body,
            handle,
            "chat.completion",
            self.model_id,
            request,
            self._sent,
            # `ignore_eos` runs past the turn's end: a template's end-of-turn token, or
            # this marker where the plain transcript stands in for a template.
            [] if body.ignore_eos else self.turn_stops,
            tool_use,
        )

    async def complete(self, request: Request) -> Any:
        body = await self.bodies.parse(request, CompletionRequest)
        self.admission.check(body)
        sampling = await self._off_loop(body.cls, self.admission.sampling, body)
        if body.document_id is not None:
            if not isinstance(body.prompt, str):
                raise ApiError(
                    400, "a question about a document (document_id) must be text", param="prompt"
                )
            handle = await self._ask(body, body.prompt, sampling)
        elif isinstance(body.prompt, str):
            self.admission.check_text(len(body.prompt), "prompt")
            prompt = await self._off_loop(
                body.cls, self.tokenizer.encode, body.prompt, add_bos=True, special=False
            )
            handle = self.admission.submit(body, prompt, sampling)
        else:
            handle = self.admission.submit(body, body.prompt, sampling)
        return await respond(body, handle, "text_completion", self.model_id, request, self._sent)

    async def _ask(
        self, body: ChatRequest | CompletionRequest, question: str, sampling: SamplingParams
    ) -> RequestHandle:
        """A question about a document given to /v1/documents, as `Runtime.ask` asks it."""
        assert body.document_id is not None
        document = self.documents.get(body.document_id)
        prompt = await self._off_loop(body.cls, self.runtime.question_prompt, document, question)
        return self.admission.submit(body, prompt, sampling, after_prefix_of=document)

    async def add_document(self, request: Request) -> dict[str, Any]:
        body = await self.bodies.parse(request, DocumentRequest)
        self.admission.check_queue("background")  # before the work of tokenizing it
        document = body.text if body.text is not None else body.tokens
        assert document is not None
        instruction = INDEX_INSTRUCTION if body.instruction is None else body.instruction
        source = "text" if body.text is not None else "tokens"
        self.admission.check_text(len(body.text or "") + len(instruction), source)
        prompt, kept = await self._off_loop(
            "background", self.runtime.index_prompt, document, instruction
        )
        handle = self.admission.submit_document(prompt, kept, body.max_tokens, source)
        # Unguessable, since it reads the answer; known to its client alone (the results
        # name the request by the runtime's own id).
        doc_id = f"doc-{secrets.token_urlsafe(16)}"
        self.documents.add(doc_id, handle)
        return {"id": doc_id, "object": "document", "status": "queued"}

    async def list_documents(self) -> dict[str, Any]:
        """The progress of every document kept, oldest first, without their ids: an id
        reads the document's answer, which only whoever gave the document holds."""
        data = [
            {
                "object": "document",
                "status": _status(h.request),
                "prompt_tokens_read": h.request.num_computed,
                "prompt_tokens": h.request.prompt_len,
            }
            for h in self.documents.by_arrival()
        ]
        return {"object": "list", "data": data}

    async def get_document(self, doc_id: str) -> dict[str, Any]:
        req = self.documents.get(doc_id).request
        return {
            "id": doc_id,
            "object": "document",
            "status": _status(req),
            "prompt_tokens_read": req.num_computed,
            "prompt_tokens": req.prompt_len,
            "output": self.tokenizer.decode(req.output) if req.done else None,
            "error": req.error,
        }

    async def cancel_document(self, doc_id: str) -> dict[str, Any]:
        """Cancel it if it is still read, and forget it (its kept state stays on disk, for
        the prefix cache to reuse or evict)."""
        handle = self.documents.get(doc_id)
        handle.cancel()
        try:
            await asyncio.to_thread(handle.result, 60)
        except TimeoutError:
            raise ApiError(
                504, f"document {doc_id} did not stop within 60 s", "server_error"
            ) from None
        self.documents.drop(doc_id)
        return {"id": doc_id, "object": "document", "deleted": True}


def _status(req: EngineRequest) -> str:
    return "failed" if req.error else req.status.name.lower()
