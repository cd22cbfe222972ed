"""uvicorn, bounded: a connection cap and read deadlines that uvicorn lacks.

uvicorn's ``limit_concurrency`` answers 503 only once a request head is complete, so
thousands of idle connections that never send one hold a file descriptor each until the
process runs out (and then nobody, authorised or not, gets in). The protocol here:

- arms a deadline for a complete request head when a connection opens and whenever it
  starts a new request, and one for the body once the head is in; a missed deadline closes
  the connection;
- caps open connections: at the cap, the oldest connection with no request in flight (idle
  or still sending its head) is closed to make room, so a flood of idle sockets cannot lock
  out clients that send requests; if every connection is busy, the new one gets a 503;
- raises the process's open-file limit to what the cap needs.
"""

from __future__ import annotations

import asyncio
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from amplituhedron_rs.edge.limits import EdgeLimits

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 29\r\nConnection: close\r\n\r\ntoo many connections; retry\r\n"
)
#: File descriptors kept free beyond the connection cap (model files, logs, sockets out).
_FD_RESERVE = 256


def guarded_protocol(limits: EdgeLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits``' cap and deadlines."""

    class Guarded(HttpToolsProtocol):
        # When this connection opened or went idle (no request in flight); None while a
        # request is served.
        _idle_since: float | None
        _deadline: asyncio.TimerHandle | None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._idle_since = time.monotonic()
            self._deadline = None
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections and not self._evict_one():
                self.connections.discard(self)
                transport.write(_BUSY)
                transport.close()
                return
            self._arm(limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm(limits.header_timeout_s)

        def on_headers_complete(self) -> None:
            # A request is in flight from here: a connection still sending its head can
            # be evicted, one being served cannot.
            self._idle_since = None
            super().on_headers_complete()
            self._arm(limits.body_timeout_s)

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self._idle_since = time.monotonic()
            super().on_response_complete()

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def _evict_one(self) -> bool:
            """Closes the oldest other connection with no request in flight."""
            idle = [
                (c._idle_since, c)
                for c in self.connections
                if isinstance(c, Guarded) and c is not self and c._idle_since is not None
            ]
            if not idle:
                return False
            _, oldest = min(idle, key=lambda pair: pair[0])
            oldest.connections.discard(oldest)
            oldest.transport.close()
            return True

    return Guarded


def raise_fd_limit(limits: EdgeLimits) -> None:
    """Lifts the soft open-file limit toward the hard one, enough for the cap if allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = limits.max_connections + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))


def run(app: Any, host: str, port: int, limits: EdgeLimits, **uvicorn_kwargs: Any) -> None:
    """Serves ``app`` until interrupted, within ``limits``."""
    import uvicorn

    raise_fd_limit(limits)
    uvicorn.run(
        app,
        host=host,
        port=port,
        http=guarded_protocol(limits),
        timeout_keep_alive=int(max(1, limits.keepalive_s)),
        **{"log_level": "warning", "access_log": False, **uvicorn_kwargs},
    )
