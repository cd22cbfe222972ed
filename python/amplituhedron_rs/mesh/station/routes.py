"""The station's HTTP endpoints (SPEC §5, §14): thin FastAPI routes over :class:`.state.Station`.

Every endpoint but ``GET /healthz`` needs ``Authorization: Bearer <mesh token>`` (checked for
the whole app by :class:`~amplituhedron_rs.edge.asgi.BearerAuth`, so /docs, /openapi.json and
/metrics too).

- ``GET /healthz``, ``GET /metrics`` (Prometheus, added by the app), ``GET /openapi.json``
- ``GET /amplituhedron/stats``, ``POST /amplituhedron/configure``
  ``{enabled?, max_entries?, max_prefix_len?, max_bytes?, min_prefix_reuse?}``,
  ``POST /amplituhedron/clear``
- ``POST /amplituhedron/capture?session_id&prefix_hash&prefix_len&layer_lo&layer_hi`` with
  no body: the station freezes what it computed for the session's prompt
- ``POST /amplituhedron/replay`` ``{session_id, prefix_hash, prefix_len, layer_lo,
  layer_hi}``: 200 + tail (+ logits) octets on a hit, 204 on a miss
- ``POST /sessions`` (open; the station draws the id), ``GET /sessions`` (counts only),
  ``DELETE /sessions/{id}``, ``POST /sessions/{id}/forward`` (a chunk: u32 token ids at the
  entry station, f32 hidden rows elsewhere), ``POST /sessions/{id}/decode`` (one row; see
  :mod:`.fastpath`), ``POST /sessions/{id}/sample``, ``POST /sessions/{id}/rollback``
- ``POST /debug/damage`` only with ``--fault-injection``

Bad input gets a 4xx whose ``detail`` says what is wrong (the status comes from the
exception's type, :mod:`.errors`), and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response

from amplituhedron_rs._core import MAX_TOP_LOGPROBS
from amplituhedron_rs.mesh.protocol import (
    DECODE_ROUTE,
    FORWARD_ROUTE,
    HASH_PATTERN,
    OCTETS,
    SESSION_ID_PATTERN,
    TENANT,
    Captured,
    Configured,
    ConfigureRequest,
    FaultRequest,
    Health,
    OpenSessionRequest,
    RollbackRequest,
    RolledBack,
    Sampled,
    SessionCount,
    SessionOpened,
    StationMemory,
    TokenLogprobsWire,
    VolumeRequest,
)
from amplituhedron_rs.mesh.station.errors import Cancelled, NotFound
from amplituhedron_rs.mesh.station.state import HiddenRows, LogitsRows, Octets, Station

OCTET_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}},
    }
}

_T = TypeVar("_T")


async def current_station(request: Request) -> Station:
    # async: FastAPI would run a plain function in a worker thread, a hand-off per request.
    station: Station = request.app.state.station
    return station


StationDep = Annotated[Station, Depends(current_station)]


SessionIdPath = Annotated[str, Path(pattern=SESSION_ID_PATTERN)]
TenantHeader = Annotated[
    str | None,
    Header(
        alias=TENANT,
        description="the tenant the authenticated coordinator acts for (cache salt)",
    ),
]


async def read_body(request: Request) -> bytes:
    """The body, already bounded (chunked too) by :class:`~.app.ObserveMiddleware`."""
    return await request.body()


async def in_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Runs compute in a worker thread (the Rust call releases the GIL), keeping the event
    loop free: it never waits on a session's lock."""
    import anyio.to_thread

    return await anyio.to_thread.run_sync(fn, *args)


def octets(out: Octets) -> Response:
    return Response(out.body, media_type=OCTETS, headers=out.headers)


router = APIRouter()


# --- health --------------------------------------------------------------------------------
@router.get("/healthz")
async def healthz(station: StationDep) -> Health:
    s = station.settings
    # Reading /proc/self/smaps walks the page tables (and the rings' count takes a lock):
    # off the event loop.
    memory = await in_thread(station.memory)
    return Health(
        status="ok",
        layer_lo=s.layer_lo,
        layer_hi=s.layer_hi,
        n_layers=int(station.weights.n_layers),
        fingerprint=str(station.weights.fingerprint),
        hidden=station.hidden,
        vocab=station.vocab,
        sessions=len(station.sessions),  # a dict's len: safe from the event loop
        entry=station.is_entry,
        exit=station.is_exit,
        memory=StationMemory(**memory),
        stream_port=station.stream_port,
    )


# --- the volume cache ----------------------------------------------------------------------
@router.get("/amplituhedron/stats")
def amplituhedron_stats(station: StationDep) -> dict[str, int]:
    return station.stats()


@router.post("/amplituhedron/configure")
def amplituhedron_configure(station: StationDep, req: ConfigureRequest) -> Configured:
    station.configure(req)
    return Configured(stats=station.stats())


@router.post("/amplituhedron/clear")
def amplituhedron_clear(station: StationDep) -> dict[str, bool]:
    station.clear()
    return {"cleared": True}


@router.post("/amplituhedron/capture")
async def amplituhedron_capture(
    station: StationDep,
    request: Request,
    session_id: Annotated[str, Query(pattern=SESSION_ID_PATTERN)],
    prefix_hash: Annotated[str, Query(pattern=HASH_PATTERN)],
    prefix_len: Annotated[int, Query(ge=1, le=1 << 31)],
    layer_lo: Annotated[int, Query(ge=0, le=65535)],
    layer_hi: Annotated[int, Query(ge=0, le=65535)],
) -> Captured:
    """Freezes the session's own KV, tail and (exit) logits for its prompt; no body."""
    body = await read_body(request)
    req = VolumeRequest(
        session_id=session_id,
        prefix_hash=prefix_hash,
        prefix_len=prefix_len,
        layer_lo=layer_lo,
        layer_hi=layer_hi,
    )
    nbytes = await in_thread(station.capture, req, body)
    return Captured(captured=nbytes > 0, bytes=nbytes, reason=station.declines_captures)


@router.post(
    "/amplituhedron/replay",
    responses={
        200: {"description": "hit: tail residual (+ logits) as f32 LE", "content": {OCTETS: {}}},
        204: {"description": "miss"},
    },
)
def amplituhedron_replay(station: StationDep, req: VolumeRequest) -> Response:
    out = station.replay(req)
    return Response(status_code=204) if out is None else octets(out)


# --- sessions ------------------------------------------------------------------------------
@router.post("/sessions", status_code=201)
def open_session(
    station: StationDep, req: OpenSessionRequest, tenant: TenantHeader = None
) -> SessionOpened:
    """Opens a session; the id in the answer is its capability (random, never listed)."""
    sid, live = station.open_session(req, tenant)
    s = station.settings
    return SessionOpened(session_id=sid, clock=live.clock, layer_lo=s.layer_lo, layer_hi=s.layer_hi)


@router.get("/sessions")
def count_sessions(station: StationDep) -> SessionCount:
    """How many sessions are live (never their ids: an id is its holder's capability)."""
    return SessionCount(live=len(station.sessions), max_sessions=station.settings.max_sessions)


@router.delete("/sessions/{session_id}")
def close_session(station: StationDep, session_id: SessionIdPath) -> dict[str, bool]:
    station.close_session(session_id)
    return {"closed": True}


@router.post("/sessions/{session_id}/rollback")
def rollback(station: StationDep, session_id: SessionIdPath, req: RollbackRequest) -> RolledBack:
    return RolledBack(clock=station.rollback(session_id, req.clock))


@router.post(FORWARD_ROUTE, openapi_extra=OCTET_BODY)
async def forward(
    station: StationDep,
    session_id: SessionIdPath,
    request: Request,
    logits: LogitsRows = "none",
    hidden: HiddenRows = "all",
    sample: bool = False,
) -> Response:
    """A chunk of at most ``max_chunk`` rows. A client that disconnects meanwhile stops the
    work at the next piece, and its session is closed."""
    body = await read_body(request)
    cancel = threading.Event()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel.set()

    def run() -> Octets:
        return station.forward(session_id, body, logits, hidden, sample=sample, cancel=cancel)

    watcher = asyncio.ensure_future(watch())
    try:
        return octets(await in_thread(run))
    except Cancelled:
        with contextlib.suppress(NotFound):
            station.close_session(session_id)
        raise
    finally:
        watcher.cancel()


@router.post(DECODE_ROUTE, openapi_extra=OCTET_BODY)
async def decode(
    station: StationDep,
    session_id: SessionIdPath,
    request: Request,
    logits: Literal["none", "last"] = "last",
    hidden: HiddenRows = "all",
    sample: bool = False,
) -> Response:
    """One decode step (exactly one row). With ``sample=true`` the exit station samples
    the next token with the session's sampler and returns it in ``X-Token`` (no logits
    on the wire). Well-formed calls are served by `DecodeFastPath` before FastAPI; this
    route defines, documents and validates the endpoint, and serves every other call."""
    body = await read_body(request)

    def run() -> Octets:
        return station.decode_step(session_id, body, logits, hidden, sample)

    return octets(await in_thread(run))


@router.post("/sessions/{session_id}/sample")
def sample_next(
    station: StationDep,
    session_id: SessionIdPath,
    logprobs: Annotated[int | None, Query(ge=0, le=MAX_TOP_LOGPROBS)] = None,
) -> Sampled:
    """Exit station: samples the next token from the session's last logits (after an
    all-hit replay, those are the cached logits: the first token needs no model run); with
    ``logprobs=N``, its log-probability and N alternatives too."""
    token, lp, done = station.sample(session_id, logprobs)
    return Sampled(
        token=token, logprobs=None if lp is None else TokenLogprobsWire.of(lp), done=done
    )


# --- fault injection (only with --fault-injection) -----------------------------------------
debug_router = APIRouter()


@debug_router.post("/debug/damage")
def damage(station: StationDep, req: FaultRequest, tenant: TenantHeader = None) -> dict[str, bool]:
    """Poisons one cached position (tests and failure drills)."""
    return {"damaged": station.damage(req.prompt_tokens, req.position, tenant)}
