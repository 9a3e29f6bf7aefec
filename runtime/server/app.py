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
import secrets
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from edgeprefill.runtime.api.runtime import Runtime
from edgeprefill.runtime.server.admission import Admission
from edgeprefill.runtime.server.errors import ApiError, add_error_handlers
from edgeprefill.runtime.server.metrics import ServerMetrics
from edgeprefill.runtime.server.responses import respond
from edgeprefill.runtime.server.schema import ChatRequest, CompletionRequest, DocumentRequest


def create_app(routes: Routes, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="edgeprefill", docs_url=None, redoc_url=None)
    add_error_handlers(app)
    app.get("/health")(routes.health)
    keyed = {"dependencies": [Depends(_bearer(api_key))]}
    app.get("/v1/models", **keyed)(routes.models)
    app.get("/metrics", **keyed)(routes.prometheus)
    app.post("/v1/chat/completions", **keyed)(routes.chat)
    app.post("/v1/completions", **keyed)(routes.complete)
    app.post("/v1/documents", status_code=202, **keyed)(routes.add_document)
    app.get("/v1/documents/{doc_id}", **keyed)(routes.get_document)
    app.delete("/v1/documents/{doc_id}", **keyed)(routes.cancel_document)
    return app


def _bearer(api_key: str | None) -> Any:
    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error"
            )

    return authorized


class Routes:
    """The handlers; what may be submitted is `Admission`'s to say."""

    def __init__(
        self, runtime: Runtime, model_id: str, metrics: ServerMetrics, max_queue: int | None
    ) -> None:
        """`max_queue`: the most requests that may wait for a sequence; past it, 429."""
        self.runtime, self.model_id, self.metrics = runtime, model_id, metrics
        self.admission = Admission(runtime, model_id, max_queue)
        self.tokenizer = runtime.backend.tokenizer

    def _sent(self, stamp_s: float) -> None:
        self.metrics.delivery.observe(self.runtime.engine.clock.now() - stamp_s)

    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def models(self) -> dict[str, Any]:
        card = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "edgeprefill"}
        return {"object": "list", "data": [card]}

    async def prometheus(self) -> Response:
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4")

    async def chat(self, body: ChatRequest) -> Any:
        messages = [
            {"role": m.role if m.role != "developer" else "system", "content": m.text()}
            for m in body.messages
        ]
        if body.document_id is not None:  # the conversation's words, after the document
            question = "\n\n".join(m["content"] for m in messages if m["content"])
            handle = self.admission.ask(body, question)
        else:
            text = self.tokenizer.render_chat(messages)
            prompt = self.tokenizer.encode(text, add_bos=True, special=True)
            handle = self.admission.submit(body, prompt)
        return await respond(body, handle, "chat.completion", self.model_id, self._sent)

    async def complete(self, body: CompletionRequest) -> Any:
        if body.document_id is not None:
            if not isinstance(body.prompt, str):
                raise ApiError(
                    400, "a question about a document (document_id) must be text", param="prompt"
                )
            handle = self.admission.ask(body, body.prompt)
        elif isinstance(body.prompt, str):
            prompt = self.tokenizer.encode(body.prompt, add_bos=True, special=False)
            handle = self.admission.submit(body, prompt)
        else:
            handle = self.admission.submit(body, list(body.prompt))
        return await respond(body, handle, "text_completion", self.model_id, self._sent)

    async def add_document(self, body: DocumentRequest) -> dict[str, Any]:
        document: str | list[int] = body.text if body.text is not None else list(body.tokens or [])
        extra = {} if body.instruction is None else {"instruction": body.instruction}
        handle = self.admission.admit(
            lambda: self.runtime.index(document, max_tokens=body.max_tokens, **extra)
        )
        self.admission.documents[handle.id] = handle
        return {"id": handle.id, "object": "document", "status": "queued"}

    async def get_document(self, doc_id: str) -> dict[str, Any]:
        req = self.admission.document(doc_id).request
        status = "failed" if req.error else req.status.name.lower()
        return {
            "id": doc_id, "object": "document", "status": status,
            "prompt_tokens_read": req.num_computed, "prompt_tokens": req.prompt_len,
            "output": self.tokenizer.decode(req.output) if req.done else None,
            "error": req.error,
        }  # fmt: skip

    async def cancel_document(self, doc_id: str) -> dict[str, Any]:
        handle = self.admission.document(doc_id)
        handle.cancel()
        await asyncio.to_thread(handle.result, 60)
        return {"id": doc_id, "object": "document", "deleted": True}
