"""The coordinator's end of the step stream (framing in :mod:`.protocol`): pooled persistent
TCP connections to each station's ``stream_port``, one request in flight per connection.

A hop here is a write and a read on a connection that stays open: no HTTP client, no
request object, no task per request. What fails is reported as :class:`StreamError` (no
answer: refused, reset, closed, timed out), which the caller turns into the station's
failure.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from typing import cast

from amplituhedron_rs.mesh.protocol import STREAM_MAGIC, STREAM_PREFIX, stream_request

#: A pooled connection idle this long is closed rather than reused: the stations close
#: theirs after 30 s, and a connection the station has just closed must never be reused.
IDLE_S = 15.0


class StreamError(ConnectionError):
    """No answer on the step stream (refused, reset, closed, or not within the deadline)."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


@dataclass(frozen=True)
class StreamReply:
    """An answer frame: the status, the JSON header and the payload."""

    status: int
    head: bytes
    payload: bytes


class _Client(asyncio.Protocol):
    """One connection; ``send`` one request, await its answer, then the next."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[StreamReply] | None = None
        self.closed = False
        self.idle_since = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(StreamError(f"the connection closed{f': {exc!r}' if exc else ''}"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) < STREAM_PREFIX.size:
            return
        magic, status, n_head, n_payload = STREAM_PREFIX.unpack_from(self.buf)
        if magic != STREAM_MAGIC:
            self._fail(StreamError("the station answered something that is not a frame"))
            self.close()
            return
        end = STREAM_PREFIX.size + n_head + n_payload
        if len(self.buf) < end:
            return
        at = STREAM_PREFIX.size
        reply = StreamReply(
            status, bytes(self.buf[at : at + n_head]), bytes(self.buf[at + n_head : end])
        )
        del self.buf[:end]
        waiter, self.waiter = self.waiter, None
        if waiter is None or waiter.done():
            self.close()  # an answer nobody asked for: the connection is out of step
        else:
            waiter.set_result(reply)

    def _fail(self, exc: StreamError) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def request(self, frame: bytes, timeout: float) -> StreamReply:
        assert self.transport is not None and self.waiter is None
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        self.transport.write(frame)

        def expired() -> None:
            self._fail(StreamError(f"no answer within {timeout:g} s", timeout=True))

        timer = loop.call_later(timeout, expired)
        try:
            reply: StreamReply = await waiter
            return reply
        except BaseException:
            # Timed out, failed or cancelled mid-request: the connection is out of step.
            self.close()
            raise
        finally:
            timer.cancel()
            self.waiter = None
            self.idle_since = time.monotonic()


class StreamPool:
    """Idle connections per station address, opened on demand."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[_Client]] = {}

    async def call(
        self,
        host: str,
        port: int,
        token: bytes,
        head: bytes,
        payload: bytes | memoryview,
        timeout: float,
    ) -> StreamReply:
        """One request on a pooled (or new) connection to ``host:port``, answered within
        ``timeout`` seconds; StreamError if there is no answer."""
        started = time.monotonic()
        conn = self._take((host, port))
        if conn is None:
            loop = asyncio.get_running_loop()
            try:
                _, conn = await asyncio.wait_for(
                    loop.create_connection(_Client, host, port), timeout
                )
                assert conn is not None
            except TimeoutError as exc:
                raise StreamError(f"no connection within {timeout:g} s", timeout=True) from exc
            except OSError as exc:
                raise StreamError(f"cannot connect: {exc!r}") from exc
        left = max(0.001, timeout - (time.monotonic() - started))
        reply = await conn.request(stream_request(token, head, payload), left)
        if not conn.closed:
            self._idle.setdefault((host, port), []).append(conn)
        return reply

    def _take(self, where: tuple[str, int]) -> _Client | None:
        idle = self._idle.get(where)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        return None

    def forget(self, host: str, port: int) -> None:
        """Closes the idle connections to ``host:port`` (its station failed)."""
        for conn in self._idle.pop((host, port), []):
            conn.close()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
