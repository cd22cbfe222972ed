"""The station's ASGI app: FastAPI on uvicorn, with its metrics, middleware and errors.

FastAPI gives typed request models, clear 4xx on bad input, and an OpenAPI description
(which the schemathesis run checks); uvicorn with httptools/uvloop keeps the per-request
cost low. Outermost first, a request meets :class:`ObserveMiddleware` (size limit, latency
and status metrics), then :class:`~.fastpath.DecodeFastPath` (decode steps), then FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from amplituhedron_rs import _core
from amplituhedron_rs.mesh.station.batch import router as batch_router
from amplituhedron_rs.mesh.station.errors import HANDLED, error_response
from amplituhedron_rs.mesh.station.fastpath import DecodeFastPath
from amplituhedron_rs.mesh.station.routes import debug_router, router
from amplituhedron_rs.mesh.station.state import Station, StationSettings

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ObserveMiddleware:
    """Pure ASGI middleware (no per-request task or body copy): refuses oversized bodies
    early by their Content-Length, and records latency and status per route."""

    def __init__(self, app: Any, limit: int, latency: Histogram, requests: Counter) -> None:
        self.app = app
        self.limit = limit
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
    app.state.station = station
    app.include_router(router)
    app.include_router(batch_router)
    if s.fault_injection:
        app.include_router(debug_router)

    async def refused(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    for exc_type in HANDLED:
        app.add_exception_handler(exc_type, refused)

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

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode())

    app.add_middleware(DecodeFastPath, station=station)
    # Added last, so outermost: it sees (and times) every request, the fast path included.
    app.add_middleware(
        ObserveMiddleware, limit=s.max_body_bytes, latency=latency, requests=requests
    )
    return app


def serve(settings: StationSettings, host: str = "127.0.0.1", port: int = 8100) -> None:
    """Runs one station until interrupted (SIGINT/SIGTERM stop it cleanly)."""
    import uvicorn

    app = create_app(Station(settings))
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
