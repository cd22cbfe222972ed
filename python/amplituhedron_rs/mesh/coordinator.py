"""The coordinator: drives a mesh of stations over HTTP (SPEC §6).

``generate()``:
1. refuse an empty prompt; hash it once (BLAKE3 → u64);
2. open a session on every station and fan out ``/amplituhedron/replay`` in parallel;
3. all hit → no prefill at all: the first token is sampled from the exit station's cached
   logits; any miss → pipelined chunked prefill (chunk k+1 enters station 1 while chunk k is
   in station 2), then a capture fan-out that runs alongside decoding, off the latency path;
4. decode one token at a time through the stations.

A station that fails mid-session ends the call with a :class:`MeshError` naming the station
and the phase — the coordinator never emits a token a healthy run would not. A damaged
replayed volume takes the erasure path on the station (SPEC §2): it answers ``partial`` with
one position fewer, and the coordinator prefills from the shortest replayed prefix.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh import sessions
from amplituhedron_rs.mesh.client import StationClient
from amplituhedron_rs.mesh.launcher import MeshSpec, StationInfo
from amplituhedron_rs.mesh.sessions import MeshLink, volume
from amplituhedron_rs.runtime.sampling import SamplingParams

OCTETS = {"Content-Type": wire.OCTETS}


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
class MeshGeneration:
    """The result of one :meth:`Coordinator.generate` call."""

    prompt_ids: list[int]
    output_ids: list[int]
    cache_hit: bool
    replayed_tokens: int
    open_ms: float
    replay_ms: float
    prefill_ms: float
    decode_ms: float
    latency_ms: float
    stop_reason: str
    stations: list[StationVerdict] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["cache"] = {"hit": self.cache_hit, "stations": d.pop("stations")}
        return d


@dataclass(frozen=True)
class _Station:
    info: StationInfo
    is_exit: bool


class Coordinator:
    """A client of one mesh. Use as an async context manager."""

    def __init__(
        self,
        mesh: MeshSpec,
        *,
        token: str | None = None,
        chunk: int = 64,
        timeout: float = 120.0,
    ) -> None:
        if chunk < 1:
            raise InputError(f"chunk must be at least 1, got {chunk}")
        self.mesh = mesh
        self.chunk = chunk
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = StationClient(timeout)
        self._call = self._http.call
        self._link = MeshLink(mesh, self._http, self._headers)
        self.hidden = 0
        self.vocab = 0
        self.fingerprint = ""
        self._stations = [
            _Station(s, i == len(mesh.stations) - 1) for i, s in enumerate(mesh.stations)
        ]

    async def __aenter__(self) -> Coordinator:
        self._http.open()
        try:
            await self._check_mesh()
        except BaseException:
            await self._http.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.close()

    async def _check_mesh(self) -> None:
        last = await sessions.check_mesh(self._link)
        self.hidden = last.hidden
        self.vocab = last.vocab
        self.fingerprint = last.fingerprint

    # ---------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int = 16,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        use_cache: bool = True,
        stop_ids: Sequence[int] = (),
        on_token: Callable[[int], None] | None = None,
    ) -> MeshGeneration:
        """Generates ``max_new_tokens`` after ``prompt`` across the mesh.

        Sampling follows :class:`SamplingParams`' one rule, as ``Model.generate``: greedy
        exactly when no temperature/top-k/top-p is given or ``temperature=0``. The exit
        station samples with the session's seeded sampler — the single-process runtime's own
        Rust sampler — so the tokens match it, and no logits cross the wire per token.
        ``use_cache=False`` skips replay and capture for this call only.
        """
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise InputError("the prompt is empty: a volume needs at least one token")
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        # Validated here, before any station is touched.
        sampling = wire.SamplingSpec.of(SamplingParams(temperature, top_k, top_p, seed))
        started = time.perf_counter()
        prefix_hash = int(_core.prefix_hash(prompt))  # hashed once
        sid = uuid.uuid4().hex
        verdicts = [
            StationVerdict(s.info.url, s.info.layer_lo, s.info.layer_hi) for s in self._stations
        ]
        opening = wire.OpenSessionRequest(prompt_tokens=prompt, session_id=sid, sampling=sampling)
        opening_json = opening.model_dump(mode="json")
        await asyncio.gather(
            *(
                self._call("session open", s.info, "POST", "/sessions", json=opening_json)
                for s in self._stations
            )
        )
        opened = time.perf_counter()
        try:
            return await self._run(
                sid,
                prompt,
                prefix_hash,
                max_new_tokens,
                use_cache,
                stop_ids,
                on_token,
                verdicts,
                started,
                opened,
            )
        except BaseException:
            await self._close(sid)
            raise

    async def _run(
        self,
        sid: str,
        prompt: list[int],
        prefix_hash: int,
        max_new_tokens: int,
        use_cache: bool,
        stop_ids: Sequence[int],
        on_token: Callable[[int], None] | None,
        verdicts: list[StationVerdict],
        started: float,
        opened: float,
    ) -> MeshGeneration:
        n = len(prompt)
        cache_hit, resume_at = False, 0
        if use_cache:
            cache_hit, resume_at = await self._replay(sid, prompt, prefix_hash, verdicts)
        replayed = time.perf_counter()
        tails: list[bytes] = []
        prefill_ms = 0.0
        token: int | None = None
        if not cache_hit and resume_at < n:
            token, tails = await self._prefill(sid, prompt, resume_at, verdicts)
            prefill_ms = (time.perf_counter() - replayed) * 1e3
        capture = None
        if use_cache and not cache_hit and tails:
            # Off the latency path: runs while decoding, awaited before the session closes.
            capture = asyncio.ensure_future(
                self._capture(sid, prompt, prefix_hash, tails, verdicts)
            )
        output: list[int] = []
        stop_reason = "length"
        decode_start = time.perf_counter()
        if max_new_tokens > 0 and token is None:
            # All-hit (or a fully replayed prompt): the exit station samples the first token
            # from the cached logits, without running the model.
            token = await self._sample_cached(sid)
        for step in range(max_new_tokens):
            assert token is not None
            output.append(token)
            if on_token is not None:
                on_token(token)
            if token in stop_ids:
                stop_reason = "stop"
                break
            if step + 1 == max_new_tokens:
                break
            token = await self._decode_step(sid, token, step)
        done = time.perf_counter()
        if capture is not None:
            await capture
        await self._close(sid)
        return MeshGeneration(
            prompt_ids=prompt,
            output_ids=output,
            cache_hit=cache_hit,
            replayed_tokens=min(v.replayed_tokens for v in verdicts),
            open_ms=(opened - started) * 1e3,
            replay_ms=(replayed - opened) * 1e3,
            prefill_ms=prefill_ms,
            decode_ms=(done - decode_start) * 1e3,
            latency_ms=(done - started) * 1e3,
            stop_reason=stop_reason,
            stations=verdicts,
        )

    async def _replay(
        self, sid: str, prompt: list[int], prefix_hash: int, verdicts: list[StationVerdict]
    ) -> tuple[bool, int]:
        """Replay fan-out. Returns (all stations hit, positions every station now holds)."""
        found = await sessions.replay(self._link, sid, prompt, prefix_hash)
        for v, (status, held) in zip(verdicts, found.verdicts, strict=True):
            v.replay, v.replayed_tokens = status, held if found.hit else found.kept
        return found.hit, found.kept

    async def _prefill(
        self, sid: str, prompt: list[int], start: int, verdicts: list[StationVerdict]
    ) -> tuple[int, list[bytes]]:
        """Pipelined chunked prefill of ``prompt[start:]``: chunk k+1 enters station i while
        chunk k is in station i+1. Returns the first sampled token (sampled by the exit
        station from the last position's logits) and each station's tail residual (its
        output row at the last position)."""
        chunks = [prompt[i : i + self.chunk] for i in range(start, len(prompt), self.chunk)]
        k = len(self._stations)
        queues: list[asyncio.Queue[bytes | None]] = [asyncio.Queue() for _ in range(k)]
        for c in chunks:
            queues[0].put_nowait(np.asarray(c, dtype="<u4").tobytes())
        queues[0].put_nowait(None)
        tails: list[bytes] = [b""] * k
        first: list[int] = []
        row_bytes = self.hidden * 4

        async def worker(i: int) -> None:
            s = self._stations[i]
            index = 0
            while (body := await queues[i].get()) is not None:
                final = index == len(chunks) - 1
                params = {"hidden": "last" if s.is_exit else "all"}
                if s.is_exit and final:
                    params["sample"] = "true"
                r = await self._call(
                    "prefill",
                    s.info,
                    "POST",
                    f"/sessions/{sid}/forward",
                    content=body,
                    params=params,
                    headers=OCTETS,
                )
                verdicts[i].prefill_requests += 1
                rows = int(r.headers[wire.HIDDEN_ROWS])
                hidden = r.content[: rows * row_bytes]
                if final:
                    tails[i] = hidden[-row_bytes:]
                    if s.is_exit:
                        first.append(int(r.headers[wire.TOKEN]))
                if not s.is_exit:
                    queues[i + 1].put_nowait(hidden)
                index += 1
            if not s.is_exit:
                queues[i + 1].put_nowait(None)

        await asyncio.gather(*(worker(i) for i in range(k)))
        return first[0], tails

    async def _capture(
        self,
        sid: str,
        prompt: list[int],
        prefix_hash: int,
        tails: list[bytes],
        verdicts: list[StationVerdict],
    ) -> None:
        """Capture fan-out: each station freezes its KV for the prompt plus its tail residual
        (the exit station adds the logits it kept for the prompt's last position)."""

        async def one(i: int, s: _Station) -> None:
            params = volume(sid, prefix_hash, len(prompt), s.info).model_dump()
            r = await self._call(
                "capture",
                s.info,
                "POST",
                "/amplituhedron/capture",
                content=tails[i],
                params=params,
                headers={**OCTETS, **self._headers},
            )
            verdicts[i].captured_bytes = wire.Captured.model_validate_json(r.content).bytes

        await asyncio.gather(*(one(i, s) for i, s in enumerate(self._stations)))

    async def _sample_cached(self, sid: str) -> int:
        return await sessions.sample_cached(self._link, sid)

    async def _decode_step(self, sid: str, token: int, step: int) -> int:
        """One token through every station; the exit station samples the next one."""
        body = np.asarray([token], dtype="<u4").tobytes()
        headers: Mapping[str, str] = {}
        for s in self._stations:
            params = (
                {"hidden": "none", "logits": "none", "sample": "true"}
                if s.is_exit
                else {"hidden": "all"}
            )
            r = await self._call(
                f"decode step {step}",
                s.info,
                "POST",
                f"/sessions/{sid}/decode",
                content=body,
                params=params,
                headers=OCTETS,
            )
            body, headers = r.content, r.headers
        return int(headers[wire.TOKEN])

    async def _close(self, sid: str) -> None:
        await sessions.close_sessions(self._link, sid)

    async def stats(self) -> list[dict[str, Any]]:
        """Every station's volume-cache stats."""
        rs = await asyncio.gather(
            *(self._call("stats", s.info, "GET", "/amplituhedron/stats") for s in self._stations)
        )
        return [r.json() for r in rs]

    async def configure(self, **settings: Any) -> None:
        """``/amplituhedron/configure`` on every station (enabled, max_entries, …): changes
        the shared stations for every client, unlike ``generate(use_cache=False)``."""
        body = wire.ConfigureRequest(**settings).model_dump(exclude_unset=True)
        await asyncio.gather(
            *(
                self._call(
                    "configure",
                    s.info,
                    "POST",
                    "/amplituhedron/configure",
                    json=body,
                    headers=self._headers,
                )
                for s in self._stations
            )
        )

    async def clear(self) -> None:
        """``/amplituhedron/clear`` on every station."""
        await asyncio.gather(
            *(
                self._call("clear", s.info, "POST", "/amplituhedron/clear", headers=self._headers)
                for s in self._stations
            )
        )
