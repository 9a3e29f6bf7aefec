"""OpenAI's error shape for every refusal: `{"error": {"message", "type", "param", "code"}}`,
with the status that says why (400 bad input, 401 key, 404 unknown, 429 queue full, 503
stopping), for our own refusals, FastAPI's validation errors and Starlette's routing ones."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# Members of a union a value was tried as, in pydantic's error locations: not field names.
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict"}


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


def add_error_handlers(app: FastAPI) -> None:
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
        return await _api_error(_, validation_error(e.errors()))


def validation_error(errors: Sequence[Any]) -> ApiError:
    """A 400 naming the first field pydantic refused: of a union's members, the one the
    value's type matched says what was wrong."""
    first = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
    where = ".".join(str(p) for p in first["loc"] if _is_field(p))
    message = f"{where}: {first['msg']}" if where else str(first["msg"])
    return ApiError(400, message, param=where or None)


def _is_field(part: str | int) -> bool:
    """A part of a validation error's location that names a field or an index, not the body
    itself nor the member of a union it was tried as (pydantic's "str", "list[int]")."""
    if isinstance(part, int):
        return True
    return part != "body" and part.isidentifier() and part not in _TYPE_NAMES
