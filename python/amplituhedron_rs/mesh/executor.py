"""The mesh executor: the Rust engine's continuous batching, run through a mesh (SPEC §6,
§10, §11).

The engine (``_core.Engine.external``) plans; this executor carries each plan out:

- admissions open the sequence's session on every station, all or nothing (with its
  sampling, and its salt as the tenant header; each station draws its own id, so a sequence
  holds one per station), then the replay fan-out (exact, then longest-prefix, per
  station); on an all-hit the exit station samples the first token from the cached logits
  (with its log-probabilities when asked for: the exit station computes them too);
- each planned step goes through the stations in order with ONE request per station
  (``/batch/step``): every running sequence's decode row (plus its drafts when speculating:
  k+1 rows per hop) and the prompt chunks the budget allows. The exit station samples or
  verifies with each session's own seeded sampler, so only token ids come back; a station
  rolls back positions of rejected drafts itself, from each entry's start;
- a prompt's chunks ask every station to capture the prompt's volume from its own KV (no
  tensor crosses the wire for it): the whole prompt at its last chunk, or the head a
  station's cache takes of a longer prompt at the chunk that computes it;
- released sequences (finished, cancelled) have their sessions closed on every station.

Failover (SPEC §13) is :class:`.failover.Failover`'s, which this executor extends.

There is no generation loop here: the engine decides what runs, stops and finishes. The
callers' drivers (a thread's stepper, an asyncio engine) are in :mod:`.engine`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from amplituhedron_rs import _core
from amplituhedron_rs._core import MeshError
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh import sessions
from amplituhedron_rs.mesh.chained import reply_of, step_through
from amplituhedron_rs.mesh.client import StationFailed
from amplituhedron_rs.mesh.failover import Failover
from amplituhedron_rs.mesh.hoptimes import HopTimes
from amplituhedron_rs.mesh.pipeline import cut, merge
from amplituhedron_rs.mesh.rebuild import (
    FailoverStats,
    SeqState,
)
from amplituhedron_rs.mesh.replicas import Chain
from amplituhedron_rs.mesh.sessions import (
    MeshLink,
    SeqTrace,
    StationVerdict,
    note_step,
    sampling_of,
)

log = logging.getLogger("amplituhedron.mesh")


@dataclass(frozen=True)
class _Admitted:
    """One admission's ``admitted`` tuple ``(seq, cached_tokens, first_token, error)``, and
    an all-hit's first-token log-probabilities when the request asked for them."""

    result: tuple[int, int, int | None, str | None]
    logprobs: wire.TokenLogprobsWire | None = None
    #: The sequence's grammar is complete after the first token.
    done: bool = False


class MeshExecutor(Failover):
    """Runs an external engine's admissions, steps and releases through a mesh, failing over
    between replicas (see the module docstring). With ``trace``, each sequence's
    :class:`SeqTrace` is kept in ``traces`` until its reader pops it (a server leaves it
    off). ``max_failovers``: station failures one admission or step may survive.
    ``piece_rows``: rows of the pieces a step's prompt entries are cut into, which flow
    through the stations pipelined (default: the step budget, at most 64)."""

    def __init__(
        self,
        engine: _core.Engine,
        link: MeshLink,
        *,
        trace: bool = False,
        max_failovers: int | None = None,
        piece_rows: int | None = None,
    ) -> None:
        self.engine = engine
        self.link = link
        #: Each live sequence's sessions and what rebuilding them needs.
        self.seqs: dict[int, SeqState] = {}
        self.hops = 0
        self.trace = trace
        self.traces: dict[int, SeqTrace] = {}
        self.failover = FailoverStats()
        self.max_failovers = (
            2 * len(link.mesh.stations) + 2 if max_failovers is None else max_failovers
        )
        step_tokens = int(engine.limits[2])
        #: Rows per rebuild entry: a prompt piece at most the engine's own step budget (what
        #: the stations already take), decode rows at most a station's default
        #: ``max_logits_rows`` (the exit verifies them). A rebuild step packs several
        #: sequences' pieces, up to 4 budgets: more rows per pass cost less per row
        #: (measured: 64-row steps ~3.3 ms/row, ~200-row steps ~2 ms/row on 2 cores).
        #: Rows of a prompt entry's pieces, which flow through the stations pipelined
        #: (:mod:`.pipeline`): a step of several pieces keeps several stations busy.
        self.piece_rows = max(1, min(step_tokens, 64) if piece_rows is None else piece_rows)
        self.rebuild_rows = max(1, step_tokens)
        self.rebuild_decode_rows = max(1, min(step_tokens, 64))
        self.rebuild_step_rows = min(1024, 4 * self.rebuild_rows)
        #: Detection times of failures whose work has not resumed yet.
        self._pending: list[float] = []
        #: Closes of replaced sessions still under way (awaited at shutdown).
        self._closing: set[asyncio.Future[None]] = set()
        #: Where hops' time goes, per phase ("decode step", "prefill step", "rebuild"),
        #: when a bench sets it to a dict (None: off; the stations then time nothing).
        self.hop_times: dict[str, HopTimes] | None = None

    @property
    def live(self) -> int:
        """Sequences holding sessions on the stations."""
        return len(self.seqs)

    def counters(self) -> dict[str, float]:
        """The failover counters alone (safe to read from another thread: plain values)."""
        f = self.failover
        return {
            "failovers": f.failovers,
            "rebuilt_sequences": f.rebuilt_sequences,
            "rebuild_seconds": f.rebuild_seconds,
            "stations_down": len(self.link.mesh.stations) - len(self.link.replicas.live()),
        }

    def stats(self) -> dict[str, Any]:
        """Failover counters, the time added per failover, and the stations marked down
        now (from the executor's own thread)."""
        r = self.link.replicas
        return {
            **self.failover.to_json(),
            "stations_down": len(self.link.mesh.stations) - len(r.live()),
            "revivals": r.revivals,
        }

    async def step(self) -> list[_core.EngineEvent]:
        """One engine step through the mesh (the in-process engine's ``step()``, over HTTP)."""
        await self._release(self.engine.take_released())
        events: list[_core.EngineEvent] = []
        admissions = self.engine.plan_admissions()
        if admissions:
            results = await asyncio.gather(*(self._admit_or_fail(a) for a in admissions))
            firsts = [None if r.logprobs is None else r.logprobs.as_tuple() for r in results]
            events.extend(
                self.engine.admitted(
                    [r.result for r in results], logprobs=firsts, done=[r.done for r in results]
                )
            )
        batch = self.engine.plan_batch()
        if batch:
            try:
                entries = await self._run(batch)
            except MeshError as exc:
                # Every sequence of the step finishes with the error: no token after it.
                events.extend(self.engine.complete([], error=str(exc)))
            except Exception as exc:
                # Not a station's answer: a bug here. It ends this step's sequences, never
                # the engine (its caller steps the others on).
                log.exception("a mesh step failed")
                error = f"the mesh step failed: {type(exc).__name__}: {exc}"
                events.extend(self.engine.complete([], error=error))
            else:
                logprobs = [[lp.as_tuple() for lp in r.logprobs or []] for r in entries]
                scored = [[lp.as_tuple() for lp in r.prompt_logprobs or []] for r in entries]
                emitted = self._emitted(batch, entries)
                events.extend(
                    self.engine.complete(
                        emitted,
                        None,
                        logprobs,
                        scored,
                        done=[r.done for r in entries],
                        errors=[r.error for r in entries],
                    )
                )
        await self._release(self.engine.take_released())
        return events

    async def close(self) -> None:
        """Closes every session still open (shutdown)."""
        await self._release(list(self.seqs))
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    # --- admissions ------------------------------------------------------------------------
    async def _admit_or_fail(self, a: _core.EngineAdmission) -> _Admitted:
        """Admits one sequence; any failure fails that sequence alone (its sessions
        closed), never the step or the engine."""
        try:
            return await self._admit(a)
        except Exception as exc:
            log.exception("admitting sequence %d failed", a.seq)
            try:
                await self._release([a.seq])
            except Exception:
                log.exception("closing the sessions of sequence %d failed", a.seq)
            return _Admitted((a.seq, 0, None, f"admission failed: {type(exc).__name__}: {exc}"))

    async def _admit(self, a: _core.EngineAdmission) -> _Admitted:
        grammar = (
            None
            if a.grammar is None
            else wire.GrammarSpec.model_validate({"kind": a.grammar[0], "text": a.grammar[1]})
        )
        opening = wire.OpenSessionRequest(
            prompt_tokens=list(a.prompt), sampling=sampling_of(a), grammar=grammar
        )
        state = SeqState(
            tokens=list(a.prompt),
            prompt_len=len(a.prompt),
            prefix_hash=int(_core.prefix_hash(a.prompt)),
            opening=opening,
            salt=a.salt,
            use_cache=a.use_cache and a.prompt_logprobs is None,
            greedy=a.greedy,
            logprobs=a.logprobs,
            prompt_logprobs=a.prompt_logprobs,
        )
        for _ in range(self.max_failovers + 1):
            try:
                chain = await self._chain()
            except MeshError as exc:
                return _Admitted((a.seq, 0, None, str(exc)))
            try:
                result = await self._admit_on(a, state, chain)
            except StationFailed as exc:
                error = await self._recover(exc, chain)
                if error is not None:
                    # The engine finishes the sequence with the error and releases it.
                    return _Admitted((a.seq, 0, None, error))
                await self._release([a.seq])
                continue
            except MeshError as exc:
                return _Admitted((a.seq, 0, None, str(exc)))
            self._resumed()
            return result
        return _Admitted(
            (a.seq, 0, None, f"gave up admitting after {self.max_failovers} station failures")
        )

    async def _admit_on(self, a: _core.EngineAdmission, state: SeqState, chain: Chain) -> _Admitted:
        """Opens the sequence's sessions on ``chain``, replays, and (all hit) samples the
        first token from the cached logits."""
        trace = SeqTrace(
            stations=[StationVerdict(s.url, s.layer_lo, s.layer_hi) for s in chain.stations]
        )
        if self.trace:
            self.traces[a.seq] = trace
        started = time.perf_counter()
        sids = await sessions.open_sessions(
            self.link, state.opening, tenant=a.salt, stations=chain.stations
        )
        opened = time.perf_counter()
        trace.open_ms = (opened - started) * 1e3
        state.settle(chain, sids)
        self.seqs[a.seq] = state
        if not a.use_cache:
            return _Admitted((a.seq, 0, None, None))
        found = await sessions.replay(
            self.link, sids, a.prompt, state.prefix_hash, stations=chain.stations
        )
        trace.replay_ms = (time.perf_counter() - opened) * 1e3
        for v, (status, held) in zip(trace.stations, found.verdicts, strict=True):
            v.replay, v.replayed_tokens = status, held if found.hit else found.kept
        if not found.hit:
            return _Admitted((a.seq, found.kept, None, None))
        if not a.sample_first:
            return _Admitted((a.seq, len(a.prompt), None, None))
        first = await sessions.sample_cached(
            self.link, sids, stations=chain.stations, logprobs=a.logprobs
        )
        state.tokens.append(first.token)
        return _Admitted((a.seq, len(a.prompt), first.token, None), first.logprobs, first.done)

    # --- steps -----------------------------------------------------------------------------
    async def _run(self, batch: Sequence[_core.EngineEntry]) -> list[wire.BatchEntryResult]:
        """One step: one request per station of the current chain, in order; the exit
        station's answer per entry (emitted tokens, their log-probabilities when asked). A
        station that fails is replaced by a live replica of its range, the step's sequences
        are rebuilt on the new chain, and the step runs again: nothing of the failed attempt
        reaches the engine."""
        for _ in range(self.max_failovers + 1):
            chain = await self._chain()  # MeshError: a range has no live replica
            try:
                await self._rebuild(batch, chain)
                self._resumed()
                return await self._step(batch, chain)
            except StationFailed as exc:
                error = await self._recover(exc, chain)
                if error is not None:
                    raise MeshError(error) from exc
        raise MeshError(f"gave up the step after {self.max_failovers} station failures")

    def _specs(self, batch: Sequence[_core.EngineEntry]) -> list[wire.BatchEntrySpec]:
        try:
            return [
                wire.BatchEntrySpec(
                    session_id=self.seqs[e.seq].ids()[0],
                    start=e.start,
                    tokens=list(e.tokens),
                    kind=e.kind,
                    last=e.last,
                    emit=e.emit and e.kind == "prefill",
                    capture=e.kind == "prefill" and self.seqs[e.seq].use_cache,
                    logprobs=self.seqs[e.seq].logprobs,
                    prompt_logprobs=self.seqs[e.seq].prompt_logprobs
                    if e.kind == "prefill"
                    else None,
                )
                for e in batch
            ]
        except KeyError as exc:
            raise MeshError(f"sequence {exc} has no sessions on the mesh") from exc

    async def _step(
        self, batch: Sequence[_core.EngineEntry], chain: Chain
    ) -> list[wire.BatchEntryResult]:
        specs = self._specs(batch)
        phase = "decode step" if all(e.kind == "decode" for e in specs) else "prefill step"
        reply = await self._hop(chain, phase, [e.seq for e in batch], specs, batch)
        return reply.entries

    async def _hop(
        self,
        chain: Chain,
        phase: str,
        seqs: Sequence[int],
        specs: Sequence[wire.BatchEntrySpec],
        batch: Sequence[_core.EngineEntry] | None = None,
    ) -> wire.BatchStepReply:
        """Runs one step of ``specs`` through ``chain``; the exit station's answer. Prompt
        entries longer than ``piece_rows`` go as pieces in a pipeline (:mod:`.pipeline`):
        piece ``j`` enters a station once piece ``j−1`` left it, so the stations work on
        consecutive pieces at once. Each station's header names the sessions by its own ids."""
        steps = cut(specs, self.piece_rows)
        if len(steps) == 1:
            return await self._through(chain, phase, seqs, specs, batch)
        loop = asyncio.get_running_loop()
        # left[j][i]: piece j has left station i (piece j+1 may enter it).
        left = [[loop.create_future() for _ in chain.stations] for _ in steps[:-1]]

        async def piece(j: int) -> wire.BatchStepReply:
            step = steps[j]
            gates = None if j == 0 else left[j - 1]
            done = left[j] if j < len(left) else None
            try:
                return await self._through(
                    chain,
                    phase,
                    [seqs[k] for k in step.entries],
                    step.specs,
                    None if batch is None else [batch[k] for k in step.entries],
                    gates=gates,
                    done=done,
                )
            except BaseException as exc:
                # The pieces behind this one stop where they would wait for it.
                for f in done or []:
                    if not f.done():
                        f.set_exception(exc)
                raise

        answers = await asyncio.gather(
            *(piece(j) for j in range(len(steps))), return_exceptions=True
        )
        for gates in left:  # a failure's gates that no piece reached: retrieved, not warned
            for f in gates:
                if f.done() and not f.cancelled():
                    f.exception()
        for a in answers:
            if isinstance(a, BaseException):
                raise a
        return merge(len(specs), steps, cast(list[wire.BatchStepReply], answers))

    async def _through(
        self,
        chain: Chain,
        phase: str,
        seqs: Sequence[int],
        specs: Sequence[wire.BatchEntrySpec],
        batch: Sequence[_core.EngineEntry] | None,
        *,
        gates: Sequence[asyncio.Future[None]] | None = None,
        done: Sequence[asyncio.Future[None]] | None = None,
    ) -> wire.BatchStepReply:
        """One request per station of ``chain``, in order; the exit station's answer. With
        ``gates``, each station's request waits for its gate; ``done[i]`` is set once
        station ``i`` answered."""
        sids = [self.seqs[seq].ids() for seq in seqs]
        headers = wire.StepHeaders(specs, timing=self.hop_times is not None)
        if gates is None and done is None:
            chained = await self._chained(chain, phase, sids, specs, headers, batch)
            if chained is not None:
                return chained
        payload = b""
        reply = None
        for i, s in enumerate(chain.stations):
            if gates is not None:
                await gates[i]
            started = time.monotonic()
            head = headers.render([ids[i] for ids in sids])
            sent = time.monotonic()
            out, payload = await self.link.step(phase, s, head, payload)
            answered = time.monotonic()
            self.hops += 1
            reply = reply_of(s, out, len(specs))
            if done is not None:
                done[i].set_result(None)
            times = (started, sent, answered, time.monotonic())
            self._noted(phase, i, reply, times, specs, batch)
        assert reply is not None
        return reply

    async def _chained(
        self,
        chain: Chain,
        phase: str,
        sids: Sequence[Sequence[str]],
        specs: Sequence[wire.BatchEntrySpec],
        headers: wire.StepHeaders,
        batch: Sequence[_core.EngineEntry] | None,
    ) -> wire.BatchStepReply | None:
        """The step through the whole chain in one call (:mod:`.chained`); None when a
        station has no step stream."""
        heads = [headers.render([ids[i] for ids in sids]) for i in range(len(chain.stations))]
        every = self.hop_times is not None or (self.trace and batch is not None)
        answers = await step_through(self.link, chain, phase, heads, len(specs), every=every)
        if answers is None:
            return None
        self.hops += len(chain.stations)
        for i, reply, times in answers:
            self._noted(phase, i, reply, times, specs, batch)
        return answers[-1][1]

    def _noted(
        self,
        phase: str,
        i: int,
        reply: wire.BatchStepReply,
        times: tuple[float, float, float, float],
        specs: Sequence[wire.BatchEntrySpec],
        batch: Sequence[_core.EngineEntry] | None,
    ) -> None:
        """Station ``i``'s answer in the hop times (a bench) and the traces."""
        if self.hop_times is not None and reply.timing is not None:
            hop = self.hop_times.setdefault(phase, HopTimes())
            hop.add(*times, reply.timing)
        if self.trace and batch is not None:
            note_step(self.traces, i, [e.seq for e in batch], specs, reply)

    def _emitted(
        self, batch: Sequence[_core.EngineEntry], entries: Sequence[wire.BatchEntryResult]
    ) -> list[list[int]]:
        """Records a step's emitted tokens (each follows its entry's last input row); returns
        them per entry."""
        emitted = [list(r.emitted) for r in entries]
        for e, out in zip(batch, emitted, strict=True):
            if out and (state := self.seqs.get(e.seq)) is not None:
                at = e.start + len(e.tokens) if e.kind == "prefill" else e.start + 1
                state.tokens[at:] = out
        return emitted

    async def _release(self, seqs: Sequence[int]) -> None:
        gone = [(seq, self.seqs[seq]) for seq in seqs if seq in self.seqs]
        closes = []
        for _, st in gone:
            where = st.opened()
            if where:
                stations, sids = [w[0] for w in where], [w[1] for w in where]
                closes.append(sessions.close_sessions(self.link, sids, stations))
        if closes:
            await asyncio.gather(*closes)
        # Forgotten once closed, so a live count of 0 means the stations hold none.
        for seq, _ in gone:
            del self.seqs[seq]
