"""The step stream: a station's batched steps over persistent TCP connections (framing in
:mod:`amplituhedron_rs.mesh.protocol`).

Why: on loopback an HTTP hop (aiohttp → uvicorn → FastAPI, a worker thread) costs ≈ 0.6 ms
of two shared cores before any compute, five times a framed hop on a raw connection; at 28
stations per token that was most of a decoded token's time. The step is the same
:class:`~.batch.BatchStepper` call as ``POST /batch/step``, with the same validation; only
the envelope differs.

The edge rules of the HTTP surface (:mod:`amplituhedron_rs.edge`) hold here too:

- every frame carries the mesh token, compared in constant time as soon as the fixed prefix
  and the token are in, before a byte of header or payload is read or buffered;
- the header and payload lengths are declared in the prefix and refused (413) past the
  station's JSON and octet limits before they are read; reading stops (``pause_reading``)
  while a frame is handled, so a connection buffers at most one frame;
- a refusal of the frame itself (magic, token, lengths) closes the connection;
- open connections are capped (the oldest idle one is closed to make room, else the new one
  gets a 503 frame); an idle connection closes after the keep-alive, a frame whose prefix or
  body dribbles in after the header or body deadline.

A small decode step (decode rows only, nothing else computing, every session free) runs on
the event loop: a one-row step is a fraction of a millisecond of Rust, less than the hand-off
to a worker thread and back. Anything else runs in a worker thread, which alone waits for a
busy session (the event loop never does).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import time
from collections.abc import Callable
from typing import Any, cast

import anyio.to_thread

from amplituhedron_rs.edge.limits import EdgeLimits
from amplituhedron_rs.mesh.protocol import (
    MAX_TOKEN_BYTES,
    STREAM_MAGIC,
    STREAM_PREFIX,
    BatchStepRequest,
    stream_reply,
)
from amplituhedron_rs.mesh.station.batch import BatchStepper, parse_step
from amplituhedron_rs.mesh.station.drill import Drill, die, step_phase
from amplituhedron_rs.mesh.station.errors import HANDLED, BadBody, Busy, Full, status_of
from amplituhedron_rs.mesh.station.state import Station

log = logging.getLogger("amplituhedron.station")

#: Rows a step may carry and still run on the event loop (decode rows: a few per sequence).
INLINE_ROWS = 64
#: Label of the step stream in the station's request metrics.
ENDPOINT = "stream:/batch/step"

#: ``(seconds, status)`` of every answered frame (the station's request metrics).
Observe = Callable[[float, int], None]


class StepStreamServer:
    """The listening socket and its connections; ``start`` inside the station's event
    loop, ``close`` at shutdown."""

    def __init__(
        self,
        station: Station,
        stepper: Callable[[], BatchStepper],
        limits: EdgeLimits,
        *,
        drill: Drill | None = None,
        observe: Observe | None = None,
    ) -> None:
        self.station = station
        self.stepper = stepper
        self.limits = limits
        self.token = None if station.settings.token is None else station.settings.token.encode()
        self.drill = drill
        self.observe = observe
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listens on ``host:port`` (0: any free port); returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            c.close()

    def admit(self, conn: _Connection) -> bool:
        """Makes room for ``conn`` under the connection cap: False if every other
        connection is busy."""
        self.connections.add(conn)
        if len(self.connections) <= self.limits.max_connections:
            return True
        idle = [c for c in self.connections if c is not conn and c.idle_since is not None]
        if not idle:
            self.connections.discard(conn)
            return False
        min(idle, key=lambda c: c.idle_since or 0.0).close()
        return True


class _Connection(asyncio.Protocol):
    """One client connection: frames in, answers out, one at a time."""

    def __init__(self, server: StepStreamServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        #: The frame being read: (token, header, payload) lengths once its prefix passed.
        self.frame: tuple[int, int, int] | None = None
        #: A frame is being handled (reading is paused until it is answered).
        self.busy = False
        #: When the connection went idle (no frame started); None while one is in flight.
        self.idle_since: float | None = time.monotonic()
        self._deadline: asyncio.TimerHandle | None = None
        #: The step running in a worker thread, if any.
        self.worker: asyncio.Future[None] | None = None

    # --- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.server.admit(self):
            self._refuse(503, "too many connections; retry", retry_after=1)
            return
        self._arm(self.server.limits.keepalive_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.server.connections.discard(self)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        if self.idle_since is not None and not self.buf and not self.busy:
            # A frame starts: its prefix must be complete within the header deadline.
            self.idle_since = None
            self._arm(self.server.limits.header_timeout_s)
        self.buf += data
        if not self.busy:
            self._advance()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # --- framing ---------------------------------------------------------------------------
    def _advance(self) -> None:
        """Takes the next complete frame off the buffer and handles it; refuses a bad one."""
        limits = self.server.limits
        if self.frame is None:
            if len(self.buf) < STREAM_PREFIX.size:
                return
            magic, n_token, n_head, n_payload = STREAM_PREFIX.unpack_from(self.buf)
            if magic != STREAM_MAGIC:
                self._refuse(400, "not a step-stream frame (see amplituhedron_rs.mesh.protocol)")
                return
            if n_token > MAX_TOKEN_BYTES:
                self._refuse(401, "invalid mesh token")
                return
            if len(self.buf) < STREAM_PREFIX.size + n_token:
                return
            expected = self.server.token
            if expected is not None:
                given = bytes(self.buf[STREAM_PREFIX.size : STREAM_PREFIX.size + n_token])
                if not hmac.compare_digest(given, expected):
                    self._refuse(401, "missing or invalid mesh token")
                    return
            if n_head > limits.max_json_bytes:
                self._refuse(
                    413, f"header of {n_head} bytes exceeds the {limits.max_json_bytes}-byte limit"
                )
                return
            if n_head + n_payload > limits.max_octet_bytes:
                self._refuse(
                    413,
                    f"body of {n_head + n_payload} bytes exceeds the "
                    f"{limits.max_octet_bytes}-byte limit of octet bodies",
                )
                return
            self.frame = (n_token, n_head, n_payload)
            self._arm(limits.body_timeout_s)
        n_token, n_head, n_payload = self.frame
        at = STREAM_PREFIX.size + n_token
        end = at + n_head + n_payload
        if len(self.buf) < end:
            return
        received = time.monotonic()
        head = bytes(self.buf[at : at + n_head])
        payload = bytes(self.buf[at + n_head : end])
        del self.buf[:end]
        self.frame = None
        self._disarm()
        self.busy = True
        assert self.transport is not None
        self.transport.pause_reading()
        self._handle(head, payload, received)

    def _handle(self, head: bytes, payload: bytes, received: float) -> None:
        """Runs the step on the loop when it is small and free, else in a worker."""
        st = self.server.station
        stepper = self.server.stepper()
        try:
            req = parse_step(head)
        except BadBody as exc:
            self._answer_error(exc, head, received)
            return
        if st.inflight == 0 and _small(req):
            try:
                out = stepper.run(req, payload, received=received, wait=0)
            except Busy:
                pass  # nothing changed: the worker waits for the session instead
            except Exception as exc:
                self._answer_error(exc, head, received)
                return
            else:
                self._answer(200, *out, head=head, received=received)
                return
        self.worker = asyncio.ensure_future(self._in_worker(stepper, req, head, payload, received))

    async def _in_worker(
        self,
        stepper: BatchStepper,
        req: BatchStepRequest,
        head: bytes,
        payload: bytes,
        received: float,
    ) -> None:
        try:
            out = await anyio.to_thread.run_sync(
                lambda: stepper.run(req, payload, received=received)
            )
        except Exception as exc:
            self._answer_error(exc, head, received)
        else:
            self._answer(200, *out, head=head, received=received)

    def _answer_error(self, exc: Exception, head: bytes, received: float) -> None:
        if isinstance(exc, HANDLED):
            status = status_of(exc)
        else:
            log.exception("a streamed step failed")
            status = 500
        detail: dict[str, Any] = {"detail": str(exc)}
        if isinstance(exc, Full):
            detail["retry_after"] = exc.retry_after
        self._answer(status, json.dumps(detail).encode(), b"", head=head, received=received)

    def _answer(
        self, status: int, reply: bytes, payload: bytes, *, head: bytes, received: float
    ) -> None:
        """Writes the answer (the drill's doomed request dies here, its work done) and
        reads on."""
        server = self.server
        if server.drill is not None and server.drill.hit(step_phase(head)):
            die()  # TEST-ONLY (AMPLITUHEDRON_TEST_DIE_ON)
        if self.transport is None:  # the client left meanwhile
            return
        self.transport.write(stream_reply(status, reply, payload))
        if server.observe is not None:
            server.observe(time.monotonic() - received, status)
        self.busy = False
        self.transport.resume_reading()
        if self.buf:  # the next frame had started: its deadlines run from now
            self._arm(server.limits.header_timeout_s)
            self._advance()
        else:
            self.idle_since = time.monotonic()
            self._arm(server.limits.keepalive_s)

    def _refuse(self, status: int, message: str, retry_after: int | None = None) -> None:
        """Answers a refusal of the frame itself and closes the connection."""
        body: dict[str, Any] = {"detail": message}
        if retry_after is not None:
            body["retry_after"] = retry_after
        if self.server.observe is not None:
            self.server.observe(0.0, status)
        if self.transport is not None:
            self.transport.write(stream_reply(status, json.dumps(body).encode()))
            self.transport.close()
        self.buf.clear()
        self.frame = None

    # --- deadlines -------------------------------------------------------------------------
    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.busy:
            self.close()


def _small(req: BatchStepRequest) -> bool:
    """Whether a step may run on the event loop: decode rows only (no capture, which may
    wait on the volume cache's lock), a few of them."""
    rows = 0
    for e in req.entries:
        if e.kind != "decode":
            return False
        rows += len(e.tokens)
    return rows <= INLINE_ROWS
