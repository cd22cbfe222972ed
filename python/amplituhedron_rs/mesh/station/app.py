"""The station's ASGI app: FastAPI on uvicorn, with its metrics, middleware and errors.

FastAPI gives typed request models, clear 4xx on bad input, and an OpenAPI description
(which the schemathesis run checks); uvicorn with httptools/uvloop keeps the per-request
cost low. Outermost first, a request meets :class:`ObserveMiddleware` (latency and status
metrics), :class:`~amplituhedron_rs.edge.asgi.BearerAuth` (the mesh token, on everything
but /healthz), :class:`~amplituhedron_rs.edge.asgi.BodyLimit` (chunked bodies included),
then :class:`~.fastpath.DecodeFastPath` (decode steps), then FastAPI. Connections are
capped and their heads and bodies read within deadlines (:mod:`amplituhedron_rs.edge`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError
from amplituhedron_rs.edge import EdgeLimits
from amplituhedron_rs.edge.asgi import BearerAuth, BodyLimit
from amplituhedron_rs.mesh.station.batch import BatchStepper, stepper_of
from amplituhedron_rs.mesh.station.batch import router as batch_router
from amplituhedron_rs.mesh.station.drill import DieOn, armed
from amplituhedron_rs.mesh.station.errors import (
    HANDLED,
    error_response,
    validation_response,
)
from amplituhedron_rs.mesh.station.fastpath import DecodeFastPath
from amplituhedron_rs.mesh.station.routes import debug_router, router
from amplituhedron_rs.mesh.station.state import Station, StationSettings
from amplituhedron_rs.mesh.station.stream import ENDPOINT as STREAM_ENDPOINT
from amplituhedron_rs.mesh.station.stream import StepHandler, open_stream

#: Seconds a station keeps an idle connection open.
KEEPALIVE_S = 30
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ObserveMiddleware:
    """Pure ASGI middleware (no per-request task or body copy): records latency and status
    per route, refusals included."""

    def __init__(self, app: Any, latency: Histogram, requests: Counter) -> None:
        self.app = app
        self.latency = latency
        self.requests = requests

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
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


class CacheCollector:
    """The volume cache's counters and gauges, read at scrape time."""

    def __init__(self, station: Station) -> None:
        self.station = station

    def collect(self) -> Any:
        stats = self.station.stats()
        for key in ("hits", "misses", "evictions", "captures", "drift_clears", "erasures"):
            if key in stats:
                c = CounterMetricFamily(f"amplituhedron_volume_{key}", f"Volume cache {key}")
                c.add_metric([], stats[key])
                yield c
        for key in ("entries", "bytes"):
            g = GaugeMetricFamily(f"amplituhedron_volume_{key}", f"Volume cache {key}")
            g.add_metric([], stats.get(key, 0))
            yield g


class StreamCollector:
    """What the step stream ran without Python, read at scrape time."""

    def __init__(self, station: Station) -> None:
        self.station = station

    def collect(self) -> Any:
        stream = self.station.stream
        steps = CounterMetricFamily(
            "amplituhedron_stream_fast_steps",
            "Steps the step stream answered without Python (decode rows, prompt pieces)",
        )
        rows = CounterMetricFamily(
            "amplituhedron_stream_fast_rows", "Rows those steps ran through the station's layers"
        )
        steps.add_metric([], 0 if stream is None else stream.fast_steps)
        rows.add_metric([], 0 if stream is None else stream.fast_rows)
        yield steps
        yield rows


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
                take_stream_observations()
                stepper: BatchStepper | None = getattr(app.state, "batch_stepper", None)
                if stepper is not None:
                    stepper.release_if_idle()
                if station.stream is not None and station.is_idle():
                    station.stream.release_buffers()

        task = asyncio.create_task(sweep())
        if stream_handler is not None:
            open_stream(station, stream_handler, station_limits(s), fast=drill is None)
        try:
            yield
        finally:
            task.cancel()
            station.detach_stream()
            # A graceful stop leaves every accepted volume on disk for the next start.
            await asyncio.to_thread(station.flush_volumes)

    app = FastAPI(
        title="amplituhedron station",
        version=_core.__version__,
        description=f"Layers {s.layer_lo}:{s.layer_hi} of the model, their KV rings and volumes.",
        lifespan=lifespan,
    )
    app.state.station = station
    app.include_router(router)
    app.include_router(batch_router)
    if s.fault_injection:
        app.include_router(debug_router)

    async def refused(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    for exc_type in HANDLED:
        app.add_exception_handler(exc_type, refused)

    async def invalid(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_response(exc.errors())

    app.add_exception_handler(RequestValidationError, invalid)

    registry = CollectorRegistry()
    latency = Histogram(
        "amplituhedron_request_seconds",
        "Request latency by endpoint",
        ["endpoint"],
        registry=registry,
        buckets=LATENCY_BUCKETS,
    )
    requests = Counter(
        "amplituhedron_requests",
        "Requests by endpoint and status",
        ["endpoint", "status"],
        registry=registry,
    )
    live_sessions = Gauge("amplituhedron_live_sessions", "Open sessions", registry=registry)
    live_sessions.set_function(lambda: len(station.sessions))
    registry.register(CacheCollector(station))
    registry.register(StreamCollector(station))

    # The labelled series of the step stream, looked up once (every hop observes them).
    stream_latency = latency.labels(STREAM_ENDPOINT)
    stream_answers = {200: requests.labels(STREAM_ENDPOINT, "200")}

    def observe_stream(seconds: float, status: int) -> None:
        stream_latency.observe(seconds)
        answers = stream_answers.get(status)
        if answers is None:
            answers = stream_answers[status] = requests.labels(STREAM_ENDPOINT, str(status))
        answers.inc()

    def take_stream_observations() -> None:
        """Records the answers the stream wrote without Python (its fast steps and its
        refusals of frames), taken in batches off the step path."""
        stream = station.stream
        if stream is not None:
            for seconds, status in stream.take_observations():
                observe_stream(seconds, status)

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> PlainTextResponse:
        take_stream_observations()
        return PlainTextResponse(generate_latest(registry).decode())

    drill = armed()  # TEST-ONLY (AMPLITUHEDRON_TEST_DIE_ON; off unless set)

    # The Python half of the step stream (the Rust fast path declines every frame while a
    # drill is armed, so the drill counts every step).
    app.state.batch_stepper = BatchStepper(station)
    stream_handler = (
        None
        if s.stream_port is None
        else StepHandler(
            lambda: stepper_of(app.state, station), drill=drill, observe=observe_stream
        )
    )

    # Each added middleware wraps the ones before: outermost last.
    app.add_middleware(DecodeFastPath, station=station)
    if drill is not None:
        app.add_middleware(DieOn, drill=drill)
    app.add_middleware(
        BodyLimit, json_limit=s.max_json_bytes, octet_limit=s.max_body_bytes, respond=_refusal
    )
    open_paths = {"/healthz", "/metrics"} if s.open_metrics else {"/healthz"}
    keys = [] if s.token is None else [s.token.encode()]
    app.add_middleware(
        BearerAuth, keys=keys, open_paths=open_paths, respond=_refusal, what="mesh token"
    )
    # Outermost: it sees (and times) every request, refusals and the fast path included.
    app.add_middleware(ObserveMiddleware, latency=latency, requests=requests)
    return app


def _refusal(status: int, message: str, headers: dict[str, str]) -> JSONResponse:
    """An edge refusal (401, 413) in the station's ``{"detail": …}`` shape."""
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(settings: StationSettings, host: str = "127.0.0.1", port: int = 8100) -> None:
    """Runs one station until interrupted (SIGINT/SIGTERM stop it cleanly). A station
    without a token (``--insecure``) only listens on loopback."""
    from amplituhedron_rs.edge.server import run

    if settings.token is None and not is_loopback(host):
        raise InputError(
            f"refusing to serve without a token on {host}: --insecure is for loopback only"
        )
    settings.stream_host = host
    app = create_app(Station(settings))
    run(app, host, port, station_limits(settings))


def station_limits(settings: StationSettings) -> EdgeLimits:
    """The edge limits of a station's HTTP port and step stream."""
    # Idle keep-alive connections live longer here than in the coordinator's pools
    # (StationClient: 15 s), so the client never reuses one the station just closed.
    return EdgeLimits(
        max_connections=settings.max_connections,
        keepalive_s=KEEPALIVE_S,
        max_json_bytes=settings.max_json_bytes,
        max_octet_bytes=settings.max_body_bytes,
    )
