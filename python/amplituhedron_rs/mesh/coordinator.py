"""The coordinator: drives a mesh of stations over HTTP (SPEC §6).

``generate()``:
1. refuse an empty prompt; hash it once (BLAKE3 → u64);
2. open a session on every station and fan out ``/amplituhedron/replay`` in parallel;
3. all hit → no prefill at all: the first token is sampled from the exit station's cached
   logits; any miss → pipelined chunked prefill (chunk k+1 enters station 1 while chunk k is
   in station 2), then a capture fan-out that runs alongside decoding, off the latency path;
4. decode one token at a time through the stations.

A station that fails mid-session ends the call with a :class:`MeshError` naming the station
and the phase — the coordinator never emits a token a healthy run would not — and the
sessions it opened are closed (with a short timeout: a stalled station cannot hold the
failure up). Each station draws its own session id (a capability); a full station (503) is
retried with jittered backoff until ``open_deadline``. A damaged
replayed volume takes the erasure path on the station (SPEC §2): it answers ``partial`` with
one position fewer, and the coordinator prefills from the shortest replayed prefix.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError, MeshError
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh.client import Reply, StationClient, StationFailed, all_or_cancel
from amplituhedron_rs.mesh.generation import MeshGeneration, StationVerdict
from amplituhedron_rs.mesh.launcher import MeshSpec, StationInfo
from amplituhedron_rs.runtime.sampling import SamplingParams

__all__ = ["Coordinator", "MeshGeneration", "StationVerdict"]

OCTETS = {"Content-Type": wire.OCTETS}


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
        timeout: float = 30.0,
        close_timeout: float = 2.0,
        open_deadline: float = 10.0,
    ) -> None:
        """``token``: the mesh token (default: the mesh file's). ``timeout``: the longest any
        one station call may take; ``close_timeout``: the cleanup close's; ``open_deadline``:
        how long to retry opening on full stations (503)."""
        if chunk < 1:
            raise InputError(f"chunk must be at least 1, got {chunk}")
        self.mesh = mesh
        self.chunk = chunk
        self.close_timeout = close_timeout
        self.open_deadline = open_deadline
        token = token if token is not None else mesh.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = StationClient(timeout, headers)
        self._call = self._http.call
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
        healths = await asyncio.gather(
            *(self._call("health check", s.info, "GET", "/healthz") for s in self._stations)
        )
        reports = [wire.Health.model_validate_json(h.content) for h in healths]
        fingerprints = {h.fingerprint for h in reports}
        if len(fingerprints) != 1:
            raise MeshError(f"the stations run different models (fingerprints {fingerprints})")
        for s, h in zip(self._stations, reports, strict=True):
            if (h.layer_lo, h.layer_hi) != (s.info.layer_lo, s.info.layer_hi):
                raise MeshError(
                    f"station {s.info.url} owns layers {h.layer_lo}:{h.layer_hi}, "
                    f"the mesh file says {s.info.layer_lo}:{s.info.layer_hi}"
                )
        last = reports[-1]
        if last.n_layers != self.mesh.n_layers:
            raise MeshError(
                f"the mesh covers {self.mesh.n_layers} layers, the model has {last.n_layers}"
            )
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
        tenant: str | None = None,
    ) -> MeshGeneration:
        """Generates ``max_new_tokens`` after ``prompt`` across the mesh.

        Sampling follows :class:`SamplingParams`' one rule, as ``Model.generate``: greedy
        exactly when no temperature/top-k/top-p is given or ``temperature=0``. The exit
        station samples with the session's seeded sampler — the single-process runtime's own
        Rust sampler — so the tokens match it, and no logits cross the wire per token.
        ``use_cache=False`` skips replay and capture for this call only. ``tenant``
        partitions the volume cache (the server passes one per API key and ``cache_salt``);
        the stations derive the salt from it and the mesh token.
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
        verdicts = [
            StationVerdict(s.info.url, s.info.layer_lo, s.info.layer_hi) for s in self._stations
        ]
        opening = wire.OpenSessionRequest(prompt_tokens=prompt, sampling=sampling)
        sids = await self._open(opening.model_dump(mode="json"), tenant)
        opened = time.perf_counter()
        try:
            return await self._run(
                sids,
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
            await self._close(sids)
            raise

    async def _open(self, body: dict[str, Any], tenant: str | None) -> list[str]:
        """Opens the session on every station (each draws its own id). If any open fails,
        the ones that succeeded are closed at once; if every failure was a full station
        (503), the whole fan-out is retried with full-jitter exponential backoff until
        ``open_deadline``. Holding some stations' sessions while waiting for another's
        would let waiting clients starve each other (and the held sessions expire)."""
        headers = {wire.TENANT: tenant} if tenant is not None else {}
        deadline = time.monotonic() + self.open_deadline
        attempt = 0
        while True:
            calls = [
                asyncio.ensure_future(
                    self._call(
                        "session open", s.info, "POST", "/sessions", json=body, headers=headers
                    )
                )
                for s in self._stations
            ]
            try:
                await asyncio.wait(calls)
            except asyncio.CancelledError:
                # The caller gave up mid-open: close what did open before going.
                for c in calls:
                    c.cancel()
                await asyncio.wait(calls)
                await self._close([_opened(c) for c in calls])
                raise
            sids = [_opened(c) for c in calls]
            failed = [e for c in calls if (e := c.exception()) is not None]
            if not failed:
                return [sid for sid in sids if sid is not None]
            await self._close(sids)
            left = deadline - time.monotonic()
            full = all(isinstance(f, StationFailed) and f.status == 503 for f in failed)
            if not full or left <= 0:
                raise failed[0]
            # Full jitter keeps many refused clients from retrying in lockstep.
            await asyncio.sleep(min(left, random.uniform(0, min(2.0, 0.05 * 2**attempt))))
            attempt += 1

    async def _run(
        self,
        sids: list[str],
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
            cache_hit, resume_at = await self._replay(sids, prompt, prefix_hash, verdicts)
        replayed = time.perf_counter()
        prefill_ms = 0.0
        token: int | None = None
        if not cache_hit and resume_at < n:
            token = await self._prefill(sids, prompt, resume_at, verdicts)
            prefill_ms = (time.perf_counter() - replayed) * 1e3
        capture = None
        if use_cache and token is not None:
            # Off the latency path: runs while decoding, awaited before the session closes.
            capture = asyncio.ensure_future(self._capture(sids, prompt, prefix_hash, verdicts))
        output: list[int] = []
        stop_reason = "length"
        decode_start = time.perf_counter()
        try:
            if max_new_tokens > 0 and token is None:
                # All-hit (or a fully replayed prompt): the exit station samples the first token
                # from the cached logits, without running the model.
                token = await self._sample_cached(sids)
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
                token = await self._decode_step(sids, token, step)
            done = time.perf_counter()
            if capture is not None:
                await capture
        finally:
            # On any failure (or cancellation) the capture must not outlive the sessions.
            if capture is not None and not capture.done():
                capture.cancel()
                await asyncio.gather(capture, return_exceptions=True)
        await self._close(sids)
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
        self,
        sids: list[str],
        prompt: list[int],
        prefix_hash: int,
        verdicts: list[StationVerdict],
    ) -> tuple[bool, int]:
        """Replay fan-out. Returns (all stations hit, positions every station now holds)."""
        n = len(prompt)

        async def one(s: _Station, sid: str) -> Reply:
            body = _volume(sid, prefix_hash, n, s.info).model_dump()
            return await self._call(
                "replay", s.info, "POST", "/amplituhedron/replay", json=body, ok=(200, 204)
            )

        responses = await asyncio.gather(
            *(one(s, sid) for s, sid in zip(self._stations, sids, strict=True))
        )
        held = []
        for v, r in zip(verdicts, responses, strict=True):
            if r.status == 204:
                v.replay, v.replayed_tokens = "miss", 0
            else:
                v.replay = r.headers.get(wire.REPLAY_STATUS, "hit")
                v.replayed_tokens = int(r.headers.get(wire.REPLAY_KV_LEN, n))
            held.append(v.replayed_tokens)
        if all(v.replay == "hit" for v in verdicts) and (
            responses[-1].headers.get(wire.REPLAY_LOGITS) == "1"
        ):
            return True, n
        # Not a full hit: bring every station to the shortest replayed prefix. A miss
        # anywhere means a cold prefill everywhere (the seed's global branch).
        keep = 0 if any(v.replay == "miss" for v in verdicts) else min(held)
        await asyncio.gather(
            *(
                self._call(
                    "rollback",
                    s.info,
                    "POST",
                    f"/sessions/{sid}/rollback",
                    json=wire.RollbackRequest(clock=keep).model_dump(),
                )
                for s, sid, h in zip(self._stations, sids, held, strict=True)
                if h > keep
            )
        )
        for v in verdicts:
            v.replayed_tokens = keep
        return False, keep

    async def _prefill(
        self, sids: list[str], prompt: list[int], start: int, verdicts: list[StationVerdict]
    ) -> int:
        """Pipelined chunked prefill of ``prompt[start:]``: chunk k+1 enters station i while
        chunk k is in station i+1. Returns the first sampled token (sampled by the exit
        station from the last position's logits); each station keeps its own tail for the
        capture."""
        chunks = [prompt[i : i + self.chunk] for i in range(start, len(prompt), self.chunk)]
        k = len(self._stations)
        queues: list[asyncio.Queue[bytes | None]] = [asyncio.Queue() for _ in range(k)]
        for c in chunks:
            queues[0].put_nowait(np.asarray(c, dtype="<u4").tobytes())
        queues[0].put_nowait(None)
        first: list[int] = []
        row_bytes = self.hidden * 4

        async def worker(i: int) -> None:
            s, sid = self._stations[i], sids[i]
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
                if final and s.is_exit:
                    first.append(int(r.headers[wire.TOKEN]))
                if not s.is_exit:
                    queues[i + 1].put_nowait(hidden)
                index += 1
            if not s.is_exit:
                queues[i + 1].put_nowait(None)

        await all_or_cancel(worker(i) for i in range(k))
        return first[0]

    async def _capture(
        self,
        sids: list[str],
        prompt: list[int],
        prefix_hash: int,
        verdicts: list[StationVerdict],
    ) -> None:
        """Capture fan-out: each station freezes its own KV for the prompt with the tail it
        emitted (and, at the exit, the logits it computed) there; nothing is sent."""

        async def one(i: int, s: _Station) -> None:
            params = _volume(sids[i], prefix_hash, len(prompt), s.info).model_dump()
            r = await self._call("capture", s.info, "POST", "/amplituhedron/capture", params=params)
            verdicts[i].captured_bytes = wire.Captured.model_validate_json(r.content).bytes

        await all_or_cancel(one(i, s) for i, s in enumerate(self._stations))

    async def _sample_cached(self, sids: list[str]) -> int:
        exit_station = self._stations[-1].info
        r = await self._call("first token", exit_station, "POST", f"/sessions/{sids[-1]}/sample")
        return wire.Sampled.model_validate_json(r.content).token

    async def _decode_step(self, sids: list[str], token: int, step: int) -> int:
        """One token through every station; the exit station samples the next one."""
        body = np.asarray([token], dtype="<u4").tobytes()
        headers: Mapping[str, str] = {}
        for s, sid in zip(self._stations, sids, strict=True):
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

    async def _close(self, sids: Sequence[str | None]) -> None:
        """Closes the sessions (None: not opened there), each within ``close_timeout``: a
        stalled station must not hold up the error the caller is waiting for."""
        await asyncio.gather(
            *(
                self._call(
                    "close",
                    s.info,
                    "DELETE",
                    f"/sessions/{sid}",
                    ok=(200, 404),
                    timeout=self.close_timeout,
                )
                for s, sid in zip(self._stations, sids, strict=True)
                if sid is not None
            ),
            return_exceptions=True,
        )

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
                )
                for s in self._stations
            )
        )

    async def clear(self) -> None:
        """``/amplituhedron/clear`` on every station."""
        await asyncio.gather(
            *(self._call("clear", s.info, "POST", "/amplituhedron/clear") for s in self._stations)
        )


def _opened(call: asyncio.Future[Reply]) -> str | None:
    """The session id an open call got, if it completed."""
    if call.cancelled() or call.exception() is not None:
        return None
    return wire.SessionOpened.model_validate_json(call.result().content).session_id


def _volume(sid: str, prefix_hash: int, prefix_len: int, info: StationInfo) -> wire.VolumeRequest:
    return wire.VolumeRequest(
        session_id=sid,
        prefix_hash=str(prefix_hash),
        prefix_len=prefix_len,
        layer_lo=info.layer_lo,
        layer_hi=info.layer_hi,
    )
