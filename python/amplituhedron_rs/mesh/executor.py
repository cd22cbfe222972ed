"""The mesh executor: the Rust engine's continuous batching, run through a mesh (SPEC §6,
§10, §11).

The engine (``_core.Engine.external``) plans; this executor carries each plan out:

- admissions open the sequence's session on every station, all or nothing (with its
  sampling, and its salt as the tenant header; each station draws its own id, so a sequence
  holds one per station), then the replay fan-out (exact, then longest-prefix, per
  station); on an all-hit the exit station samples the first token from the cached logits;
- each planned step goes through the stations in order with ONE request per station
  (``/batch/step``): every running sequence's decode row (plus its drafts when speculating:
  k+1 rows per hop) and the prompt chunks the budget allows. The exit station samples or
  verifies with each session's own seeded sampler, so only token ids come back; a station
  rolls back positions of rejected drafts itself, from each entry's start;
- an entry that ends a prompt asks every station to capture the prompt's volume from its
  own KV (no tensor crosses the wire for it);
- released sequences (finished, cancelled) have their sessions closed on every station.

There is no generation loop here: the engine decides what runs, stops and finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs._core import MeshError
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh import sessions
from amplituhedron_rs.mesh.client import StationClient
from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec
from amplituhedron_rs.mesh.sessions import MeshLink, StationVerdict


def sampling_of(a: _core.EngineAdmission) -> wire.SamplingSpec:
    """The session's sampling on the wire: the same core sampler as the engine's."""
    if a.greedy:
        return wire.SamplingSpec(seed=a.seed)
    return wire.SamplingSpec(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)


@dataclass
class SeqTrace:
    """What the mesh did for one sequence: admission timings and each station's verdict."""

    open_ms: float = 0.0
    replay_ms: float = 0.0
    stations: list[StationVerdict] = field(default_factory=list)


class MeshExecutor:
    """Runs an external engine's admissions, steps and releases through a mesh. With
    ``trace``, each sequence's :class:`SeqTrace` is kept in ``traces`` until its reader
    pops it (a server leaves it off)."""

    def __init__(self, engine: _core.Engine, link: MeshLink, *, trace: bool = False) -> None:
        self.engine = engine
        self.link = link
        #: Each live sequence's session ids (one per station, drawn by it) and cache use.
        self.sids: dict[int, list[str]] = {}
        self.use_cache: dict[int, bool] = {}
        self.hops = 0
        self.trace = trace
        self.traces: dict[int, SeqTrace] = {}

    @property
    def live(self) -> int:
        """Sequences holding sessions on the stations."""
        return len(self.sids)

    async def step(self) -> list[_core.EngineEvent]:
        """One engine step through the mesh (the in-process engine's ``step()``, over HTTP)."""
        await self._release(self.engine.take_released())
        events: list[_core.EngineEvent] = []
        admissions = self.engine.plan_admissions()
        if admissions:
            results = await asyncio.gather(*(self._admit(a) for a in admissions))
            events.extend(self.engine.admitted(list(results)))
        batch = self.engine.plan_batch()
        if batch:
            try:
                emitted = await self._run(batch)
            except MeshError as exc:
                # Every sequence of the step finishes with the error: no token after it.
                events.extend(self.engine.complete([], error=str(exc)))
            else:
                events.extend(self.engine.complete(emitted))
        await self._release(self.engine.take_released())
        return events

    async def close(self) -> None:
        """Closes every session still open (shutdown)."""
        await self._release(list(self.sids))

    async def _admit(self, a: _core.EngineAdmission) -> tuple[int, int, int | None, str | None]:
        opening = wire.OpenSessionRequest(prompt_tokens=list(a.prompt), sampling=sampling_of(a))
        trace = SeqTrace(
            stations=[StationVerdict(s.url, s.layer_lo, s.layer_hi) for s in self.link.stations]
        )
        if self.trace:
            self.traces[a.seq] = trace
        started = time.perf_counter()
        try:
            sids = await sessions.open_sessions(self.link, opening, tenant=a.salt)
        except MeshError as exc:
            return a.seq, 0, None, str(exc)
        opened = time.perf_counter()
        trace.open_ms = (opened - started) * 1e3
        self.sids[a.seq] = sids
        self.use_cache[a.seq] = a.use_cache
        try:
            if not a.use_cache:
                return a.seq, 0, None, None
            found = await sessions.replay(
                self.link, sids, a.prompt, int(_core.prefix_hash(a.prompt))
            )
            trace.replay_ms = (time.perf_counter() - opened) * 1e3
            for v, (status, held) in zip(trace.stations, found.verdicts, strict=True):
                v.replay, v.replayed_tokens = status, held if found.hit else found.kept
            if not found.hit:
                return a.seq, found.kept, None, None
            first = await sessions.sample_cached(self.link, sids) if a.sample_first else None
            return a.seq, len(a.prompt), first, None
        except MeshError as exc:
            # The engine finishes the sequence with the error and releases it.
            return a.seq, 0, None, str(exc)

    async def _run(self, batch: Sequence[_core.EngineEntry]) -> list[list[int]]:
        """One step: one request per station, in order; the exit station's emitted tokens.
        Each station's header names the sessions by its own ids."""
        try:
            sids = [self.sids[e.seq] for e in batch]
            specs = [
                wire.BatchEntrySpec(
                    session_id=ids[0],
                    start=e.start,
                    tokens=list(e.tokens),
                    kind=e.kind,
                    last=e.last,
                    emit=e.emit and e.kind == "prefill",
                    capture=e.last and self.use_cache[e.seq],
                )
                for e, ids in zip(batch, sids, strict=True)
            ]
        except KeyError as exc:
            raise MeshError(f"sequence {exc} has no sessions on the mesh") from exc
        payload: bytes | memoryview = b""
        reply = None
        phase = "decode step" if all(e.kind == "decode" for e in specs) else "prefill step"
        for i, s in enumerate(self.link.stations):
            header = wire.BatchStepRequest(
                entries=[
                    spec.model_copy(update={"session_id": ids[i]})
                    for spec, ids in zip(specs, sids, strict=True)
                ]
            )
            r = await self.link.call(
                phase,
                s,
                "POST",
                wire.BATCH_ROUTE,
                content=wire.pack_frame(header, bytes(payload)),
                headers={"Content-Type": wire.OCTETS},
            )
            self.hops += 1
            try:
                head, payload = wire.split_frame(r.content)
                reply = wire.BatchStepReply.model_validate_json(head)
            except ValueError as exc:
                raise MeshError(f"station {s.url} answered a malformed step: {exc}") from exc
            if len(reply.entries) != len(specs):
                raise MeshError(
                    f"station {s.url} answered {len(reply.entries)} entries for {len(specs)}"
                )
            if self.trace:
                self._note(i, batch, specs, reply)
        assert reply is not None
        return [list(r.emitted) for r in reply.entries]

    def _note(
        self,
        station: int,
        batch: Sequence[_core.EngineEntry],
        specs: Sequence[wire.BatchEntrySpec],
        reply: wire.BatchStepReply,
    ) -> None:
        """Counts prefill requests and captured bytes per station, for the trace."""
        for e, spec, res in zip(batch, specs, reply.entries, strict=True):
            trace = self.traces.get(e.seq)
            if trace is None or spec.kind != "prefill":
                continue
            trace.stations[station].prefill_requests += 1
            if spec.capture:
                trace.stations[station].captured_bytes = res.captured

    async def _release(self, seqs: Sequence[int]) -> None:
        gone = [(seq, self.sids[seq]) for seq in seqs if seq in self.sids]
        if gone:
            await asyncio.gather(*(sessions.close_sessions(self.link, ids) for _, ids in gone))
        # Forgotten once closed, so a live count of 0 means the stations hold none.
        for seq, _ in gone:
            del self.sids[seq]
            self.use_cache.pop(seq, None)


def mesh_link(
    mesh: MeshSpec,
    token: str | None,
    timeout: float,
    close_timeout: float = 2.0,
    open_deadline: float = 10.0,
) -> MeshLink:
    """The link to a mesh; ``token`` defaults to the mesh file's."""
    token = token if token is not None else mesh.token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return MeshLink(mesh, StationClient(timeout), headers, close_timeout, open_deadline)


class MeshStepper:
    """Steps a :class:`MeshExecutor` from a plain thread (the server's engine thread): it owns
    an event loop and the connection pool to the stations, and closes both (and every
    session still open) at the end. ``owned`` is stopped then too (a local mesh it started)."""

    def __init__(
        self,
        engine: _core.Engine,
        mesh: MeshSpec,
        *,
        token: str | None = None,
        timeout: float = 120.0,
        owned: LocalMesh | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.owned = owned
        link = mesh_link(mesh, token, timeout)
        self.executor = MeshExecutor(engine, link)
        self.health: wire.Health | None = None

    def open(self) -> wire.Health:
        """Connects and checks the mesh (every station answers, one model, the right layers)."""

        async def go() -> wire.Health:
            self.executor.link.http.open()
            return await sessions.check_mesh(self.executor.link)

        self.health = self.loop.run_until_complete(go())
        return self.health

    def step(self) -> list[_core.EngineEvent]:
        return self.loop.run_until_complete(self.executor.step())

    @property
    def live_sequences(self) -> int:
        return self.executor.live

    @property
    def station_requests(self) -> int:
        return self.executor.hops

    def close(self) -> None:
        async def go() -> None:
            try:
                await self.executor.close()
            finally:
                await self.executor.link.http.close()

        try:
            self.loop.run_until_complete(go())
        finally:
            self.loop.close()
            if self.owned is not None:
                self.owned.close()


@dataclass
class MeshRun:
    """One request's run through a mesh: its tokens and the engine's finished event."""

    output_ids: list[int]
    finished: _core.EngineEvent
    #: What the mesh did (when the engine traces).
    trace: SeqTrace | None = None

    @property
    def stats(self) -> dict[str, Any]:
        return dict(self.finished.stats or {})


class MeshEngine:
    """The engine over a mesh for asyncio callers: ``await run(...)`` submits a request; one
    driver task steps the engine (through :class:`MeshExecutor`) while anything is waiting
    or running, so concurrent calls share steps. Use as ``async with``."""

    def __init__(
        self,
        mesh: MeshSpec,
        *,
        token: str | None = None,
        timeout: float = 120.0,
        max_running: int = 8,
        max_queue: int = 64,
        step_tokens: int = 64,
        trace: bool = False,
        close_timeout: float = 2.0,
        open_deadline: float = 10.0,
    ) -> None:
        self.engine = _core.Engine.external(
            max_running=max_running, max_queue=max_queue, step_tokens=step_tokens
        )
        link = mesh_link(mesh, token, timeout, close_timeout, open_deadline)
        self.executor = MeshExecutor(self.engine, link, trace=trace)
        self.health: wire.Health | None = None
        self._queues: dict[int, asyncio.Queue[_core.EngineEvent]] = {}
        self._driver: asyncio.Task[None] | None = None
        self._failure: Exception | None = None

    async def __aenter__(self) -> MeshEngine:
        self.executor.link.http.open()
        try:
            self.health = await sessions.check_mesh(self.executor.link)
        except BaseException:
            await self.executor.link.http.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        try:
            await self.executor.close()
        finally:
            await self.executor.link.http.close()

    async def run(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        sampling: dict[str, Any] | None = None,
        stop_ids: Sequence[int] = (),
        salt: str | None = None,
        use_cache: bool = True,
        draft_max: int | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> MeshRun:
        """Generates through the mesh; a bad request raises InputError before anything
        runs, a mesh failure MeshError. Cancelling the caller cancels the request. ``salt``
        is the tenant (sent as the tenant header; the stations key the cache salt by it)."""
        seq = self.engine.submit(
            list(prompt),
            max_new_tokens,
            **(sampling or {}),
            stop_ids=list(stop_ids),
            salt=salt,
            use_cache=use_cache,
            draft_max=draft_max,
        )
        queue: asyncio.Queue[_core.EngineEvent] = asyncio.Queue()
        self._queues[seq] = queue
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())
        out: list[int] = []
        try:
            while True:
                ev = await queue.get()
                if ev.kind == "finished":
                    break
                assert ev.token is not None
                out.append(ev.token)
                if on_token is not None:
                    on_token(ev.token)
        except BaseException:
            self.engine.cancel(seq)
            raise
        finally:
            self._queues.pop(seq, None)
            trace = self.executor.traces.pop(seq, None)
        if ev.reason == "error":
            raise MeshError(ev.error or "the mesh failed")
        if ev.reason == "cancelled" and self._failure is not None:
            raise MeshError(f"the mesh executor failed: {self._failure!r}") from self._failure
        return MeshRun(out, ev, trace)

    async def _drive(self) -> None:
        try:
            while self.engine.has_work:
                for ev in await self.executor.step():
                    queue = self._queues.get(ev.seq)
                    if queue is not None:
                        queue.put_nowait(ev)
        except Exception as exc:
            # Not a station's refusal (those finish the step's sequences): end every waiting
            # call with it rather than leave them waiting for a step that never comes.
            self._failure = exc
            for seq, queue in list(self._queues.items()):
                cancelled = self.engine.cancel(seq)
                if cancelled is not None:
                    queue.put_nowait(cancelled)
            raise
