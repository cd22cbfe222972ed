"""What a station answers when it refuses a request: the one table from exception type to
HTTP status, and the one function that turns an exception into the answer. The routes,
the dependencies and the decode fast path all raise; nothing reads a message to choose a
status."""

from __future__ import annotations

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


class Unauthorized(StationError):
    """A control endpoint without the right bearer token."""


class NotFound(StationError):
    """No such session (closed, expired, or never opened)."""


class Conflict(StationError):
    """Well-formed, but at odds with the station or the session (wrong layer range, a
    prefix hash of other tokens, a session that already exists or is not fresh)."""


class TooLarge(StationError):
    """The body exceeds the station's limit."""


class Full(StationError):
    """No room for another session now; retry later."""


#: Most specific class first is not needed: :func:`status_of` walks the MRO.
STATUS: dict[type[Exception], int] = {
    BadBody: 400,
    Unauthorized: 401,
    NotFound: 404,
    Conflict: 409,
    TooLarge: 413,
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
    """The answer to a refused request: FastAPI's ``{"detail": …}`` shape."""
    return JSONResponse({"detail": str(exc)}, status_code=status_of(exc))


#: The exception types the app answers through :func:`error_response`.
HANDLED: tuple[type[Exception], ...] = (StationError, AmplituhedronError)
