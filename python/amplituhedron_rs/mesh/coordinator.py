"""The coordinator: a mesh of stations as one model (SPEC §6).

``generate()`` submits the request to the Rust engine (``Engine.external``: the one
generation loop of the runtime) and the :class:`~.executor.MeshExecutor` carries each step
through the stations:

1. an empty prompt is refused; the prompt is hashed once (BLAKE3 → u64);
2. its session opens on every station, all or nothing (each station draws its own id; a
   full station, 503, is retried with jittered backoff until ``open_deadline``), then the
   replay fan-out runs in parallel;
3. all hit → no prefill at all: the first token is sampled from the exit station's cached
   logits; otherwise chunked prefill steps from the shortest replayed prefix, the last
   chunk asking every station to capture the prompt's volume from its own KV;
4. decode steps, one request per station per step (with drafts when speculating: k+1 rows
   per hop, rejected positions rolled back on every station).

Several ``generate`` calls on one coordinator share steps (continuous batching). A station
that fails mid-session is replaced by a live replica of its range and the call goes on,
bit-identical (:mod:`.executor`); with no live replica the call ends with a
:class:`MeshError` naming the range, the station and the phase; the engine never emits a
token after a failure, and the sequence's sessions are
closed within ``close_timeout`` (a stalled station cannot hold the failure up). A damaged
replayed volume takes the erasure path on the station (SPEC §2): it answers ``partial`` with
one position fewer, and prefill resumes at the shortest replayed prefix.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh.client import Transport
from amplituhedron_rs.mesh.engine import MeshEngine
from amplituhedron_rs.mesh.hoptimes import HopTimes
from amplituhedron_rs.mesh.launcher import MeshSpec
from amplituhedron_rs.mesh.sessions import StationVerdict
from amplituhedron_rs.runtime.sampling import SamplingParams

__all__ = ["Coordinator", "MeshGeneration", "StationVerdict"]

#: Prompt chunks one step may carry through the stations as a pipeline: station ``k`` runs
#: chunk ``j`` while station ``k+1`` runs chunk ``j−1`` (SPEC §6).
PIPELINE_PIECES = 8


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
    draft_proposed: int = 0
    draft_accepted: int = 0
    verify_steps: int = 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["cache"] = {"hit": self.cache_hit, "stations": d.pop("stations")}
        return d


class Coordinator:
    """A client of one mesh. Use as an async context manager. ``chunk``: prompt rows per
    request to a station (at most its ``max_chunk``); a step pipelines up to one chunk per
    range (at most :data:`PIPELINE_PIECES`) through the stations."""

    def __init__(
        self,
        mesh: MeshSpec,
        *,
        token: str | None = None,
        chunk: int = 64,
        timeout: float = 120.0,
        close_timeout: float = 2.0,
        open_deadline: float = 10.0,
        max_running: int = 8,
        transport: Transport = "stream",
    ) -> None:
        """``token``: the mesh token (default: the mesh file's). ``timeout``: the longest any
        one station call may take; ``close_timeout``: the cleanup close's; ``open_deadline``:
        how long to retry opening on full stations (503). ``transport``: steps over the
        stations' step streams (where they serve one) or over HTTP only."""
        if chunk < 1:
            raise InputError(f"chunk must be at least 1, got {chunk}")
        self.mesh = mesh
        self.chunk = chunk
        # A step carries up to one chunk per range (at most PIPELINE_PIECES), which flow
        # through the stations pipelined; every running sequence's decode row fits a step.
        pieces = min(len(mesh.ranges), PIPELINE_PIECES)
        self._engine = MeshEngine(
            mesh,
            token=token,
            timeout=timeout,
            max_running=max_running,
            step_tokens=max(chunk * pieces, max_running),
            piece_rows=chunk,
            trace=True,
            close_timeout=close_timeout,
            open_deadline=open_deadline,
            transport=transport,
        )
        self._link = self._engine.executor.link
        self.hidden = 0
        self.vocab = 0
        self.fingerprint = ""

    async def __aenter__(self) -> Coordinator:
        await self._engine.__aenter__()
        health = self._engine.health
        assert health is not None
        self.hidden, self.vocab, self.fingerprint = health.hidden, health.vocab, health.fingerprint
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._engine.__aexit__(*exc)

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
        draft: str | None = None,
        draft_max: int = 8,
        tenant: str | None = None,
        grammar: _core.Grammar | None = None,
    ) -> MeshGeneration:
        """Generates ``max_new_tokens`` after ``prompt`` across the mesh.

        Sampling follows :class:`SamplingParams`' one rule, as ``Model.generate``: greedy
        exactly when no temperature/top-k/top-p is given or ``temperature=0``. The exit
        station samples with the session's seeded sampler — the single-process runtime's own
        Rust sampler — so the tokens match it, and no logits cross the wire per token.
        ``use_cache=False`` skips replay and capture for this call only.
        ``draft="prompt-lookup"`` speculates (greedy output unchanged). ``tenant`` partitions
        the volume cache (the server passes one per API key and ``cache_salt``); it travels in
        a header and the stations derive the salt from it and the mesh token. ``grammar``
        (compiled against the model's vocabulary) constrains the output token by token: the
        exit station samples under its mask, and generation stops once it is complete.
        """
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise InputError("the prompt is empty: a volume needs at least one token")
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if draft not in (None, "prompt-lookup"):
            raise InputError(f"draft must be None or 'prompt-lookup', got {draft!r}")
        # Validated here, before any station is touched.
        sampling = SamplingParams(temperature, top_k, top_p, seed).core_kwargs()
        started = time.perf_counter()
        run = await self._engine.run(
            prompt,
            max_new_tokens,
            sampling=sampling,
            stop_ids=stop_ids,
            salt=tenant,
            use_cache=use_cache,
            draft_max=draft_max if draft else None,
            on_token=on_token,
            grammar=grammar,
        )
        done = time.perf_counter()
        st = run.stats
        trace = run.trace
        assert trace is not None
        # The engine times admission (open + replay) to first token; the prefill phase is
        # what follows the replay, and nothing when every station replayed the prompt.
        prefill_ms = 0.0
        if any(v.prefill_requests for v in trace.stations):
            since_admission = float(st.get("prefill_ms", 0.0))
            prefill_ms = max(0.0, since_admission - trace.open_ms - trace.replay_ms)
        return MeshGeneration(
            prompt_ids=prompt,
            output_ids=run.output_ids,
            cache_hit=bool(st.get("cache_hit")),
            replayed_tokens=int(st.get("cached_tokens", 0)),
            open_ms=trace.open_ms,
            replay_ms=trace.replay_ms,
            prefill_ms=prefill_ms,
            decode_ms=float(st.get("decode_ms", 0.0)),
            latency_ms=(done - started) * 1e3,
            stop_reason=str(run.finished.reason),
            stations=trace.stations,
            draft_proposed=int(st.get("draft_proposed", 0)),
            draft_accepted=int(st.get("draft_accepted", 0)),
            verify_steps=int(st.get("verify_steps", 0)),
        )

    def time_hops(self, on: bool = True) -> None:
        """Starts (afresh) or stops timing where each hop's time goes: the stations then
        answer every step with their :class:`~.protocol.StepTiming` (benches)."""
        self._engine.executor.hop_times = {} if on else None

    def hop_times(self) -> dict[str, HopTimes]:
        """Per phase ("decode step", "prefill step", "rebuild"): the hops timed since
        :meth:`time_hops`."""
        return dict(self._engine.executor.hop_times or {})

    def failover_stats(self) -> dict[str, Any]:
        """What failover cost so far: failovers, rebuilt sequences, rebuild seconds, the
        time added per failover (mean, p50, max), stations down now, revivals."""
        return self._engine.executor.stats()

    async def stats(self) -> list[dict[str, Any]]:
        """Every live station's volume-cache stats (mesh order; down stations left out)."""
        rs = await asyncio.gather(
            *(
                self._link.call("stats", s, "GET", "/amplituhedron/stats")
                for s in self._link.replicas.live()
            )
        )
        return [r.json() for r in rs]

    async def configure(self, **settings: Any) -> None:
        """``/amplituhedron/configure`` on every live station (enabled, max_entries, …):
        changes the shared stations for every client, unlike ``generate(use_cache=False)``."""
        body = wire.ConfigureRequest(**settings).model_dump(exclude_unset=True)
        await asyncio.gather(
            *(
                self._link.call(
                    "configure",
                    s,
                    "POST",
                    "/amplituhedron/configure",
                    json=body,
                )
                for s in self._link.replicas.live()
            )
        )

    async def clear(self) -> None:
        """``/amplituhedron/clear`` on every live station."""
        await asyncio.gather(
            *(
                self._link.call("clear", s, "POST", "/amplituhedron/clear")
                for s in self._link.replicas.live()
            )
        )
