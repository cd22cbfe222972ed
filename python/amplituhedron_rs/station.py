"""A station: one layer range of the model and its sessions' ring buffers, over HTTP.

Stack: FastAPI on uvicorn (ASGI). FastAPI gives typed request models, clear 4xx on bad
input, and an OpenAPI description (which the schemathesis run checks) for free; uvicorn with
httptools/uvloop keeps the per-request cost low. Compute runs in Rust with the GIL released,
in the server's worker threads, so several sessions progress at once.

Control endpoints (SPEC §5, seed 000 §4) and compute endpoints:

- ``POST /amplituhedron/configure``  ``{enabled?, max_entries?, max_prefix_len?, max_bytes?}``
- ``GET  /amplituhedron/stats``, ``POST /amplituhedron/clear`` (also ``/memo/clear``)
- ``POST /amplituhedron/capture?session_id&prefix_hash&prefix_len&layer_lo&layer_hi`` with the
  tail residual (f32 LE; the exit station appends the last position's logits) as the body
- ``POST /amplituhedron/replay`` ``{session_id, prefix_hash, prefix_len, layer_lo, layer_hi}``:
  200 + tail (+ logits) octets on a hit, 204 on a miss
- ``POST /sessions`` (open), ``POST /sessions/{id}/forward`` (a chunk: u32 token ids at the
  entry station, f32 hidden rows elsewhere), ``POST /sessions/{id}/decode`` (one row),
  ``POST /sessions/{id}/rollback``, ``DELETE /sessions/{id}``
- ``GET /healthz``, ``GET /metrics`` (Prometheus), ``GET /openapi.json``

Bad input gets a 4xx whose ``detail`` says what is wrong, and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import threading
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from amplituhedron_rs import _core
from amplituhedron_rs.gguf_file import read_model_file

U64_MAX = 2**64 - 1
HASH_PATTERN = r"^[0-9]{1,20}$"
OCTETS = "application/octet-stream"
OCTET_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}},
    }
}


class StationError(HTTPException):
    """A 4xx/5xx with a message that says what is wrong."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(status_code=status, detail=detail)


@dataclass
class StationSettings:
    """Everything a station is started with."""

    layer_lo: int
    layer_hi: int
    model_path: str | None = None
    token: str | None = None
    max_sessions: int = 8
    session_idle_s: float = 300.0
    max_body_bytes: int = 64 * 1024 * 1024
    max_entries: int = 4
    max_prefix_len: int = 512
    max_bytes: int | None = None
    policy: Literal["pisot", "lru"] = "pisot"
    cache_enabled: bool = True
    slots: int = 4096
    recall: int = 128
    max_chunk: int = 256
    fault_injection: bool = False
    precision: Literal["refined", "fast"] = "refined"
    min_prefix_reuse: int = 16


@dataclass
class LiveSession:
    """A session's ring buffer plus what the station needs to serve it.

    The lock travels with the ring when a closed session's ring is pooled for reuse, so a
    request that still holds the old wrapper serialises with the ring's next owner and then
    sees ``closed``.
    """

    session: _core.RangeSession
    prompt: list[int]
    salt: str | None
    n_sys: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False
    # Exit station only: the session's sampler and the logits of its last position.
    sampler: _core.Sampler | None = None
    last_logits: np.ndarray[Any, np.dtype[np.float32]] | None = None
    # ... and of the prompt's last position (what a capture freezes with the volume).
    prompt_logits: np.ndarray[Any, np.dtype[np.float32]] | None = None

    @contextlib.contextmanager
    def use(self, sid: str) -> Iterator[_core.RangeSession]:
        """Exclusive use of the ring; 404 if the session closed meanwhile."""
        with self.lock:
            if self.closed:
                raise StationError(404, f"session {sid!r} was closed")
            yield self.session


# --- request bodies -----------------------------------------------------------------------


class ConfigureRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool | None = None
    max_entries: int | None = Field(default=None, ge=1, le=1_000_000)
    max_prefix_len: int | None = Field(default=None, ge=1, le=1 << 31)
    max_bytes: int | None = Field(default=None, ge=1, le=1 << 48)
    min_prefix_reuse: int | None = Field(default=None, ge=0, le=1 << 31)


class VolumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str = Field(min_length=1, max_length=128)
    prefix_hash: str = Field(pattern=HASH_PATTERN, description="u64 as a decimal string")
    prefix_len: int = Field(ge=1, le=1 << 31)
    layer_lo: int = Field(ge=0, le=65535)
    layer_hi: int = Field(ge=0, le=65535)


class SamplingSpec(BaseModel):
    """How the exit station samples this session's tokens (one seeded sampler per session,
    so the tokens equal the single-process runtime's for the same parameters)."""

    model_config = ConfigDict(extra="forbid")
    greedy: bool = True
    temperature: float = Field(default=1.0, gt=0, le=1e6)
    top_k: int = Field(default=0, ge=0, le=1 << 31)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int = Field(default=0, ge=0, le=U64_MAX)


class OpenSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_tokens: list[Annotated[int, Field(ge=0, le=2**32 - 1)]] = Field(min_length=1)
    session_id: str | None = Field(default=None, min_length=1, max_length=128)
    n_sys: int = Field(default=0, ge=0, le=1 << 20)
    salt: str | None = Field(default=None, max_length=256)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    clock: int = Field(ge=0, le=U64_MAX)


class FaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_tokens: list[Annotated[int, Field(ge=0, le=2**32 - 1)]] = Field(min_length=1)
    position: int = Field(ge=0)
    salt: str | None = None


# --- the station ----------------------------------------------------------------------------


class Station:
    """State of one station process: weights, pipeline (+ volume cache), sessions."""

    def __init__(
        self, settings: StationSettings, weights: _core.ModelWeights | None = None
    ) -> None:
        self.settings = settings
        if weights is None:
            weights = load_weights(settings.model_path, precision=settings.precision)
        self.weights = weights
        s = settings
        if not 0 <= s.layer_lo < s.layer_hi <= weights.n_layers:
            raise ValueError(
                f"layers {s.layer_lo}:{s.layer_hi} are not a range of 0:{weights.n_layers}"
            )
        self.pipeline = _core.NativeLlamaPipeline(
            weights,
            s.layer_lo,
            s.layer_hi,
            max_entries=s.max_entries,
            max_prefix_len=s.max_prefix_len,
            max_bytes=s.max_bytes,
            policy=s.policy,
        )
        self.pipeline.amplituhedron_enable(s.cache_enabled)
        self.pipeline.amplituhedron_set_min_prefix_reuse(s.min_prefix_reuse)
        self.is_entry = s.layer_lo == 0
        self.is_exit = s.layer_hi == weights.n_layers
        self.hidden = int(weights.hidden)
        self.vocab = int(weights.vocab)
        self.sessions: dict[str, LiveSession] = {}
        self.sessions_lock = threading.Lock()
        # Rings of closed sessions, reset and kept for reuse (by n_sys): a fresh ring's pages
        # are faulted in on first write, which costs more than replaying a volume into it.
        self.pool: dict[int, list[tuple[_core.RangeSession, threading.Lock]]] = {}
        # The pipeline (volume cache) is shared by all sessions; Rust borrows it mutably.
        self.pipeline_lock = threading.Lock()
        self.memo = _core.MatVecMemo()
        self.requests_by_kind: dict[str, int] = {}
        self.forward_rows = 0

    # -- sessions --
    def sweep_idle(self) -> int:
        """Closes sessions idle longer than ``session_idle_s``; returns how many."""
        now = time.monotonic()
        with self.sessions_lock:
            stale = [
                (sid, s)
                for sid, s in self.sessions.items()
                if now - s.last_used > self.settings.session_idle_s and not s.lock.locked()
            ]
            for sid, _ in stale:
                del self.sessions[sid]
        for _, live in stale:
            self._retire(live)
        return len(stale)

    def _retire(self, live: LiveSession) -> None:
        """Marks a removed session closed and pools its ring (bounded) for reuse."""
        with live.lock:
            live.closed = True
            live.session.reset()
            with self.sessions_lock:
                pooled = sum(len(v) for v in self.pool.values())
                if pooled + len(self.sessions) < self.settings.max_sessions:
                    self.pool.setdefault(live.n_sys, []).append((live.session, live.lock))

    def open_session(self, req: OpenSessionRequest) -> tuple[str, LiveSession]:
        self.sweep_idle()
        sid = req.session_id or uuid.uuid4().hex
        with self.sessions_lock:
            if sid in self.sessions:
                raise StationError(409, f"session {sid!r} already exists")
            if len(self.sessions) >= self.settings.max_sessions:
                raise StationError(
                    503,
                    f"station full: {len(self.sessions)} live sessions "
                    f"(max {self.settings.max_sessions}); retry later",
                )
            if req.n_sys > len(req.prompt_tokens):
                raise StationError(
                    422, f"n_sys {req.n_sys} exceeds the {len(req.prompt_tokens)}-token prompt"
                )
            reusable = self.pool.get(req.n_sys)
            if reusable:
                rs, lock = reusable.pop()
            else:
                try:
                    rs = _core.RangeSession(
                        self.weights,
                        self.settings.layer_lo,
                        self.settings.layer_hi,
                        slots=self.settings.slots,
                        recall=self.settings.recall,
                        n_sys=req.n_sys,
                        max_chunk=self.settings.max_chunk,
                    )
                except ValueError as exc:
                    raise StationError(422, str(exc)) from exc
                lock = threading.Lock()
            sampler = None
            if self.is_exit:
                try:
                    sampler = _core.Sampler(**req.sampling.model_dump())
                except ValueError as exc:
                    raise StationError(422, str(exc)) from exc
            live = LiveSession(rs, list(req.prompt_tokens), req.salt, req.n_sys, lock)
            live.sampler = sampler
            self.sessions[sid] = live
        return sid, live

    def get_session(self, sid: str) -> LiveSession:
        with self.sessions_lock:
            live = self.sessions.get(sid)
        if live is None:
            raise StationError(404, f"no session {sid!r} (closed, expired, or never opened)")
        live.last_used = time.monotonic()
        return live

    def close_session(self, sid: str) -> None:
        with self.sessions_lock:
            live = self.sessions.pop(sid, None)
        if live is None:
            raise StationError(404, f"no session {sid!r}")
        self._retire(live)

    # -- checks shared by the volume endpoints --
    def check_volume_request(self, req: VolumeRequest, live: LiveSession) -> int:
        s = self.settings
        if (req.layer_lo, req.layer_hi) != (s.layer_lo, s.layer_hi):
            raise StationError(
                409,
                f"this station owns layers {s.layer_lo}:{s.layer_hi}, "
                f"not {req.layer_lo}:{req.layer_hi}",
            )
        prefix_hash = int(req.prefix_hash)
        if prefix_hash > U64_MAX:
            raise StationError(422, f"prefix_hash {req.prefix_hash} does not fit a u64")
        if req.prefix_len > len(live.prompt):
            raise StationError(
                422,
                f"prefix_len {req.prefix_len} exceeds the session's "
                f"{len(live.prompt)}-token prompt",
            )
        expected = int(_core.prefix_hash(live.prompt[: req.prefix_len]))
        if prefix_hash != expected:
            raise StationError(
                409,
                f"prefix_hash {prefix_hash} is not the hash of the session's first "
                f"{req.prefix_len} tokens ({expected})",
            )
        return prefix_hash

    def stats(self) -> dict[str, int]:
        with self.pipeline_lock:
            return dict(self.pipeline.amplituhedron_stats())


def _floats(body: bytes, what: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    if len(body) % 4 != 0:
        raise StationError(400, f"{what}: {len(body)} bytes is not a whole number of f32")
    arr = np.frombuffer(body, dtype="<f4")
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise StationError(400, f"{what}: value {bad} is not finite")
    return arr


class ObserveMiddleware:
    """Pure ASGI middleware (no per-request task or body copy): refuses oversized bodies
    early by their Content-Length, and records latency and status per route."""

    def __init__(self, app: Any, station: Station, latency: Histogram, requests: Counter) -> None:
        self.app = app
        self.limit = station.settings.max_body_bytes
        self.latency = latency
        self.requests = requests

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                response = JSONResponse(
                    {"detail": f"body of {int(value)} bytes exceeds the {self.limit}-byte limit"},
                    status_code=413,
                )
                await response(scope, receive, send)
                return
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", "unmatched")
            self.latency.labels(endpoint).observe(time.perf_counter() - started)
            self.requests.labels(endpoint, str(status)).inc()


DECODE_ROUTE = "/sessions/{session_id}/decode"
_DECODE_PATH = re.compile(r"/sessions/([^/]+)/decode")
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

    Only unambiguous calls take this path: POST, a plain session id, at most one valid value
    per known query parameter, a body within the limit. Anything else is handed, body
    intact, to the FastAPI route, which stays the single definition of the endpoint (and of
    its 4xx answers); errors raised by the step itself are answered exactly as FastAPI
    answers them (``{"detail": …}`` with the same status).
    """

    def __init__(self, app: Any, handler: Callable[..., Response], limit: int) -> None:
        self.app = app
        self.handler = handler
        self.limit = limit

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
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # disconnect: let the app see it
                await self.app(scope, _replay(b"".join(chunks), message), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                detail = f"body exceeds the {self.limit}-byte limit"
                await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)
                return
        scope["route"] = _RouteLabel(DECODE_ROUTE)
        try:
            response = self.handler(
                urllib.parse.unquote(match.group(1)), b"".join(chunks), **params
            )
        except HTTPException as exc:
            response = JSONResponse({"detail": exc.detail}, status_code=exc.status_code)
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


def create_app(station: Station) -> FastAPI:
    """The ASGI app of one station."""
    s = station.settings

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Idle sessions expire even on a station that opens no new ones.
        async def sweep() -> None:
            while True:
                await asyncio.sleep(min(10.0, max(0.5, s.session_idle_s / 4)))
                station.sweep_idle()

        task = asyncio.create_task(sweep())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(
        title="amplituhedron station",
        version=_core.__version__,
        description=f"Layers {s.layer_lo}:{s.layer_hi} of the model, their KV rings and volumes.",
        lifespan=lifespan,
    )
    registry = CollectorRegistry()
    latency = Histogram(
        "amplituhedron_request_seconds",
        "Request latency by endpoint",
        ["endpoint"],
        registry=registry,
        buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    )
    requests = Counter(
        "amplituhedron_requests",
        "Requests by endpoint and status",
        ["endpoint", "status"],
        registry=registry,
    )
    live_sessions = Gauge("amplituhedron_live_sessions", "Open sessions", registry=registry)
    live_sessions.set_function(lambda: len(station.sessions))

    class CacheCollector:
        def collect(self) -> Any:
            stats = station.stats()
            for key in ("hits", "misses", "evictions", "captures", "drift_clears", "erasures"):
                if key in stats:
                    c = CounterMetricFamily(f"amplituhedron_volume_{key}", f"Volume cache {key}")
                    c.add_metric([], stats[key])
                    yield c
            for key in ("entries", "bytes"):
                g = GaugeMetricFamily(f"amplituhedron_volume_{key}", f"Volume cache {key}")
                g.add_metric([], stats.get(key, 0))
                yield g

    registry.register(CacheCollector())

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        if s.token is None:
            return
        if authorization is None or not authorization.startswith("Bearer "):
            raise StationError(401, "this endpoint needs 'Authorization: Bearer <token>'")
        if not secrets.compare_digest(authorization[len("Bearer ") :], s.token):
            raise StationError(401, "wrong bearer token")

    auth = [Depends(require_token)]

    async def read_body(request: Request) -> bytes:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > s.max_body_bytes:
                raise StationError(413, f"body exceeds the {s.max_body_bytes}-byte limit")
            chunks.append(chunk)
        return b"".join(chunks)

    # -- health and metrics --
    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "layer_lo": s.layer_lo,
            "layer_hi": s.layer_hi,
            "n_layers": int(station.weights.n_layers),
            "fingerprint": str(station.weights.fingerprint),
            "hidden": station.hidden,
            "vocab": station.vocab,
            "sessions": len(station.sessions),
            "entry": station.is_entry,
            "exit": station.is_exit,
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode())

    # -- control --
    @app.get("/amplituhedron/stats")
    def amplituhedron_stats() -> dict[str, int]:
        return station.stats()

    @app.post("/amplituhedron/configure", dependencies=auth)
    def amplituhedron_configure(req: ConfigureRequest) -> dict[str, Any]:
        with station.pipeline_lock:
            p = station.pipeline
            if req.enabled is not None:
                p.amplituhedron_enable(req.enabled)
            if req.max_entries is not None:
                p.amplituhedron_set_max_entries(req.max_entries)
            if req.max_prefix_len is not None:
                p.amplituhedron_set_max_prefix_len(req.max_prefix_len)
            if "max_bytes" in req.model_fields_set:
                p.amplituhedron_set_max_bytes(req.max_bytes)
            if req.min_prefix_reuse is not None:
                p.amplituhedron_set_min_prefix_reuse(req.min_prefix_reuse)
        return {"stats": station.stats()}

    @app.post("/amplituhedron/clear", dependencies=auth)
    def amplituhedron_clear() -> dict[str, bool]:
        with station.pipeline_lock:
            station.pipeline.amplituhedron_clear()
        return {"cleared": True}

    @app.post("/memo/clear", dependencies=auth)
    def memo_clear() -> dict[str, bool]:
        with station.pipeline_lock:
            station.memo.clear()
            station.pipeline.amplituhedron_clear()
        return {"cleared": True}

    @app.get("/memo/stats")
    def memo_stats() -> dict[str, int]:
        return dict(station.memo.stats())

    @app.post("/amplituhedron/capture", dependencies=auth, openapi_extra=OCTET_BODY)
    async def amplituhedron_capture(
        request: Request,
        session_id: Annotated[str, Query(min_length=1, max_length=128)],
        prefix_hash: Annotated[str, Query(pattern=HASH_PATTERN)],
        prefix_len: Annotated[int, Query(ge=1, le=1 << 31)],
        layer_lo: Annotated[int, Query(ge=0, le=65535)],
        layer_hi: Annotated[int, Query(ge=0, le=65535)],
    ) -> dict[str, Any]:
        body = await read_body(request)
        req = VolumeRequest(
            session_id=session_id,
            prefix_hash=prefix_hash,
            prefix_len=prefix_len,
            layer_lo=layer_lo,
            layer_hi=layer_hi,
        )
        return await _in_thread(capture_sync, req, body)

    def capture_sync(req: VolumeRequest, body: bytes) -> dict[str, Any]:
        live = station.get_session(req.session_id)
        station.check_volume_request(req, live)
        floats = _floats(body, "tail residual")
        with_logits = station.hidden + station.vocab
        if floats.size != station.hidden and not (station.is_exit and floats.size == with_logits):
            what = "tail residual (+ logits)" if station.is_exit else "tail residual"
            raise StationError(
                400,
                f"body must be the {what}: {station.hidden} f32 "
                f"({station.hidden * 4} bytes), got {len(body)} bytes",
            )
        tail = np.ascontiguousarray(floats[: station.hidden])
        logits = None
        if station.is_exit:
            # The exit station keeps the last prompt position's logits itself; a body may
            # still carry them (tail + logits).
            logits = (
                np.ascontiguousarray(floats[station.hidden :])
                if floats.size == with_logits
                else live.prompt_logits
            )
            if logits is None or req.prefix_len != len(live.prompt):
                raise StationError(
                    409,
                    "the exit station can only capture the whole prompt after computing its "
                    "last position",
                )
        with live.use(req.session_id) as session, station.pipeline_lock:
            try:
                nbytes = station.pipeline.amplituhedron_capture(
                    session, live.prompt[: req.prefix_len], tail, logits, live.salt
                )
            except ValueError as exc:
                raise StationError(409, str(exc)) from exc
        return {"captured": nbytes > 0, "bytes": int(nbytes)}

    @app.post(
        "/amplituhedron/replay",
        responses={
            200: {
                "description": "hit: tail residual (+ logits) as f32 LE",
                "content": {OCTETS: {}},
            },
            204: {"description": "miss"},
        },
    )
    def amplituhedron_replay(req: VolumeRequest) -> Response:
        live = station.get_session(req.session_id)
        station.check_volume_request(req, live)
        if req.prefix_len != len(live.prompt):
            raise StationError(
                422,
                f"replay covers the whole prompt ({len(live.prompt)} tokens), not {req.prefix_len}",
            )
        with live.use(req.session_id) as session, station.pipeline_lock:
            if session.clock != 0:
                raise StationError(409, f"session {req.session_id!r} is not fresh")
            try:
                r = station.pipeline.amplituhedron_replay(session, live.prompt, live.salt)
            except ValueError as exc:
                raise StationError(409, str(exc)) from exc
        if r is None:
            return Response(status_code=204)
        live.last_logits = r.logits
        headers = {"X-Amplituhedron-Status": r.status, "X-Amplituhedron-Kv-Len": str(r.kv_len)}
        parts: list[bytes] = []
        if r.tail is not None:
            parts.append(np.asarray(r.tail, dtype="<f4").tobytes())
        if r.logits is not None:
            parts.append(np.asarray(r.logits, dtype="<f4").tobytes())
        headers["X-Amplituhedron-Logits"] = "1" if r.logits is not None else "0"
        return Response(b"".join(parts), status_code=200, media_type=OCTETS, headers=headers)

    # -- sessions --
    @app.post("/sessions", status_code=201)
    def open_session(req: OpenSessionRequest) -> dict[str, Any]:
        sid, live = station.open_session(req)
        return {
            "session_id": sid,
            "clock": int(live.session.clock),
            "layer_lo": s.layer_lo,
            "layer_hi": s.layer_hi,
        }

    @app.get("/sessions")
    def list_sessions() -> dict[str, Any]:
        with station.sessions_lock:
            items = list(station.sessions.items())
        return {
            "sessions": [
                {"session_id": sid, "clock": int(v.session.clock), "prompt_len": len(v.prompt)}
                for sid, v in items
            ],
            "max_sessions": s.max_sessions,
        }

    @app.delete("/sessions/{session_id}")
    def close_session(session_id: str) -> dict[str, bool]:
        station.close_session(session_id)
        return {"closed": True}

    @app.post("/sessions/{session_id}/rollback")
    def rollback(session_id: str, req: RollbackRequest) -> dict[str, int]:
        live = station.get_session(session_id)
        with live.use(session_id) as session:
            try:
                session.rollback(req.clock)
            except ValueError as exc:
                raise StationError(409, str(exc)) from exc
            return {"clock": int(session.clock)}

    def forward_sync(
        session_id: str,
        body: bytes,
        logits: Literal["none", "last", "all"],
        hidden: str,
        one_row: bool,
        sample: bool = False,
    ) -> Response:
        live = station.get_session(session_id)
        if station.is_entry:
            if len(body) % 4 != 0 or not body:
                raise StationError(
                    400, f"the entry station takes u32 LE token ids; got {len(body)} bytes"
                )
            ids = np.frombuffer(body, dtype="<u4")
            rows = int(ids.size)
        else:
            arr = _floats(body, "hidden states")
            if arr.size == 0 or arr.size % station.hidden != 0:
                raise StationError(
                    400,
                    f"hidden states must be n × {station.hidden} f32; got {arr.size} values",
                )
            rows = arr.size // station.hidden
        if one_row and rows != 1:
            raise StationError(400, f"a decode step is exactly one row, got {rows}")
        if (logits != "none" or sample) and not station.is_exit:
            raise StationError(400, "only the exit station returns logits or samples")
        # Sampling needs the last position's logits even when they are not returned.
        compute: Literal["none", "last", "all"] = "last" if sample and logits == "none" else logits
        token = None
        with live.use(session_id) as session:
            try:
                if station.is_entry:
                    h, lg = session.forward_tokens(ids.tolist(), logits=compute)
                else:
                    h, lg = session.forward_hidden(
                        arr.reshape(rows, station.hidden), logits=compute
                    )
            except ValueError as exc:
                raise StationError(422, str(exc)) from exc
            clock = int(session.clock)
            if lg is not None:
                live.last_logits = lg[-1]
                if clock == len(live.prompt):
                    live.prompt_logits = lg[-1]
                if sample:
                    assert live.sampler is not None
                    token = int(live.sampler.sample(lg[-1], clock))
        station.forward_rows += rows
        if hidden == "last":
            h = h[-1:]
        elif hidden == "none":
            h = h[:0]
        parts = [np.ascontiguousarray(h, dtype="<f4").tobytes()]
        returned = lg if logits != "none" else None
        if returned is not None:
            parts.append(np.ascontiguousarray(returned, dtype="<f4").tobytes())
        headers = {
            "X-Hidden-Rows": str(h.shape[0]),
            "X-Logits-Rows": str(0 if returned is None else returned.shape[0]),
            "X-Clock": str(clock),
        }
        if token is not None:
            headers["X-Token"] = str(token)
        return Response(b"".join(parts), media_type=OCTETS, headers=headers)

    @app.post("/sessions/{session_id}/forward", openapi_extra=OCTET_BODY)
    async def forward(
        session_id: str,
        request: Request,
        logits: Literal["none", "last", "all"] = "none",
        hidden: Literal["all", "last", "none"] = "all",
        sample: bool = False,
    ) -> Response:
        body = await read_body(request)
        return await _in_thread(forward_sync, session_id, body, logits, hidden, False, sample)

    def decode_step(
        session_id: str,
        body: bytes,
        logits: Literal["none", "last"],
        hidden: str,
        sample: bool,
    ) -> Response:
        if logits == "last" and not station.is_exit:
            logits = "none"
        # One row is a few milliseconds of Rust (GIL released, both cores via rayon): run it
        # on the event loop rather than paying a thread hand-off on every decoded token.
        return forward_sync(session_id, body, logits, hidden, True, sample)

    @app.post(DECODE_ROUTE, openapi_extra=OCTET_BODY)
    async def decode(
        session_id: str,
        request: Request,
        logits: Literal["none", "last"] = "last",
        hidden: Literal["all", "last", "none"] = "all",
        sample: bool = False,
    ) -> Response:
        """One decode step (exactly one row). With ``sample=true`` the exit station samples
        the next token with the session's sampler and returns it in ``X-Token`` (no logits
        on the wire). Well-formed calls are served by `DecodeFastPath` before FastAPI; this
        route defines, documents and validates the endpoint, and serves every other call."""
        return decode_step(session_id, await read_body(request), logits, hidden, sample)

    @app.post("/sessions/{session_id}/sample")
    def sample_next(session_id: str) -> dict[str, int]:
        """Exit station: samples the next token from the session's last logits (after an
        all-hit replay, those are the cached logits: the first token needs no model run)."""
        if not station.is_exit:
            raise StationError(400, "only the exit station samples")
        live = station.get_session(session_id)
        with live.use(session_id) as session:
            if live.last_logits is None:
                raise StationError(409, f"session {session_id!r} has no logits yet")
            assert live.sampler is not None
            return {"token": int(live.sampler.sample(live.last_logits, int(session.clock)))}

    app.add_middleware(DecodeFastPath, handler=decode_step, limit=s.max_body_bytes)

    # Added last, so outermost: it sees (and times) every request, the fast path included.
    app.add_middleware(ObserveMiddleware, station=station, latency=latency, requests=requests)

    if s.fault_injection:

        @app.post("/debug/damage")
        def damage(req: FaultRequest) -> dict[str, bool]:
            """Fault injection (only with --fault-injection): poisons one cached position."""
            with station.pipeline_lock:
                done = station.pipeline.amplituhedron_inject_fault(
                    req.prompt_tokens, req.position, req.salt
                )
            return {"damaged": bool(done)}

    return app


def load_weights(
    model_path: str | None,
    model_index: str | None = None,
    precision: Literal["refined", "fast"] = "refined",
) -> _core.ModelWeights:
    """Weights from a GGUF file, or from a model index written by the mesh launcher (which
    parsed the header once for all its stations)."""
    if model_index is not None:
        import json

        index = json.loads(Path(model_index).read_text())
        return _core.ModelWeights(
            index["path"], index["config"], [tuple(t) for t in index["tensors"]], precision
        )
    mf = read_model_file(model_path)
    return _core.ModelWeights(
        str(mf.path),
        dict(mf.config),
        [(t.name, t.ggml_type, list(t.dims), t.offset) for t in mf.tensors],
        precision,
    )


_T = TypeVar("_T")


async def _in_thread(fn: Callable[..., _T], *args: Any) -> _T:
    import anyio.to_thread

    return await anyio.to_thread.run_sync(fn, *args)


def serve(
    settings: StationSettings,
    host: str = "127.0.0.1",
    port: int = 8100,
    model_index: str | None = None,
) -> None:
    """Runs one station until interrupted (SIGINT/SIGTERM stop it cleanly)."""
    import uvicorn

    station = Station(settings, load_weights(settings.model_path, model_index, settings.precision))
    app = create_app(station)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
