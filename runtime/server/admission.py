"""What the server lets into the runtime: the model asked for, prompt and answer within one
sequence's context, token ids within the vocabulary, each class's queue under its limit
(a backlog of documents must not turn chats away), and no new request once shutdown began
or the engine failed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from edgeprefill.runtime.api.handle import RequestHandle
from edgeprefill.runtime.api.runtime import Runtime
from edgeprefill.runtime.core.contract import Tokenizer
from edgeprefill.runtime.core.request import RequestClass, SamplingParams
from edgeprefill.runtime.server.errors import ApiError
from edgeprefill.runtime.server.schema import ChatRequest, Generation
from edgeprefill.runtime.server.tools import ToolUse


@dataclass(frozen=True)
class QueueLimits:
    """The most requests of each class that may wait for a sequence; past it, 429. Chats
    are bounded by the connections they hold; documents hold none once answered 202."""

    foreground: int | None = None
    background: int | None = 256


class Admission:
    def __init__(self, runtime: Runtime, model_id: str, limits: QueueLimits) -> None:
        self.runtime, self.model_id, self.limits = runtime, model_id, limits
        self._in_flight: list[RequestHandle] = []
        self._piece_bytes = _longest_piece(runtime.backend.tokenizer)

    def check(self, body: Generation) -> None:
        """Before any work: the model is this one, and the class's queue has room."""
        if body.model is not None and body.model != self.model_id:
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist: this server has {self.model_id!r}",
                "not_found_error",
                "model",
            )
        self.check_queue(body.cls)

    def check_queue(self, cls: RequestClass) -> None:
        if not self.runtime.accepting:
            raise ApiError(503, self.runtime.refusal, "server_error")
        limit = getattr(self.limits, cls)
        self._in_flight = [h for h in self._in_flight if not h.done]
        # Counted from what was submitted, not from the engine's view, which lags.
        held = sum(h.request.cls == cls for h in self._in_flight)
        waiting = held - self.runtime.backend.capacity.n_seq_max
        if limit is not None and waiting >= limit:
            flag = "--max-queue" if cls == "foreground" else "--max-document-queue"
            raise ApiError(
                429,
                f"{waiting} {cls} requests are waiting ({flag} {limit}): retry later",
                "rate_limit_error",
                retry_after_s=1,
            )

    def sampling(self, body: Generation, tool_use: ToolUse | None = None) -> SamplingParams:
        """The body's sampling (its answer's format the tools' calls where it calls tools),
        refused with a 400 naming the field where the backend cannot sample so. Off the
        event loop: an output format's grammar is built here."""
        sampling = body.sampling()
        if tool_use is not None:
            sampling = replace(sampling, output_format=tool_use.output_format())
        n_vocab = self.runtime.backend.tokenizer.vocab_size
        bad = next((t for t, _ in sampling.logit_bias if t >= n_vocab), None)
        if bad is not None:
            raise ApiError(
                400,
                f"logit_bias names token {bad}; the vocabulary has {n_vocab}",
                param="logit_bias",
            )
        try:
            self.runtime.backend.check_sampling(sampling)
        except ValueError as e:
            param = "tools" if tool_use is not None else "response_format"
            raise ApiError(400, str(e), param=param) from None
        return sampling

    def submit(
        self,
        body: Generation,
        prompt: list[int],
        sampling: SamplingParams,
        after_prefix_of: RequestHandle | None = None,
    ) -> RequestHandle:
        param = "messages" if isinstance(body, ChatRequest) else "prompt"
        limit = self._fits(body, len(prompt), param)
        return self._admit(
            lambda: self.runtime.submit(
                prompt,
                max_tokens=limit,
                cls=body.cls,
                sampling=sampling,
                ttft_target_s=None if body.ttft_target_ms is None else body.ttft_target_ms / 1e3,
                ignore_eos=body.ignore_eos,
                after_prefix_of=after_prefix_of,
            ),
            body.cls,
        )

    def check_text(self, n_chars: int, param: str) -> None:
        """Refuse text that cannot fit a sequence's context before it is tokenized: a token
        covers at most the vocabulary's longest piece, and a character at least one byte,
        so text of more characters than the context times that piece has more tokens
        than the context holds."""
        n_ctx = self.runtime.backend.capacity.n_ctx_seq
        if n_chars > n_ctx * self._piece_bytes:
            raise ApiError(
                400,
                f"the text has {n_chars} characters, more than this server's context of "
                f"{n_ctx} tokens can hold; split it",
                param=param,
            )

    def submit_document(
        self, prompt: list[int], kept: int, max_tokens: int, param: str
    ) -> RequestHandle:
        """A document to read in the background, refused up front when it and its answer
        cannot fit one sequence's context (it would fail only once its turn came)."""
        n_ctx = self.runtime.backend.capacity.n_ctx_seq
        if len(prompt) + max_tokens > n_ctx:
            raise ApiError(
                400,
                f"the document's prompt has {len(prompt)} tokens and its answer up to "
                f"{max_tokens}: this server's context holds {n_ctx} per request; split it",
                param=param,
            )
        options: dict[str, Any] = {"cls": "background", "share_prefix": kept}
        return self._admit(
            lambda: self.runtime.submit(prompt, max_tokens=max_tokens, **options),
            "background",
        )

    def _admit(self, submit: Callable[[], RequestHandle], cls: RequestClass) -> RequestHandle:
        """Submit unless the server is stopping or failed (503) or the class's queue is
        full (429): checked again, since tokenizing took a while."""
        self.check_queue(cls)
        try:
            handle = submit()
        except ValueError as e:  # token ids out of the vocabulary
            raise ApiError(400, str(e), param="prompt") from None
        except RuntimeError:  # stopped or failed between the check and the submit
            raise ApiError(503, self.runtime.refusal, "server_error") from None
        self._in_flight.append(handle)
        return handle

    def _fits(self, body: Generation, n_tokens: int, param: str) -> int:
        """Prompt and answer fit one sequence's context (vLLM refuses the same requests
        with 400). Returns the most tokens to generate: as asked, or by default as many as
        fit, up to MAX_TOKENS_DEFAULT."""
        n_ctx = self.runtime.backend.capacity.n_ctx_seq
        if n_tokens >= n_ctx:
            raise ApiError(
                400,
                f"the prompt has {n_tokens} tokens; this server's context holds {n_ctx} per "
                "request",
                param=param,
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


def _longest_piece(tokenizer: Tokenizer) -> int:
    """Bytes of the vocabulary's longest token, read once as the server starts; at least
    32, for the text of control tokens, which their pieces leave out."""
    return max(32, max(len(tokenizer.piece(t)) for t in range(tokenizer.vocab_size)))
