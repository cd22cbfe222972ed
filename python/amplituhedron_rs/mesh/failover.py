"""How the mesh executor survives a station's failure (SPEC §13).

Failover (SPEC §13). A range may have several replicas; every sequence runs on the chain of
the ranges' primaries (:mod:`.replicas`). When a station dies or stops answering (no answer,
a timeout, a 502/504) during an open, a replay, the cached first token or a step (prefill,
decode, verify, capture), it is marked down and its range moves to a live replica; a
station that answers 404 for a session restarted under it. Either way the chain changes, and
each affected sequence is rebuilt on the new chain before its next step: a fresh session on
the lost range (the old one closed), the prompt's volume replayed where cached, the rest
re-prefilled and the emitted tokens re-decoded through the ranges up to it with nothing
emitted (:mod:`.rebuild`); then the failed step runs again. Stations that ran the failed
step before the failure hold positions the retry does not know of: every entry starts at
the sequence's position, where a station rolls back what it holds beyond. The engine
sees only the retried step's tokens, so the continuation is the undisturbed run's; a range
with no live replica fails the affected sequences with a MeshError naming it, and no token
is emitted after the failure. Down stations are health-checked in the background and come
back as spares.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from amplituhedron_rs import _core
from amplituhedron_rs._core import MeshError
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh import sessions
from amplituhedron_rs.mesh.client import StationFailed
from amplituhedron_rs.mesh.rebuild import (
    FailoverStats,
    Piece,
    SeqState,
    check_replayed,
    plan_pieces,
    rounds,
)
from amplituhedron_rs.mesh.replicas import Chain
from amplituhedron_rs.mesh.sessions import MeshLink


class Failover:
    """The failure handling of :class:`~.executor.MeshExecutor`: marking stations down or
    restarted, the chain's probe, and rebuilding the sequences of a changed chain. The
    executor holds the state declared here and runs the hops."""

    link: MeshLink
    seqs: dict[int, SeqState]
    failover: FailoverStats
    rebuild_rows: int
    rebuild_decode_rows: int
    rebuild_step_rows: int
    _pending: list[float]
    _closing: set[asyncio.Future[None]]

    async def _hop(
        self,
        chain: Chain,
        phase: str,
        seqs: Sequence[int],
        specs: Sequence[wire.BatchEntrySpec],
        batch: Sequence[_core.EngineEntry] | None = None,
    ) -> wire.BatchStepReply:
        raise NotImplementedError  # the executor's

    async def _recover(self, exc: StationFailed, chain: Chain) -> str | None:
        """Handles a station's failure: None if the work may go on (a replica took the
        range, or the station restarted and is reachable again), else the error that ends
        it — a failure that is not the station's (4xx), or a range left with no live
        replica (named, with why its replicas are down)."""
        station = exc.station
        if station is None or not (exc.down or exc.lost):
            return str(exc)
        replicas = self.link.replicas
        if exc.down:
            newly = replicas.fail(station, str(exc))
            none_left = replicas.no_replica(station)
            if none_left is not None and not await asyncio.to_thread(replicas.probe_range, station):
                return none_left
        else:
            # It answers but lost the sessions (it restarted before anyone saw it down):
            # a new life makes every chain through it stale, so they are rebuilt.
            newly = replicas.restarted(station, chain)
        if newly:
            self.failover.failovers += 1
            self._pending.append(time.perf_counter())
        return None

    async def _chain(self) -> Chain:
        """The current chain; if a range has no live replica, its down replicas are probed
        once more first (one may have come back since its last health check)."""
        replicas = self.link.replicas
        try:
            return replicas.chain()
        except MeshError:
            for r in replicas.ranges:
                if replicas.no_replica(r[0]) is not None:
                    await asyncio.to_thread(replicas.probe_range, r[0])
            return replicas.chain()

    def _resumed(self) -> None:
        """The work broken by pending failures goes on: their time added ends here."""
        now = time.perf_counter()
        self.failover.added.extend(now - t for t in self._pending)
        self._pending.clear()

    async def _rebuild(self, batch: Sequence[_core.EngineEntry], chain: Chain) -> None:
        """Brings every sequence of the step whose sessions are not all on ``chain`` to the
        positions its entry starts at (:mod:`.rebuild`): the lost ranges get fresh sessions
        (the old ones are closed), the prompt's volume is replayed there where cached, then
        the rest of the prompt is re-prefilled and the emitted tokens re-decoded through the
        ranges up to the deepest lost one, nothing emitted or captured. Kernels are
        batch-invariant and sampling is a pure function of the position, so the KV is the
        undisturbed run's bit for bit, and so are the tokens that follow. When the exit range
        is rebuilt under greedy sampling, it re-verifies every emitted token on the way: a
        difference is a MeshError, never a wrong token."""
        work = [(e, stale) for e in batch if (stale := self.seqs[e.seq].stale(chain))]
        if not work:
            return
        started = time.perf_counter()
        for e, _ in work:
            state = self.seqs[e.seq]
            if e.kind == "decode" and (
                len(state.tokens) != e.start + 1 or state.tokens[e.start] != e.tokens[0]
            ):
                raise MeshError(
                    f"sequence {e.seq}: the engine resumes at position {e.start} with token "
                    f"{e.tokens[0]}, the executor holds {len(state.tokens)} tokens; "
                    "cannot rebuild it"
                )
        # Every reopen finishes before a failure is raised: none is left running to touch
        # a sequence's sessions while the step is retried.
        reopened = await asyncio.gather(
            *(self._reopen(self.seqs[e.seq], chain, stale) for e, stale in work),
            return_exceptions=True,
        )
        failed = next((r for r in reopened if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        kept = [r for r in reopened if isinstance(r, int)]
        # Sequences rebuilt through the same ranges share steps.
        by_depth: dict[int, list[list[Piece]]] = {}
        for (e, stale), k in zip(work, kept, strict=True):
            pieces = plan_pieces(
                self.seqs[e.seq], e, k, self.rebuild_rows, self.rebuild_decode_rows
            )
            by_depth.setdefault(max(stale), []).append(pieces)
        for depth, queues in by_depth.items():
            await self._run_pieces(
                Chain(chain.stations[: depth + 1], chain.key[: depth + 1]), queues
            )
        for e, _ in work:
            self.seqs[e.seq].broken.clear()
        self.failover.rebuilt_sequences += len(work)
        self.failover.rebuild_seconds += time.perf_counter() - started

    async def _run_pieces(self, chain: Chain, queues: list[list[Piece]]) -> None:
        """Runs rebuild pieces through ``chain`` (the ranges up to the deepest rebuilt
        one), one piece per sequence per step, several sequences per step."""
        for round_ in rounds(queues, self.rebuild_step_rows):
            specs = [
                p.spec.model_copy(update={"session_id": self.seqs[p.seq].ids()[0]}) for p in round_
            ]
            reply = await self._hop(chain, "rebuild", [p.seq for p in round_], specs)
            if len(chain.stations) == len(self.link.mesh.ranges):  # through the exit
                for p, res in zip(round_, reply.entries, strict=True):
                    check_replayed(self.seqs[p.seq], p, res.emitted)

    async def _reopen(self, state: SeqState, chain: Chain, stale: list[int]) -> int:
        """Replaces the sessions of the ``stale`` ranges with fresh ones on ``chain`` (the
        old ones closed) and replays the prompt's volume there; the prompt positions the
        fresh sessions hold. Every range up to the deepest stale one is marked broken until
        the rebuild completes: a failure half-way leaves them short."""
        depth = max(stale)
        if len(state.sids) != len(chain.stations):
            state.sids = [None] * len(chain.stations)
            state.places = [None] * len(chain.stations)
        old = [(state.places[i], state.sids[i]) for i in stale]
        for i in stale:
            state.sids[i], state.places[i] = None, None
        state.broken.update(range(depth + 1))
        gone = [(p[0], sid) for p, sid in old if p is not None and sid is not None]
        if gone:
            # In the background: a stalled old station must not hold up the rebuild.
            closing = asyncio.ensure_future(
                sessions.close_sessions(self.link, [g[1] for g in gone], [g[0] for g in gone])
            )
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        stations = [chain.stations[i] for i in stale]
        sids = await sessions.open_sessions(
            self.link, state.opening, tenant=state.salt, stations=stations
        )
        for i, sid in zip(stale, sids, strict=True):
            state.sids[i] = sid
            state.places[i] = (chain.stations[i], chain.key[i][1])
        if not state.use_cache:
            return 0
        prompt = state.tokens[: state.prompt_len]
        found = await sessions.replay(self.link, sids, prompt, state.prefix_hash, stations=stations)
        return found.kept
