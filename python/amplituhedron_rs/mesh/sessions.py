"""What one sequence does on every station of a mesh, shared by the coordinator and the mesh
executor: the mesh check, opening its sessions, the replay fan-out, the cached first token,
closing. Each is one request per station, sent in parallel.

Each station draws its own session id (a capability), so a sequence holds one id per
station, in the stations' order. With replicas, a sequence's stations are the chain of
primaries it was opened on (:mod:`.replicas`); each call takes that chain (default: the
current one)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from amplituhedron_rs._core import EngineAdmission, MeshError
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh.client import Reply, StationClient, StationFailed
from amplituhedron_rs.mesh.launcher import MeshSpec, StationInfo
from amplituhedron_rs.mesh.replicas import Chain, Replicas


@dataclass
class MeshLink:
    """A mesh's stations, which replica of each range serves now (``replicas``), the
    connection pool to them and the mesh token. ``close_timeout``: the cleanup close's limit
    (a stalled station must not hold up an error); ``open_deadline``: how long an open
    retries full stations (503)."""

    mesh: MeshSpec
    http: StationClient
    headers: Mapping[str, str]
    close_timeout: float = 2.0
    open_deadline: float = 10.0
    #: The mesh token the step stream's frames carry (the HTTP calls send ``headers``).
    token: str | None = field(default=None, repr=False)
    replicas: Replicas = field(init=False)

    def __post_init__(self) -> None:
        self.replicas = Replicas(self.mesh)

    @property
    def stations(self) -> tuple[StationInfo, ...]:
        """The current chain: one live station per range, in layer order."""
        return self.replicas.chain().stations

    def chain(self) -> Chain:
        return self.replicas.chain()

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

    async def step(
        self, phase: str, station: StationInfo, head: bytes, payload: bytes | memoryview
    ) -> tuple[bytes, bytes]:
        """One batched step with the mesh token (step stream or HTTP): the answer's JSON
        header and payload."""
        return await self.http.step(
            phase, station, head, payload, token=self.token, headers=self.headers
        )

    async def step_chain(
        self,
        phase: str,
        stations: Sequence[StationInfo],
        heads: Sequence[bytes],
        payload: bytes | memoryview,
        entries: int,
    ) -> tuple[list[tuple[bytes, float, float]], bytes] | None:
        """One batched step through ``stations`` in order without returning to the event
        loop between hops (see :meth:`StationClient.step_chain`); None without a stream."""
        return await self.http.step_chain(
            phase, stations, heads, payload, entries, token=self.token, headers=self.headers
        )


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


@dataclass
class SeqTrace:
    """What the mesh did for one sequence: admission timings and each station's verdict."""

    open_ms: float = 0.0
    replay_ms: float = 0.0
    stations: list[StationVerdict] = field(default_factory=list)


def note_step(
    traces: Mapping[int, SeqTrace],
    station: int,
    seqs: Sequence[int],
    specs: Sequence[wire.BatchEntrySpec],
    reply: wire.BatchStepReply,
) -> None:
    """Counts a step's prefill requests and captured bytes at ``station`` (its index in the
    chain) in the traces of the step's sequences ``seqs``."""
    for seq, spec, res in zip(seqs, specs, reply.entries, strict=True):
        trace = traces.get(seq)
        if trace is None or spec.kind != "prefill":
            continue
        trace.stations[station].prefill_requests += 1
        if spec.capture:
            trace.stations[station].captured_bytes += res.captured


def sampling_of(a: EngineAdmission) -> wire.SamplingSpec:
    """A session's sampling on the wire: the same core sampler as the engine's."""
    adjust: dict[str, Any] = {
        "presence_penalty": a.presence_penalty,
        "frequency_penalty": a.frequency_penalty,
        "repetition_penalty": a.repetition_penalty,
        "logit_bias": list(a.logit_bias),
        "min_tokens": a.min_tokens,
        "min_tokens_banned": list(a.min_tokens_banned),
    }
    if a.greedy:
        return wire.SamplingSpec(seed=a.seed, **adjust)
    return wire.SamplingSpec(
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed, **adjust
    )


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
    """Every live station runs the same model and owns the layers the mesh says, and every
    range has a live replica; returns the exit station's health (hidden width, vocabulary,
    fingerprint). A replica that does not answer is marked down (and health-checked until
    it does); a range left without one fails the check."""
    everyone = link.mesh.stations
    answers = await asyncio.gather(
        *(link.call("health check", s, "GET", "/healthz") for s in everyone),
        return_exceptions=True,
    )
    reports: dict[str, wire.Health] = {}
    for s, a in zip(everyone, answers, strict=True):
        if isinstance(a, StationFailed) and a.down:
            link.replicas.fail(s, str(a), failover=False)
        elif isinstance(a, BaseException):
            raise a
        else:
            reports[s.url] = health = wire.Health.model_validate_json(a.content)
            link.http.learn(s, health)
    fingerprints = {h.fingerprint for h in reports.values()}
    if len(fingerprints) > 1:
        raise MeshError(f"the stations run different models (fingerprints {fingerprints})")
    for s in everyone:
        h = reports.get(s.url)
        if h is not None and (h.layer_lo, h.layer_hi) != (s.layer_lo, s.layer_hi):
            raise MeshError(
                f"station {s.url} owns layers {h.layer_lo}:{h.layer_hi}, "
                f"the mesh file says {s.layer_lo}:{s.layer_hi}"
            )
    chain = link.chain()  # MeshError if a range has no live replica
    last = reports[chain.stations[-1].url]
    if last.n_layers != link.mesh.n_layers:
        raise MeshError(
            f"the mesh covers {link.mesh.n_layers} layers, the model has {last.n_layers}"
        )
    link.replicas.fingerprint = last.fingerprint
    return last


async def open_sessions(
    link: MeshLink,
    opening: wire.OpenSessionRequest,
    tenant: str | None = None,
    stations: Sequence[StationInfo] | None = None,
) -> list[str]:
    """Opens the sequence's session on every station (each draws its own id; returned in
    the stations' order), all or nothing: if any open fails, the ones that succeeded are
    closed at once, also when the caller is cancelled mid-open. If every failure was a full
    station (503), the whole fan-out is retried with full-jitter exponential backoff until
    ``open_deadline``: holding some stations' sessions while waiting for another's would let
    waiting clients starve each other. ``tenant`` travels in the tenant header, as its
    SHA-256 (so no character or length of it can break a header; the stations derive the
    cache salt from that and the mesh token). ``stations``: the chain to open on (default:
    the current one)."""
    chain = link.stations if stations is None else tuple(stations)
    body = opening.model_dump(mode="json")
    # A grammar is for the exit station alone (it samples); the others open without it.
    bodies = [
        body if s.layer_hi == link.mesh.n_layers else {**body, "grammar": None} for s in chain
    ]
    headers = {wire.TENANT: wire.tenant_header(tenant)} if tenant is not None else {}
    deadline = time.monotonic() + link.open_deadline
    attempt = 0
    while True:
        calls = [
            asyncio.ensure_future(
                link.call("session open", s, "POST", "/sessions", json=b, headers=headers)
            )
            for s, b in zip(chain, bodies, strict=True)
        ]
        try:
            await asyncio.wait(calls)
        except asyncio.CancelledError:
            for c in calls:
                c.cancel()
            await asyncio.wait(calls)
            await close_sessions(link, [_opened(c) for c in calls], chain)
            raise
        sids = [_opened(c) for c in calls]
        failed = [e for c in calls if (e := c.exception()) is not None]
        if not failed:
            return [sid for sid in sids if sid is not None]
        await close_sessions(link, sids, chain)
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
    link: MeshLink,
    sids: Sequence[str],
    prompt: Sequence[int],
    prefix_hash: int,
    stations: Sequence[StationInfo] | None = None,
) -> Replayed:
    """Replay fan-out. All hit (with the exit logits): the whole prompt is held. Otherwise
    every station is brought to the shortest replayed prefix; a miss anywhere means a cold
    prefill everywhere (the seed's global branch). ``stations``: the sessions' chain."""
    n = len(prompt)
    chain = link.stations if stations is None else tuple(stations)

    async def one(s: StationInfo, sid: str) -> Reply:
        body = volume(sid, prefix_hash, n, s).model_dump()
        return await link.call(
            "replay", s, "POST", "/amplituhedron/replay", json=body, ok=(200, 204)
        )

    responses = await asyncio.gather(*(one(s, sid) for s, sid in zip(chain, sids, strict=True)))
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
            for s, sid, (_, held) in zip(chain, sids, verdicts, strict=True)
            if held > keep
        )
    )
    return Replayed(False, keep, tuple(verdicts))


async def sample_cached(
    link: MeshLink,
    sids: Sequence[str],
    stations: Sequence[StationInfo] | None = None,
    logprobs: int | None = None,
) -> wire.Sampled:
    """After an all-hit replay: the exit station samples the first token from the cached
    logits (no model run), with its log-probabilities when ``logprobs`` asks for them.
    ``stations``: the sessions' chain."""
    exit_station = (link.stations if stations is None else stations)[-1]
    query = "" if logprobs is None else f"?logprobs={logprobs}"
    r = await link.call("first token", exit_station, "POST", f"/sessions/{sids[-1]}/sample{query}")
    return wire.Sampled.model_validate_json(r.content)


async def close_sessions(
    link: MeshLink, sids: Sequence[str | None], stations: Sequence[StationInfo] | None = None
) -> None:
    """Closes the sequence's sessions (None: not opened on that station), each within
    ``close_timeout``, on their chain ``stations`` (default: the current one). Already gone
    is fine; failures are not raised: the station's idle sweep is the backstop. A station
    marked down is asked too: a stalled one handles the close when it resumes."""
    chain = link.stations if stations is None else tuple(stations)
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
            for s, sid in zip(chain, sids, strict=True)
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
