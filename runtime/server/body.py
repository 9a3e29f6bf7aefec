"""A request's JSON body: its type checked, its size bounded in values before it is parsed,
then parsed and validated by pydantic in one call, off the event loop when it is large.

Why each step: a body of 8 MiB can hold 4 million JSON values. Parsed whole, one of them
took 4.5 GB and 24 s on the event loop (FastAPI turned pydantic's error per item into a
dict each). Here a large body's values are counted first (`json_values`: byte counts and,
where text holds commas, one C regex pass; ~10-90 ms for 8 MiB), and past what any request
this server can take holds, it is refused before anything is built. What passes is parsed
by pydantic's own JSON parser, and its lists stop at their first bad item (`fail_fast`),
so an error is one error. Both steps hold the GIL, so "off the loop" bounds rather than
removes their stall: each is one short C call on a body the count has already bounded.

A body must say it is JSON (`Content-Type: application/json` or `+json`): a web page may
POST without a preflight only as a form or plain text, so a loopback server that parsed
those would run requests for any page the user opens."""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import Executor
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from edgeprefill.runtime.server.errors import ApiError, validation_error

M = TypeVar("M", bound=BaseModel)

# Below this a body is parsed on the loop (a few hundred microseconds at most): the hop to
# a worker thread would cost more than it saves.
INLINE_BYTES = 64 << 10
# Values a request may hold beyond its prompt's token ids: messages, their parts and the
# options (4,096 messages of a few fields each, with room to spare).
STRUCTURE_VALUES = 1 << 16

# A JSON string, escapes included: replaced by "" where commas in text are to be left out.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_values(raw: bytes, most: int) -> int:
    """An upper bound on the values in a JSON text, exact enough to compare with `most`:
    every value after a container's first follows a comma, and every container opens with
    a bracket. Counted in the raw text first; only where that passes `most` (commas in
    text) are strings left out, and only once their quotes show at most `most` of them:
    replacing each string allocates, and 2 million one-letter strings took 390 MB."""
    n = _structure(raw)
    if n <= most:
        return n
    if (quotes := raw.count(b'"')) > 2 * most:
        return quotes // 2
    return _structure(_STRING.sub(b'""', raw))


def _structure(text: bytes) -> int:
    return text.count(b",") + text.count(b"[") + text.count(b"{") + 1


class BodyParser:
    def __init__(self, max_token_ids: int, worker: Executor) -> None:
        """`max_token_ids`: the longest prompt this server can take (a sequence's context),
        which bounds a body's values with `STRUCTURE_VALUES`."""
        self.max_values = max_token_ids + STRUCTURE_VALUES
        self.worker = worker

    async def parse(self, request: Request, model: type[M]) -> M:
        _check_json(request.headers.get("content-type"))
        try:
            raw = await request.body()
        except ClientDisconnect:
            raise ApiError(400, "the client closed the connection before its body") from None
        if len(raw) <= INLINE_BYTES:
            return self.validate(raw, model)
        return await asyncio.get_running_loop().run_in_executor(
            self.worker, self.validate, raw, model
        )

    def validate(self, raw: bytes, model: type[M]) -> M:
        if len(raw) > INLINE_BYTES and (n := json_values(raw, self.max_values)) > self.max_values:
            raise ApiError(
                400,
                f"the body holds up to {n} JSON values; a request to this server holds at "
                f"most {self.max_values} (its context's tokens, plus {STRUCTURE_VALUES} for "
                "the rest)",
            )
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            raise validation_error(e.errors(include_url=False, include_input=False)) from None


def _check_json(content_type: str | None) -> None:
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind != "application/json" and not (
        kind.startswith("application/") and kind.endswith("+json")
    ):
        raise ApiError(
            415,
            f"the body's Content-Type is {content_type or 'missing'}: send it as "
            "'Content-Type: application/json'",
        )


def request_body_schemas(models: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """OpenAPI's pieces for routes whose bodies are parsed here rather than by FastAPI:
    the components (each model and the models it holds) and each route's request body."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema(
        [(m, "validation") for m in models.values()], ref_template="#/components/schemas/{model}"
    )
    bodies = {
        path: {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{m.__name__}"}}
            },
        }
        for path, m in models.items()
    }
    return {"components": top.get("$defs", {}), "bodies": bodies}
