"""The engine over a mesh, for its callers: :class:`MeshStepper` steps a
:class:`~.executor.MeshExecutor` from a plain thread (the server's engine thread),
:class:`MeshEngine` from asyncio (the coordinator); ``mesh_link`` connects either to a mesh.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs._core import MeshError
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh import sessions
from amplituhedron_rs.mesh.client import StationClient, Transport
from amplituhedron_rs.mesh.executor import MeshExecutor
from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec
from amplituhedron_rs.mesh.sessions import MeshLink, SeqTrace


def mesh_link(
    mesh: MeshSpec,
    token: str | None,
    timeout: float,
    close_timeout: float = 2.0,
    open_deadline: float = 10.0,
    transport: Transport = "stream",
) -> MeshLink:
    """The link to a mesh; ``token`` defaults to the mesh file's. ``transport``: steps over
    the stations' step streams (where they serve one) or over HTTP only."""
    token = token if token is not None else mesh.token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    http = StationClient(timeout, transport=transport)
    return MeshLink(mesh, http, headers, close_timeout, open_deadline, token=token or None)


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
        transport: Transport = "stream",
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.owned = owned
        link = mesh_link(mesh, token, timeout, transport=transport)
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

    def failover_counters(self) -> dict[str, float]:
        return self.executor.counters()

    def close(self) -> None:
        async def go() -> None:
            try:
                await self.executor.close()
            finally:
                self.executor.link.replicas.close()
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
        transport: Transport = "stream",
        piece_rows: int | None = None,
    ) -> None:
        self.engine = _core.Engine.external(
            max_running=max_running, max_queue=max_queue, step_tokens=step_tokens
        )
        link = mesh_link(mesh, token, timeout, close_timeout, open_deadline, transport)
        self.executor = MeshExecutor(self.engine, link, trace=trace, piece_rows=piece_rows)
        self.health: wire.Health | None = None
        self._queues: dict[int, asyncio.Queue[_core.EngineEvent]] = {}
        self._driver: asyncio.Task[None] | None = None
        self._failure: Exception | None = None

    async def __aenter__(self) -> MeshEngine:
        self.executor.link.http.open()
        try:
            self.health = await sessions.check_mesh(self.executor.link)
        except BaseException:
            self.executor.link.replicas.close()
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
            self.executor.link.replicas.close()
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
        grammar: _core.Grammar | None = None,
    ) -> MeshRun:
        """Generates through the mesh; a bad request raises InputError before anything
        runs, a mesh failure MeshError. Cancelling the caller cancels the request. ``salt``
        is the tenant (sent as the tenant header; the stations key the cache salt by it).
        ``grammar`` constrains the output (the exit station samples under its mask)."""
        seq = self.engine.submit(
            list(prompt),
            max_new_tokens,
            **(sampling or {}),
            stop_ids=list(stop_ids),
            salt=salt,
            use_cache=use_cache,
            draft_max=draft_max,
            grammar=grammar,
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
