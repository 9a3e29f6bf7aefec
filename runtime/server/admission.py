"""What the server lets into the runtime: the model asked for, prompt and answer within one
sequence's context, token ids within the vocabulary, a queue under `--max-queue`, and no
new request once shutdown began."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edgeprefill.runtime.api.handle import RequestHandle
from edgeprefill.runtime.api.runtime import Runtime
from edgeprefill.runtime.server.errors import ApiError
from edgeprefill.runtime.server.schema import ChatRequest, Generation


class Admission:
    def __init__(self, runtime: Runtime, model_id: str, max_queue: int | None) -> None:
        """`max_queue`: the most requests that may wait for a sequence; past it, 429."""
        self.runtime, self.model_id, self.max_queue = runtime, model_id, max_queue
        self.documents: dict[str, RequestHandle] = {}
        self._in_flight: list[RequestHandle] = []

    def submit(self, body: Generation, prompt: list[int]) -> RequestHandle:
        limit = self._fits(body, len(prompt))
        return self.admit(lambda: self.runtime.submit(prompt, **_options(body, limit)))

    def ask(self, body: Generation, question: str) -> RequestHandle:
        """A question about a document given to /v1/documents, as `Runtime.ask` asks it."""
        assert body.document_id is not None
        document = self.document(body.document_id)
        prompt = self.runtime.question_prompt(document, question)
        limit = self._fits(body, len(prompt))
        options = _options(body, limit)
        return self.admit(lambda: self.runtime.submit(prompt, after_prefix_of=document, **options))

    def document(self, doc_id: str) -> RequestHandle:
        handle = self.documents.get(doc_id)
        if handle is None:
            raise ApiError(404, f"no document {doc_id!r}", "not_found_error")
        return handle

    def admit(self, submit: Callable[[], RequestHandle]) -> RequestHandle:
        """Submit unless the server is stopping (503) or its queue is full (429)."""
        if not self.runtime.accepting:
            raise ApiError(503, "the server is shutting down", "server_error")
        self._in_flight = [h for h in self._in_flight if not h.done]
        waiting = len(self._in_flight) - self.runtime.backend.capacity.n_seq_max
        if self.max_queue is not None and waiting >= self.max_queue:
            raise ApiError(
                429, f"{waiting} requests are waiting (--max-queue {self.max_queue}): retry "
                "later", "rate_limit_error", retry_after_s=1,
            )  # fmt: skip
        try:
            handle = submit()
        except ValueError as e:  # token ids out of the vocabulary
            raise ApiError(400, str(e), param="prompt") from None
        except RuntimeError:  # stopped between the check and the submit
            raise ApiError(503, "the server is shutting down", "server_error") from None
        self._in_flight.append(handle)
        return handle

    def _fits(self, body: Generation, n_tokens: int) -> int:
        """The model asked for is this one, and prompt and answer fit one sequence's
        context (vLLM refuses the same requests, with 404 and 400). Returns the most tokens
        to generate: as asked, or by default as many as fit, up to MAX_TOKENS_DEFAULT."""
        if body.model is not None and body.model != self.model_id:
            raise ApiError(
                404, f"the model {body.model!r} does not exist: this server has "
                f"{self.model_id!r}", "not_found_error", "model",
            )  # fmt: skip
        n_ctx = self.runtime.backend.capacity.n_ctx_seq
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


def _options(body: Generation, max_tokens: int) -> dict[str, Any]:
    return {
        "max_tokens": max_tokens,
        "cls": body.cls,
        "sampling": body.sampling(),
        "ttft_target_s": None if body.ttft_target_ms is None else body.ttft_target_ms / 1e3,
        "ignore_eos": body.ignore_eos,
    }
