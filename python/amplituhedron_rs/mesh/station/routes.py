"""The station's HTTP endpoints (SPEC §5): thin FastAPI routes over :class:`.state.Station`.

- ``GET /healthz``, ``GET /metrics`` (Prometheus, added by the app), ``GET /openapi.json``
- ``GET /amplituhedron/stats``; with the bearer token: ``POST /amplituhedron/configure``
  ``{enabled?, max_entries?, max_prefix_len?, max_bytes?, min_prefix_reuse?}`` and
  ``POST /amplituhedron/clear``
- ``POST /amplituhedron/capture?session_id&prefix_hash&prefix_len&layer_lo&layer_hi`` (token)
  with the tail residual (f32 LE; the exit station may append the last position's logits)
- ``POST /amplituhedron/replay`` ``{session_id, prefix_hash, prefix_len, layer_lo,
  layer_hi}``: 200 + tail (+ logits) octets on a hit, 204 on a miss
- ``POST /sessions`` (open), ``GET /sessions``, ``DELETE /sessions/{id}``,
  ``POST /sessions/{id}/forward`` (a chunk: u32 token ids at the entry station, f32 hidden
  rows elsewhere), ``POST /sessions/{id}/decode`` (one row; see :mod:`.fastpath`),
  ``POST /sessions/{id}/sample``, ``POST /sessions/{id}/rollback``
- ``POST /debug/damage`` only with ``--fault-injection``

Bad input gets a 4xx whose ``detail`` says what is wrong (the status comes from the
exception's type, :mod:`.errors`), and changes nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, Header, Query, Request, Response

from amplituhedron_rs.mesh.protocol import (
    DECODE_ROUTE,
    FORWARD_ROUTE,
    HASH_PATTERN,
    OCTETS,
    Captured,
    Configured,
    ConfigureRequest,
    FaultRequest,
    Health,
    OpenSessionRequest,
    RollbackRequest,
    RolledBack,
    Sampled,
    SessionList,
    SessionOpened,
    SessionSummary,
    VolumeRequest,
)
from amplituhedron_rs.mesh.station.errors import TooLarge, Unauthorized
from amplituhedron_rs.mesh.station.state import (
    HiddenRows,
    LiveSession,
    LogitsRows,
    Octets,
    Station,
)

OCTET_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}},
    }
}

_T = TypeVar("_T")


def current_station(request: Request) -> Station:
    station: Station = request.app.state.station
    return station


StationDep = Annotated[Station, Depends(current_station)]


def require_token(
    station: StationDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    token = station.settings.token
    if token is None:
        return
    if authorization is None or not authorization.startswith("Bearer "):
        raise Unauthorized("this endpoint needs 'Authorization: Bearer <token>'")
    if not secrets.compare_digest(authorization[len("Bearer ") :], token):
        raise Unauthorized("wrong bearer token")


AUTH = [Depends(require_token)]


async def read_body(station: Station, request: Request) -> bytes:
    limit = station.settings.max_body_bytes
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


async def in_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Runs a prefill chunk or a capture in a worker thread (the Rust call releases the
    GIL), keeping the event loop free for decode steps."""
    import anyio.to_thread

    return await anyio.to_thread.run_sync(fn, *args)


def octets(out: Octets) -> Response:
    return Response(out.body, media_type=OCTETS, headers=out.headers)


router = APIRouter()


# --- health --------------------------------------------------------------------------------
@router.get("/healthz")
def healthz(station: StationDep) -> Health:
    s = station.settings
    return Health(
        status="ok",
        layer_lo=s.layer_lo,
        layer_hi=s.layer_hi,
        n_layers=int(station.weights.n_layers),
        fingerprint=str(station.weights.fingerprint),
        hidden=station.hidden,
        vocab=station.vocab,
        sessions=len(station.sessions),
        entry=station.is_entry,
        exit=station.is_exit,
    )


# --- the volume cache ----------------------------------------------------------------------
@router.get("/amplituhedron/stats")
def amplituhedron_stats(station: StationDep) -> dict[str, int]:
    return station.stats()


@router.post("/amplituhedron/configure", dependencies=AUTH)
def amplituhedron_configure(station: StationDep, req: ConfigureRequest) -> Configured:
    station.configure(req)
    return Configured(stats=station.stats())


@router.post("/amplituhedron/clear", dependencies=AUTH)
def amplituhedron_clear(station: StationDep) -> dict[str, bool]:
    station.clear()
    return {"cleared": True}


@router.post("/amplituhedron/capture", dependencies=AUTH, openapi_extra=OCTET_BODY)
async def amplituhedron_capture(
    station: StationDep,
    request: Request,
    session_id: Annotated[str, Query(min_length=1, max_length=128)],
    prefix_hash: Annotated[str, Query(pattern=HASH_PATTERN)],
    prefix_len: Annotated[int, Query(ge=1, le=1 << 31)],
    layer_lo: Annotated[int, Query(ge=0, le=65535)],
    layer_hi: Annotated[int, Query(ge=0, le=65535)],
) -> Captured:
    body = await read_body(station, request)
    req = VolumeRequest(
        session_id=session_id,
        prefix_hash=prefix_hash,
        prefix_len=prefix_len,
        layer_lo=layer_lo,
        layer_hi=layer_hi,
    )
    nbytes = await in_thread(station.capture, req, body)
    return Captured(captured=nbytes > 0, bytes=nbytes)


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
def open_session(station: StationDep, req: OpenSessionRequest) -> SessionOpened:
    sid, live = station.open_session(req)
    s = station.settings
    return SessionOpened(
        session_id=sid, clock=int(live.session.clock), layer_lo=s.layer_lo, layer_hi=s.layer_hi
    )


@router.get("/sessions")
def list_sessions(station: StationDep) -> SessionList:
    with station.sessions_lock:
        items = list(station.sessions.items())
    return SessionList(
        sessions=[
            SessionSummary(session_id=sid, clock=_idle_clock(v), prompt_len=len(v.prompt))
            for sid, v in items
        ],
        max_sessions=station.settings.max_sessions,
    )


def _idle_clock(live: LiveSession) -> int | None:
    """The session's clock, or None while a step holds it (its ring is borrowed then)."""
    if not live.lock.acquire(blocking=False):
        return None
    try:
        return int(live.session.clock)
    finally:
        live.lock.release()


@router.delete("/sessions/{session_id}")
def close_session(station: StationDep, session_id: str) -> dict[str, bool]:
    station.close_session(session_id)
    return {"closed": True}


@router.post("/sessions/{session_id}/rollback")
def rollback(station: StationDep, session_id: str, req: RollbackRequest) -> RolledBack:
    return RolledBack(clock=station.rollback(session_id, req.clock))


@router.post(FORWARD_ROUTE, openapi_extra=OCTET_BODY)
async def forward(
    station: StationDep,
    session_id: str,
    request: Request,
    logits: LogitsRows = "none",
    hidden: HiddenRows = "all",
    sample: bool = False,
) -> Response:
    body = await read_body(station, request)

    def run() -> Octets:
        return station.forward(session_id, body, logits, hidden, sample=sample)

    return octets(await in_thread(run))


@router.post(DECODE_ROUTE, openapi_extra=OCTET_BODY)
async def decode(
    station: StationDep,
    session_id: str,
    request: Request,
    logits: Literal["none", "last"] = "last",
    hidden: HiddenRows = "all",
    sample: bool = False,
) -> Response:
    """One decode step (exactly one row). With ``sample=true`` the exit station samples
    the next token with the session's sampler and returns it in ``X-Token`` (no logits
    on the wire). Well-formed calls are served by `DecodeFastPath` before FastAPI; this
    route defines, documents and validates the endpoint, and serves every other call."""
    body = await read_body(station, request)
    return octets(station.decode_step(session_id, body, logits, hidden, sample))


@router.post("/sessions/{session_id}/sample")
def sample_next(station: StationDep, session_id: str) -> Sampled:
    """Exit station: samples the next token from the session's last logits (after an
    all-hit replay, those are the cached logits: the first token needs no model run)."""
    return Sampled(token=station.sample(session_id))


# --- fault injection (only with --fault-injection) -----------------------------------------
debug_router = APIRouter()


@debug_router.post("/debug/damage")
def damage(station: StationDep, req: FaultRequest) -> dict[str, bool]:
    """Poisons one cached position (tests and failure drills)."""
    return {"damaged": station.damage(req.prompt_tokens, req.position, req.salt)}
