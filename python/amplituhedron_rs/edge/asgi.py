"""ASGI guards that run before any route: bearer-token authentication (before a byte of the
body is read) and body limits counted as the body streams (a chunked body has no
Content-Length to trust). Pure ASGI, no per-request task or body copy beyond the one
buffer a route reads anyway. Each surface renders refusals in its own error shape through a
:data:`Responder`."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Collection, Sequence
from typing import Any

#: Builds a surface's error answer (an ASGI app) from a status, a message and headers.
Responder = Callable[[int, str, dict[str, str]], Any]

OCTETS = b"application/octet-stream"


def _header(scope: Any, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == name), None)


def matching_key(authorization: bytes | None, keys: Sequence[bytes]) -> int | None:
    """Index of the key an ``Authorization: Bearer <key>`` header carries, or None. Every
    key is compared in constant time, as bytes: any header value is answerable."""
    if authorization is None or not authorization.startswith(b"Bearer "):
        return None
    given = authorization[len(b"Bearer ") :]
    found = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(given, key) and found is None:
            found = i
    return found


class BearerAuth:
    """A bearer key on every request but ``open_paths``: one check for the whole app, so no
    route (/docs, /openapi.json, /metrics, a 404, a fast path) is left out. The refusal
    closes the connection, so an unauthenticated body is never read."""

    def __init__(
        self,
        app: Any,
        keys: Sequence[bytes],
        open_paths: Collection[str],
        respond: Responder,
        what: str = "key",
    ) -> None:
        self.app = app
        self.keys = list(keys)
        self.open_paths = frozenset(open_paths)
        self.respond = respond
        self.what = what

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization")
        if given is None or not given.startswith(b"Bearer "):
            message = f"missing {self.what}: send 'Authorization: Bearer <{self.what}>'"
        elif matching_key(given, self.keys) is None:
            message = f"invalid {self.what}"
        else:
            await self.app(scope, receive, send)
            return
        headers = {"WWW-Authenticate": "Bearer", "Connection": "close"}
        await self.respond(401, message, headers)(scope, receive, send)


class BodyLimit:
    """Reads the body, counted as it streams, and refuses it with 413 as soon as it passes
    the limit (octet bodies get ``octet_limit``, anything else ``json_limit``); the app then
    reads the buffered body. Place it inside :class:`BearerAuth`, so an unauthenticated
    client cannot make it buffer."""

    def __init__(self, app: Any, json_limit: int, octet_limit: int, respond: Responder) -> None:
        self.app = app
        self.json_limit = json_limit
        self.octet_limit = octet_limit
        self.respond = respond

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await self._read_body(scope, receive)
        if isinstance(body, str):
            await self.respond(413, body, {"Connection": "close"})(scope, receive, send)
        elif body is not None:
            await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, scope: Any, receive: Any) -> bytes | str | None:
        """The whole body, the refusal's message, or None if the client left meanwhile."""
        content_type = _header(scope, b"content-type") or b""
        octets = content_type.split(b";")[0].strip() == OCTETS
        limit, what = (self.octet_limit, "octet") if octets else (self.json_limit, "JSON")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return f"body of {int(length)} bytes exceeds the {limit}-byte limit of {what} bodies"
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return f"body exceeds the {limit}-byte limit of {what} bodies"
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the buffered body to the app, then the client's own
    messages (a disconnect)."""
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
