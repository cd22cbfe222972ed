"""The decode step's fast path: well-formed decode calls are served straight from ASGI."""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from starlette.responses import Response

from amplituhedron_rs.mesh.protocol import DECODE_ROUTE, OCTETS
from amplituhedron_rs.mesh.station.errors import HANDLED, Busy, error_response
from amplituhedron_rs.mesh.station.session import Octets
from amplituhedron_rs.mesh.station.state import Station

# Only well-formed ids (never percent-decoded); anything else goes to the route's 422.
_DECODE_PATH = re.compile(r"/sessions/([A-Za-z0-9_-]{16,64})/decode")
_DECODE_PARAMS = {
    "logits": ("none", "last"),
    "hidden": ("all", "last", "none"),
    "sample": ("true", "false"),
}


@dataclass(frozen=True)
class _RouteLabel:
    """Stands in for the matched route in the ASGI scope (metrics label it by path)."""

    path: str


class DecodeFastPath:
    """Serves well-formed decode steps straight from ASGI, skipping FastAPI's per-request
    dependency and validation machinery (about 0.15 ms of a 0.4 ms loopback round trip,
    paid on every token at every station).

    Only unambiguous calls take this path: POST, a well-formed session id, at most one valid
    value per known query parameter (the body was bounded and authenticated by the outer
    middleware). Anything else is handed, body intact, to the FastAPI route, which stays the
    single definition of the endpoint (and of its 4xx answers); refusals raised by the step
    itself are answered by the same :func:`~.errors.error_response` the app's exception
    handlers use.

    A lone step runs on the event loop: one row is a few milliseconds of Rust (GIL released,
    both cores via rayon), less than a thread hand-off on every decoded token would cost.
    Under load (other compute in flight) or on a busy session it runs in a worker instead,
    so the event loop never waits for a lock nor queues steps behind each other (``/healthz``
    stays fast).
    """

    def __init__(self, app: Any, station: Station) -> None:
        self.app = app
        self.station = station

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        match = (
            _DECODE_PATH.fullmatch(scope["path"])
            if scope["type"] == "http" and scope["method"] == "POST"
            else None
        )
        params = self._params(scope) if match else None
        if match is None or params is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # disconnect: let the app see it
                await self.app(scope, _replay(b"".join(chunks), message), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        scope["route"] = _RouteLabel(DECODE_ROUTE)
        sid, body = match.group(1), b"".join(chunks)

        def in_worker() -> Octets:
            return self.station.decode_step(sid, body, **params)

        response: Response
        try:
            out: Octets | None = None
            if self.station.inflight == 0:
                try:
                    out = self.station.decode_step(sid, body, wait=0, **params)
                except Busy:
                    out = None
            if out is None:
                out = await anyio.to_thread.run_sync(in_worker)
            response = Response(out.body, media_type=OCTETS, headers=out.headers)
        except HANDLED as exc:
            response = error_response(exc)
        await response(scope, receive, send)

    @staticmethod
    def _params(scope: Any) -> dict[str, Any] | None:
        query = scope["query_string"].decode("latin-1")
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True) if query else []
        params: dict[str, Any] = {"logits": "last", "hidden": "all", "sample": "false"}
        seen: set[str] = set()
        for key, value in pairs:
            if key not in _DECODE_PARAMS or key in seen or value not in _DECODE_PARAMS[key]:
                return None
            seen.add(key)
            params[key] = value
        params["sample"] = params["sample"] == "true"
        return params


def _replay(body: bytes, last: Any) -> Any:
    """A `receive` that hands an already-read body back to the app, then `last`."""
    sent = False

    async def receive() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return last

    return receive
