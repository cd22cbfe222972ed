"""The one place where failures become HTTP answers, in OpenAI's error shape.

``{"error": {"message", "type", "param", "code"}}``: 400 for bad parameters and for a
context that is too long, 401 for a wrong or missing key, 404 for an unknown model or
route, 413 for a body over the limit, 429 with ``Retry-After`` when the queue is full, 503
while the engine stops or after it failed. A 5xx means a bug or a failed backend, never a
client's input.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from amplituhedron_rs.serve.protocol import error_body


class APIError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def queue_full(message: str, retry_after_s: int = 1) -> APIError:
    return APIError(
        429,
        message,
        "rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        "authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def engine_error(message: str, status: int = 500) -> APIError:
    """A generation the backend could not finish: a model error (500), or a failed station
    behind the server (502, from the mesh backend)."""
    return APIError(status, message, "server_error")


def edge_refusal(status: int, message: str, headers: dict[str, str]) -> JSONResponse:
    """A refusal by the HTTP edge, before any route (a missing key, an oversized body), in
    OpenAI's error shape."""
    if status == 401:
        e = APIError(status, message, "authentication_error", code="invalid_api_key")
    else:
        e = APIError(status, message, code="request_too_large" if status == 413 else None)
    e.headers = headers
    return _response(e)


def _response(e: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers
    )


#: Parts of a validation error's location that name a union member, not a field.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [
        str(p)
        for p in loc
        if p not in ("body", "query", "header")
        and not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))
    ]
    return ".".join(parts) or None


def install(app: FastAPI) -> None:
    """Registers the handlers on ``app``."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # Of a union's failed branches, a validator's own verdict (invalid Unicode, a
        # cross-field rule) says more than "should be a valid list".
        mine = [e for e in errors if e.get("type") == "value_error"]
        first = (mine or errors or [{}])[0]
        loc = tuple(first.get("loc", ()))
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        param = _param(loc)
        # Cross-field checks name their parameter as "param: why".
        head, sep, rest = msg.partition(": ")
        if param is None and sep and head.isidentifier():
            param, msg = head, rest
        # The offending value is never echoed: a body may hold NaN or megabytes of text.
        message = f"{param}: {msg}" if param else msg
        return _response(bad_request(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _response(APIError(exc.status_code, str(exc.detail), type_))
