"""What a station answers when it refuses a request: the one table from exception type to
HTTP status, and the one function that turns an exception into the answer. The routes,
the dependencies and the decode fast path all raise; nothing reads a message to choose a
status."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse

from amplituhedron_rs._core import (
    AmplituhedronError,
    CacheError,
    InputError,
    MeshError,
    ModelError,
    RingError,
)


class StationError(Exception):
    """A request the station refuses for a reason of its own (the subclass says which)."""


class BadBody(StationError):
    """The body is not what the endpoint takes (size, dtype, row count)."""


class Forbidden(StationError):
    """Authenticated or not, something this station never allows (a tenant on an open
    station)."""


class NotFound(StationError):
    """No such session (closed, expired, or never opened)."""


class Conflict(StationError):
    """Well-formed, but at odds with the station or the session (wrong layer range, a
    prefix hash of other tokens, a session that is not fresh, a capture of a session whose
    positions are not its prompt)."""


class Busy(Conflict):
    """Another request holds the session; retry."""


class Cancelled(StationError):
    """The client disconnected; its work stopped at a chunk boundary (nobody reads this)."""


class TooLarge(StationError):
    """The body exceeds the station's limit."""


class Full(StationError):
    """No room for another session now (session count or memory budget); retry later."""

    retry_after = 1


#: Most specific class first is not needed: :func:`status_of` walks the MRO.
STATUS: dict[type[Exception], int] = {
    BadBody: 400,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    TooLarge: 413,
    Cancelled: 499,
    Full: 503,
    InputError: 422,
    RingError: 409,
    CacheError: 409,
    ModelError: 500,
    MeshError: 502,
    AmplituhedronError: 500,
}


def status_of(exc: Exception) -> int:
    """The HTTP status of a refusal, by the exception's type (500 if unlisted)."""
    for cls in type(exc).__mro__:
        status = STATUS.get(cls)
        if status is not None:
            return status
    return 500


def error_response(exc: Exception) -> JSONResponse:
    """The answer to a refused request: FastAPI's ``{"detail": …}`` shape (with
    ``Retry-After`` on back-pressure; the edge answers a missing token itself)."""
    headers = {}
    if isinstance(exc, Full):
        headers["Retry-After"] = str(exc.retry_after)
    return JSONResponse({"detail": str(exc)}, status_code=status_of(exc), headers=headers)


def _json_safe(value: Any) -> Any:
    """A validation error's echoed input, renderable as strict JSON (a NaN the client sent
    must not turn the 422 into a 500)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def validation_response(errors: Sequence[Any]) -> JSONResponse:
    """FastAPI's 422 for a request that fails its model, rendered safely."""
    return JSONResponse({"detail": _json_safe(list(errors))}, status_code=422)


#: The exception types the app answers through :func:`error_response`.
HANDLED: tuple[type[Exception], ...] = (StationError, AmplituhedronError)
