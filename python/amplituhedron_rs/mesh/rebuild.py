"""Rebuilding a sequence on a new chain of stations after a failover (SPEC §13): what the
executor keeps of each live sequence, what failover cost, and the rebuild's entries.

A sequence's committed tokens are its prompt and every token it emitted; positions ``0..L``
(``L``: where its next entry starts) are what every station held for it. When the session of
range ``d`` is lost (its station died or restarted), range ``d`` gets a fresh session, the
prompt's volume is replayed there where cached, and the rest is run as *pieces* through
ranges ``0..d`` — prompt positions as prefill entries, emitted positions as decode entries,
nothing emitted or captured. Ranges before ``d`` keep their sessions: each piece starts
where they roll back to, and they recompute the same KV while producing ``d``'s input.
Ranges after ``d`` keep theirs untouched: they never saw the failed step (the chain runs in
order), and what ``d`` will feed them is what it fed them before. A rebuild that fails
half-way leaves ranges ``0..d`` short, so the next one replaces them all.

Kernels are batch-invariant (n rows in one pass ≡ n one-row steps, chunked ≡ whole) and the
span layout does not depend on chunking, so the KV — and every logit and token after it —
is the undisturbed run's, bit for bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs._core import MeshError
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh.launcher import StationInfo
from amplituhedron_rs.mesh.replicas import Chain


@dataclass
class SeqState:
    """What the executor keeps of one live sequence: its sessions (one per range, in layer
    order) and where each lives, and what rebuilding it on another chain needs — its tokens
    (the prompt, then every token emitted: ``tokens[i]`` sits at position ``i``), how it
    opens, and its cache use."""

    tokens: list[int]
    prompt_len: int
    prefix_hash: int
    opening: wire.OpenSessionRequest
    salt: str | None
    use_cache: bool
    greedy: bool
    #: Alternatives of the log-probabilities each emitted token reports (None: none).
    logprobs: int | None = None
    #: Alternatives of the log-probabilities each prompt token reports (None: none). Scoring
    #: the prompt computes every row of it, so such a sequence does not use the cache.
    prompt_logprobs: int | None = None
    #: Per range: the session id (None: none now) and the station and life it lives on.
    sids: list[str | None] = field(default_factory=list)
    places: list[tuple[StationInfo, int] | None] = field(default_factory=list)
    #: Ranges a failed rebuild left holding fewer positions than the sequence: replaced
    #: (not reused) by the next rebuild.
    broken: set[int] = field(default_factory=set)

    def settle(self, chain: Chain, sids: Sequence[str]) -> None:
        """Its sessions are ``sids``, one per station of ``chain``."""
        self.sids = list(sids)
        self.places = [(s, life) for s, (_, life) in zip(chain.stations, chain.key, strict=True)]
        self.broken.clear()

    def stale(self, chain: Chain) -> list[int]:
        """The ranges whose session must be replaced to run on ``chain``: none there, on
        another station or an earlier life of it (it died or restarted), or broken."""
        return [
            i
            for i, (s, (_, life)) in enumerate(zip(chain.stations, chain.key, strict=True))
            if i >= len(self.sids)
            or self.sids[i] is None
            or self.places[i] != (s, life)
            or i in self.broken
        ]

    @property
    def chain(self) -> Chain | None:
        """The chain its sessions form (None: some range has none)."""
        if not self.places or any(p is None for p in self.places):
            return None
        places = [p for p in self.places if p is not None]
        return Chain(tuple(s for s, _ in places), tuple((s.url, life) for s, life in places))

    def ids(self) -> list[str]:
        """Every range's session id (MeshError if one has none: it was not rebuilt)."""
        if any(sid is None for sid in self.sids):
            raise MeshError("a sequence has no session on some range of the mesh")
        return [sid for sid in self.sids if sid is not None]

    def opened(self) -> list[tuple[StationInfo, str]]:
        """Where its sessions are: (station, id) for each range that has one."""
        return [(p[0], sid) for p, sid in zip(self.places, self.sids, strict=True) if p and sid]


@dataclass
class FailoverStats:
    """What failover cost: station failures handled, sequences rebuilt and the time."""

    #: Station failures handled: a station down (marked so, its range moved to a replica)
    #: or restarted under a session (it answered 404: the sessions were rebuilt).
    failovers: int = 0
    rebuilt_sequences: int = 0
    rebuild_seconds: float = 0.0
    #: Per failover: seconds from the failure's detection until the work it broke resumed
    #: (the affected sequences rebuilt on the new chain, or the admission reopened).
    added: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))

    def to_json(self) -> dict[str, Any]:
        added = sorted(self.added)
        return {
            "failovers": self.failovers,
            "rebuilt_sequences": self.rebuilt_sequences,
            "rebuild_seconds": self.rebuild_seconds,
            "added_ms_mean": 1e3 * sum(added) / len(added) if added else 0.0,
            "added_ms_p50": 1e3 * added[len(added) // 2] if added else 0.0,
            "added_ms_max": 1e3 * added[-1] if added else 0.0,
        }


@dataclass
class Piece:
    """One rebuild entry: positions ``start:start+len(tokens)`` of a sequence."""

    seq: int
    spec: wire.BatchEntrySpec


def plan_pieces(
    state: SeqState, e: _core.EngineEntry, kept: int, prefill_rows: int, decode_rows: int
) -> list[Piece]:
    """The rebuild entries that take a sequence from ``kept`` positions to ``e.start``
    (the entry it must run next): the prompt's positions as prefill pieces of at most
    ``prefill_rows`` (the last one ``last``, as the engine ran it), then the emitted ones
    as decode pieces of at most ``decode_rows`` — the span types the engine wrote them
    with, so even the ring's span layout is the undisturbed run's."""
    n, target = state.prompt_len, e.start
    pieces: list[Piece] = []
    at = kept
    while at < min(target, n) or (e.kind == "decode" and at < n):
        end = min(at + prefill_rows, n if e.kind == "decode" else target)
        spec = wire.BatchEntrySpec(
            session_id=state.ids()[0],
            start=at,
            tokens=state.tokens[at:end],
            kind="prefill",
            last=end == n,
        )
        pieces.append(Piece(e.seq, spec))
        at = end
    while e.kind == "decode" and at < target:
        end = min(at + decode_rows, target)
        spec = wire.BatchEntrySpec(
            session_id=state.ids()[0], start=at, tokens=state.tokens[at:end], kind="decode"
        )
        pieces.append(Piece(e.seq, spec))
        at = end
    return pieces


def check_replayed(state: SeqState, p: Piece, emitted: Sequence[int]) -> None:
    """Greedy: a re-decoded piece's verification at the exit station must emit the very
    tokens the sequence emitted (its drafts all accepted, then the next one); a
    difference is a MeshError, never a continuation."""
    if p.spec.kind != "decode" or not state.greedy:
        return
    start, m = p.spec.start, len(p.spec.tokens)
    expected = state.tokens[start + 1 : start + 1 + m]
    if list(emitted) != expected:
        raise MeshError(
            f"sequence {p.seq}: rebuilding positions {start}:{start + m} on the new "
            f"chain emitted {list(emitted)}, the sequence emitted {expected}; "
            "refusing to continue it"
        )


def rounds(queues: list[list[Piece]], budget: int) -> Iterator[list[Piece]]:
    """The rebuild's steps: each takes the next piece of as many sequences as fit in
    ``budget`` rows (at least one), until every queue is empty."""
    while any(queues):
        step: list[Piece] = []
        rows = 0
        for q in queues:
            if q and (not step or rows + len(q[0].spec.tokens) <= budget):
                step.append(q.pop(0))
                rows += len(step[-1].spec.tokens)
        yield step
