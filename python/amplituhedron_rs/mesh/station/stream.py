"""The step stream: a station's batched steps over persistent TCP connections (framing in
:mod:`amplituhedron_rs.mesh.protocol`).

Why: a mesh pays each hop once per decoded token at every station. On loopback an HTTP hop
(aiohttp → uvicorn → FastAPI, a worker thread) cost ≈ 0.6 ms of two shared cores before any
compute, and even a framed hop served by asyncio ≈ 0.5 ms of interpreter on cold caches (28
stations share two cores and their L3): more than a one-layer pass. So the listener is Rust
(``_core.StepStream``, see ``rust/mesh``): a thread per connection reads the frames under the
edge rules of the HTTP surface (the mesh token on every frame, checked in constant time
before a byte of header or payload is read; lengths refused past the station's limits before
they are read; a connection cap; keep-alive, header and body deadlines), and runs decode
steps and prompt pieces (all but a prompt's last) of registered sessions on their rings
without Python; at the exit station each session's own sampler (the one Python samples
with) then verifies and emits.

Every other frame (a prompt's last piece, a capture, log-probabilities, a grammar's steps,
anything malformed, a busy session) comes here, to :class:`StepHandler`, in the
connection's thread: the same :class:`~.batch.BatchStepper` call as ``POST /batch/step``,
with the same validation and refusals; only the envelope differs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs.edge.limits import EdgeLimits
from amplituhedron_rs.mesh.station.batch import BatchStepper, parse_step
from amplituhedron_rs.mesh.station.drill import Drill, die, step_phase
from amplituhedron_rs.mesh.station.errors import HANDLED, Full, status_of
from amplituhedron_rs.mesh.station.state import Station

log = logging.getLogger("amplituhedron.station")

#: Label of the step stream in the station's request metrics.
ENDPOINT = "stream:/batch/step"

#: ``(seconds, status)`` of every answered frame (the station's request metrics).
Observe = Callable[[float, int], None]


class StepHandler:
    """Answers the frames the Rust fast path declines: ``(head, payload, received) →
    (status, header, payload)``, called from a connection's thread (which may wait for a
    busy session). Never raises: a failure is the frame's answer."""

    def __init__(
        self,
        stepper: Callable[[], BatchStepper],
        *,
        drill: Drill | None = None,
        observe: Observe | None = None,
    ) -> None:
        self.stepper = stepper
        self.drill = drill
        self.observe = observe

    def __call__(self, head: bytes, payload: bytes, received: float) -> tuple[int, bytes, bytes]:
        try:
            reply, out = self.stepper().run(parse_step(head), payload, received=received)
            status = 200
        except Exception as exc:
            (status, reply), out = status_and_detail(exc), b""
        if self.drill is not None and self.drill.hit(step_phase(head)):
            die()  # TEST-ONLY (AMPLITUHEDRON_TEST_DIE_ON): the work is done, no answer leaves
        if self.observe is not None:
            self.observe(time.monotonic() - received, status)
        return status, reply, out


def status_and_detail(exc: Exception) -> tuple[int, bytes]:
    """A failed step's status and ``{"detail": …}`` header."""
    if isinstance(exc, HANDLED):
        status = status_of(exc)
    else:
        log.exception("a streamed step failed", exc_info=exc)
        status = 500
    detail: dict[str, Any] = {"detail": str(exc)}
    if isinstance(exc, Full):
        detail["retry_after"] = exc.retry_after
    return status, json.dumps(detail).encode()


def open_stream(
    station: Station, handler: StepHandler, limits: EdgeLimits, *, fast: bool = True
) -> _core.StepStream:
    """Listens on the station's stream host and port (0: any free port) and lets the stream
    step the station's sessions. ``fast`` False sends every frame to ``handler``."""
    s = station.settings
    stream = _core.StepStream(
        station.weights,
        s.layer_lo,
        s.layer_hi,
        s.stream_host,
        s.stream_port or 0,
        token=None if s.token is None else s.token.encode(),
        handler=handler,
        max_rows=int(station.max_rows),
        max_logits_rows=s.max_logits_rows,
        max_json_bytes=limits.max_json_bytes,
        max_octet_bytes=limits.max_octet_bytes,
        max_connections=limits.max_connections,
        keepalive_s=limits.keepalive_s,
        header_timeout_s=limits.header_timeout_s,
        body_timeout_s=limits.body_timeout_s,
        fast=fast,
    )
    station.attach_stream(stream)
    return stream
