"""The coordinator: drives a mesh of stations over HTTP (SPEC §6, seed 001 §4).

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

import aiohttp
import numpy as np
from multidict import CIMultiDict

from amplituhedron_rs import _core
from amplituhedron_rs.mesh import MeshError, MeshSpec, StationInfo
from amplituhedron_rs.model import sampling_params

OCTETS = {"Content-Type": "application/octet-stream"}


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
class Reply:
    """A station's answer, read in full."""

    status: int
    headers: Mapping[str, str]  # case-insensitive
    content: bytes

    def json(self) -> Any:
        import json

        return json.loads(self.content)


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
            raise ValueError(f"chunk must be at least 1, got {chunk}")
        self.mesh = mesh
        self.chunk = chunk
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._client: aiohttp.ClientSession | None = None
        self.hidden = 0
        self.vocab = 0
        self.fingerprint = ""
        self._stations = [
            _Station(s, i == len(mesh.stations) - 1) for i, s in enumerate(mesh.stations)
        ]
        self._background: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Coordinator:
        # aiohttp keeps connections alive per host and costs ~0.25 ms a request on loopback
        # (httpx measured ~1.5 ms here), which is most of the per-hop budget.
        self._client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout),
            connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=60),
        )
        try:
            await self._check_mesh()
        except BaseException:
            await self._client.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    @property
    def client(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise RuntimeError("use the Coordinator as `async with Coordinator(...) as c:`")
        return self._client

    async def _check_mesh(self) -> None:
        healths = await asyncio.gather(
            *(self._call("health check", s.info, "GET", "/healthz") for s in self._stations)
        )
        fingerprints = {h.json()["fingerprint"] for h in healths}
        if len(fingerprints) != 1:
            raise MeshError(f"the stations run different models (fingerprints {fingerprints})")
        for s, h in zip(self._stations, healths, strict=True):
            j = h.json()
            if (j["layer_lo"], j["layer_hi"]) != (s.info.layer_lo, s.info.layer_hi):
                raise MeshError(
                    f"station {s.info.url} owns layers {j['layer_lo']}:{j['layer_hi']}, "
                    f"the mesh file says {s.info.layer_lo}:{s.info.layer_hi}"
                )
        last = healths[-1].json()
        if int(last["n_layers"]) != self.mesh.n_layers:
            raise MeshError(
                f"the mesh covers {self.mesh.n_layers} layers, the model has {last['n_layers']}"
            )
        self.hidden = int(last["hidden"])
        self.vocab = int(last["vocab"])
        self.fingerprint = str(last["fingerprint"])

    async def _call(
        self,
        phase: str,
        station: StationInfo,
        method: str,
        path: str,
        *,
        ok: Sequence[int] = (200, 201),
        **kwargs: Any,
    ) -> Reply:
        if "content" in kwargs:
            kwargs["data"] = kwargs.pop("content")
        try:
            async with self.client.request(method, station.url + path, **kwargs) as r:
                reply = Reply(r.status, CIMultiDict(r.headers), await r.read())
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise MeshError(f"station {station.url} failed during {phase}: {exc!r}") from exc
        if reply.status not in ok:
            try:
                detail = reply.json().get("detail", reply.content.decode(errors="replace"))
            except ValueError:
                detail = reply.content.decode(errors="replace")
            raise MeshError(
                f"station {station.url} answered {reply.status} during {phase}: {detail}"
            )
        return reply

    # ---------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int = 16,
        *,
        greedy: bool | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        use_cache: bool = True,
        stop_ids: Sequence[int] = (),
        on_token: Callable[[int], None] | None = None,
    ) -> MeshGeneration:
        """Generates ``max_new_tokens`` after ``prompt`` across the mesh.

        Greedy unless a temperature/top-k/top-p is given (as ``Model.generate``). The exit
        station samples with the session's seeded sampler — the single-process runtime's own
        Rust sampler — so the tokens match it, and no logits cross the wire per token.
        """
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty: a volume needs at least one token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        # Validated here, before any station is touched.
        sampling = sampling_params(greedy, temperature, top_k, top_p, seed)
        started = time.perf_counter()
        prefix_hash = int(_core.prefix_hash(prompt))  # hashed once
        sid = uuid.uuid4().hex
        verdicts = [
            StationVerdict(s.info.url, s.info.layer_lo, s.info.layer_hi) for s in self._stations
        ]
        opening = {"prompt_tokens": prompt, "session_id": sid, "sampling": sampling}
        await asyncio.gather(
            *(
                self._call("session open", s.info, "POST", "/sessions", json=opening)
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
        n = len(prompt)

        async def one(s: _Station) -> Reply:
            body = {
                "session_id": sid,
                "prefix_hash": str(prefix_hash),
                "prefix_len": n,
                "layer_lo": s.info.layer_lo,
                "layer_hi": s.info.layer_hi,
            }
            return await self._call(
                "replay", s.info, "POST", "/amplituhedron/replay", json=body, ok=(200, 204)
            )

        responses = await asyncio.gather(*(one(s) for s in self._stations))
        held = []
        for v, r in zip(verdicts, responses, strict=True):
            if r.status == 204:
                v.replay, v.replayed_tokens = "miss", 0
            else:
                v.replay = r.headers.get("X-Amplituhedron-Status", "hit")
                v.replayed_tokens = int(r.headers.get("X-Amplituhedron-Kv-Len", n))
            held.append(v.replayed_tokens)
        if all(v.replay == "hit" for v in verdicts) and (
            responses[-1].headers.get("X-Amplituhedron-Logits") == "1"
        ):
            return True, n
        # Not a full hit: bring every station to the shortest replayed prefix. A miss
        # anywhere means a cold prefill everywhere (the seed's global branch).
        keep = 0 if any(v.replay == "miss" for v in verdicts) else min(held)
        await asyncio.gather(
            *(
                self._call(
                    "rollback", s.info, "POST", f"/sessions/{sid}/rollback", json={"clock": keep}
                )
                for s, h in zip(self._stations, held, strict=True)
                if h > keep
            )
        )
        for v in verdicts:
            v.replayed_tokens = keep
        return False, keep

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
                rows = int(r.headers["X-Hidden-Rows"])
                hidden = r.content[: rows * row_bytes]
                if final:
                    tails[i] = hidden[-row_bytes:]
                    if s.is_exit:
                        first.append(int(r.headers["X-Token"]))
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
            params = {
                "session_id": sid,
                "prefix_hash": str(prefix_hash),
                "prefix_len": len(prompt),
                "layer_lo": s.info.layer_lo,
                "layer_hi": s.info.layer_hi,
            }
            r = await self._call(
                "capture",
                s.info,
                "POST",
                "/amplituhedron/capture",
                content=tails[i],
                params=params,
                headers={**OCTETS, **self._headers},
            )
            verdicts[i].captured_bytes = int(r.json()["bytes"])

        await asyncio.gather(*(one(i, s) for i, s in enumerate(self._stations)))

    async def _sample_cached(self, sid: str) -> int:
        exit_station = self._stations[-1].info
        r = await self._call("first token", exit_station, "POST", f"/sessions/{sid}/sample")
        return int(r.json()["token"])

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
        return int(headers["X-Token"])

    async def _close(self, sid: str) -> None:
        await asyncio.gather(
            *(
                self._call("close", s.info, "DELETE", f"/sessions/{sid}", ok=(200, 404))
                for s in self._stations
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
        """``/amplituhedron/configure`` on every station (enabled, max_entries, …)."""
        await asyncio.gather(
            *(
                self._call(
                    "configure",
                    s.info,
                    "POST",
                    "/amplituhedron/configure",
                    json=settings,
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


def cli_generate_over_mesh(a: Any) -> int:
    """``amplituhedron generate --mesh …`` / ``--stations K``."""
    import json

    from rich.console import Console

    from amplituhedron_rs.cli import _sampling_kwargs
    from amplituhedron_rs.gguf_file import read_model_file
    from amplituhedron_rs.mesh import LocalMesh
    from amplituhedron_rs.tokenizer import Tokenizer

    err = Console(stderr=True)
    out = Console()
    with err.status("reading the tokenizer…"):
        tok = Tokenizer(read_model_file(a.model))
    if a.prompt_ids is not None:
        ids = a.prompt_ids
    elif a.chat or a.system:
        ids = tok.chat_ids(a.system, a.prompt)
    else:
        ids = tok.encode(a.prompt)
    kw = _sampling_kwargs(a)
    local: LocalMesh | None = None
    try:
        if a.stations:
            with err.status(f"starting {a.stations} stations…"):
                local = LocalMesh(a.stations, model_path=a.model)
                mesh = local.start()
        else:
            mesh = MeshSpec.load(a.mesh)

        async def run() -> None:
            async with Coordinator(mesh, token=a.token) as c:
                if a.no_cache:
                    await c.configure(enabled=False)
                for _ in range(max(1, a.repeat)):
                    g = await _generate_streamed(c, tok, ids, a, kw)
                    if a.json:
                        d = g.to_json()
                        d["text"] = tok.decode(g.output_ids, skip_special=True)
                        print(json.dumps(d))
                    else:
                        out.print()
                        verdicts = " ".join(
                            f"{v.layer_lo}:{v.layer_hi}={v.replay}" for v in g.stations
                        )
                        err.print(
                            f"[dim]{len(mesh.stations)} stations · cache {verdicts} · "
                            f"replay {g.replay_ms:.1f} ms · prefill {g.prefill_ms:.1f} ms · "
                            f"decode {g.decode_ms:.1f} ms · latency {g.latency_ms:.1f} ms[/dim]"
                        )

        asyncio.run(run())
    finally:
        if local is not None:
            local.close()
    return 0


async def _generate_streamed(
    c: Coordinator, tok: Any, ids: list[int], a: Any, sampling: dict[str, Any]
) -> MeshGeneration:
    """One mesh generation, streaming text to the terminal unless ``--json``."""
    from rich.console import Console

    from amplituhedron_rs.tokenizer import StreamDecoder

    out = Console()
    decoder = StreamDecoder(tok)

    def on_token(t: int) -> None:
        if not a.json:
            out.print(decoder.push(t), end="", markup=False, highlight=False)

    return await c.generate(
        ids,
        a.max_new_tokens,
        **sampling,
        use_cache=not a.no_cache,
        stop_ids=[tok.eos_id] if tok.eos_id is not None else [],
        on_token=on_token,
    )
