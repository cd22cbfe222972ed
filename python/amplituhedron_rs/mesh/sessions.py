"""What one sequence does on every station of a mesh, shared by the coordinator and the mesh
executor: the mesh check, opening its sessions, the replay fan-out, the cached first token,
closing. Each is one request per station, sent in parallel.

Each station draws its own session id (a capability), so a sequence holds one id per
station, in the stations' order."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from amplituhedron_rs._core import MeshError
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh.client import Reply, StationClient, StationFailed
from amplituhedron_rs.mesh.launcher import MeshSpec, StationInfo


@dataclass
class MeshLink:
    """A mesh's stations, in order, the connection pool to them and the mesh token.
    ``close_timeout``: the cleanup close's limit (a stalled station must not hold up an
    error); ``open_deadline``: how long an open retries full stations (503)."""

    mesh: MeshSpec
    http: StationClient
    headers: Mapping[str, str]
    close_timeout: float = 2.0
    open_deadline: float = 10.0

    @property
    def stations(self) -> tuple[StationInfo, ...]:
        return self.mesh.stations

    async def call(
        self,
        phase: str,
        station: StationInfo,
        method: str,
        path: str,
        *,
        ok: Sequence[int] = (200, 201),
        headers: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> Reply:
        """One request with the mesh token (a failure is a MeshError naming the station)."""
        sent = {**self.headers, **(headers or {})}
        return await self.http.call(phase, station, method, path, ok=ok, headers=sent, **kw)


@dataclass
class StationVerdict:
    """What one station did for one session."""

    url: str
    layer_lo: int
    layer_hi: int
    replay: str = "off"  # "hit" | "partial" | "miss" | "off"
    replayed_tokens: int = 0
    captured_bytes: int = 0
    prefill_requests: int = 0


@dataclass(frozen=True)
class Replayed:
    """What the replay fan-out found for one sequence."""

    #: Every station replayed the whole prompt and the exit station has its logits.
    hit: bool
    #: Prompt positions every station now holds (prefill resumes there).
    kept: int
    #: Per station: "hit" | "partial" | "miss", and the positions it replayed.
    verdicts: tuple[tuple[str, int], ...]


async def check_mesh(link: MeshLink) -> wire.Health:
    """Every station answers, runs the same model, and owns the layers the mesh says; returns
    the exit station's health (hidden width, vocabulary, fingerprint)."""
    healths = await asyncio.gather(
        *(link.call("health check", s, "GET", "/healthz") for s in link.stations)
    )
    reports = [wire.Health.model_validate_json(h.content) for h in healths]
    fingerprints = {h.fingerprint for h in reports}
    if len(fingerprints) != 1:
        raise MeshError(f"the stations run different models (fingerprints {fingerprints})")
    for s, h in zip(link.stations, reports, strict=True):
        if (h.layer_lo, h.layer_hi) != (s.layer_lo, s.layer_hi):
            raise MeshError(
                f"station {s.url} owns layers {h.layer_lo}:{h.layer_hi}, "
                f"the mesh file says {s.layer_lo}:{s.layer_hi}"
            )
    last = reports[-1]
    if last.n_layers != link.mesh.n_layers:
        raise MeshError(
            f"the mesh covers {link.mesh.n_layers} layers, the model has {last.n_layers}"
        )
    return last


async def open_sessions(
    link: MeshLink, opening: wire.OpenSessionRequest, tenant: str | None = None
) -> list[str]:
    """Opens the sequence's session on every station (each draws its own id; returned in
    the stations' order), all or nothing: if any open fails, the ones that succeeded are
    closed at once, also when the caller is cancelled mid-open. If every failure was a full
    station (503), the whole fan-out is retried with full-jitter exponential backoff until
    ``open_deadline``: holding some stations' sessions while waiting for another's would let
    waiting clients starve each other. ``tenant`` travels in the tenant header (the stations
    derive the cache salt from it and the mesh token)."""
    body = opening.model_dump(mode="json")
    headers = {wire.TENANT: tenant} if tenant is not None else {}
    deadline = time.monotonic() + link.open_deadline
    attempt = 0
    while True:
        calls = [
            asyncio.ensure_future(
                link.call("session open", s, "POST", "/sessions", json=body, headers=headers)
            )
            for s in link.stations
        ]
        try:
            await asyncio.wait(calls)
        except asyncio.CancelledError:
            for c in calls:
                c.cancel()
            await asyncio.wait(calls)
            await close_sessions(link, [_opened(c) for c in calls])
            raise
        sids = [_opened(c) for c in calls]
        failed = [e for c in calls if (e := c.exception()) is not None]
        if not failed:
            return [sid for sid in sids if sid is not None]
        await close_sessions(link, sids)
        left = deadline - time.monotonic()
        full = all(isinstance(f, StationFailed) and f.status == 503 for f in failed)
        if not full or left <= 0:
            raise failed[0]
        # Full jitter keeps many refused clients from retrying in lockstep.
        await asyncio.sleep(min(left, random.uniform(0, min(2.0, 0.05 * 2**attempt))))
        attempt += 1


def _opened(call: asyncio.Future[Reply]) -> str | None:
    """The session id an open call got, if it completed."""
    if call.cancelled() or call.exception() is not None:
        return None
    return wire.SessionOpened.model_validate_json(call.result().content).session_id


async def replay(
    link: MeshLink, sids: Sequence[str], prompt: Sequence[int], prefix_hash: int
) -> Replayed:
    """Replay fan-out. All hit (with the exit logits): the whole prompt is held. Otherwise
    every station is brought to the shortest replayed prefix; a miss anywhere means a cold
    prefill everywhere (the seed's global branch)."""
    n = len(prompt)

    async def one(s: StationInfo, sid: str) -> Reply:
        body = volume(sid, prefix_hash, n, s).model_dump()
        return await link.call(
            "replay", s, "POST", "/amplituhedron/replay", json=body, ok=(200, 204)
        )

    responses = await asyncio.gather(
        *(one(s, sid) for s, sid in zip(link.stations, sids, strict=True))
    )
    verdicts = []
    for r in responses:
        if r.status == 204:
            verdicts.append(("miss", 0))
        else:
            verdicts.append(
                (
                    r.headers.get(wire.REPLAY_STATUS, "hit"),
                    int(r.headers.get(wire.REPLAY_KV_LEN, n)),
                )
            )
    if (
        all(v == "hit" for v, _ in verdicts)
        and responses[-1].headers.get(wire.REPLAY_LOGITS) == "1"
    ):
        return Replayed(True, n, tuple(verdicts))
    keep = 0 if any(v == "miss" for v, _ in verdicts) else min(h for _, h in verdicts)
    await asyncio.gather(
        *(
            link.call(
                "rollback",
                s,
                "POST",
                f"/sessions/{sid}/rollback",
                json=wire.RollbackRequest(clock=keep).model_dump(),
            )
            for s, sid, (_, held) in zip(link.stations, sids, verdicts, strict=True)
            if held > keep
        )
    )
    return Replayed(False, keep, tuple(verdicts))


async def sample_cached(link: MeshLink, sids: Sequence[str]) -> int:
    """After an all-hit replay: the exit station samples the first token from the cached
    logits (no model run)."""
    r = await link.call("first token", link.stations[-1], "POST", f"/sessions/{sids[-1]}/sample")
    return wire.Sampled.model_validate_json(r.content).token


async def close_sessions(link: MeshLink, sids: Sequence[str | None]) -> None:
    """Closes the sequence's sessions (None: not opened on that station), each within
    ``close_timeout``. Already gone is fine; failures are not raised: the station's idle
    sweep is the backstop."""
    await asyncio.gather(
        *(
            link.call(
                "close",
                s,
                "DELETE",
                f"/sessions/{sid}",
                ok=(200, 404),
                timeout=link.close_timeout,
            )
            for s, sid in zip(link.stations, sids, strict=True)
            if sid is not None
        ),
        return_exceptions=True,
    )


def volume(sid: str, prefix_hash: int, prefix_len: int, info: StationInfo) -> wire.VolumeRequest:
    return wire.VolumeRequest(
        session_id=sid,
        prefix_hash=str(prefix_hash),
        prefix_len=prefix_len,
        layer_lo=info.layer_lo,
        layer_hi=info.layer_hi,
    )
