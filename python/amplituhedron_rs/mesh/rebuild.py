"""Rebuilding a sequence on a new chain of stations after a failover (SPEC §13): what the
executor keeps of each live sequence, what failover cost, and the rebuild's entries.

A sequence's committed tokens are its prompt and every token it emitted; positions ``0..L``
(``L``: where its next entry starts) are what every station held for it. On a new chain it
opens fresh sessions, replays the prompt's volume where a station has it, and the rest is
run through the chain as *pieces*: prompt positions as prefill entries, emitted positions as
decode entries, nothing emitted or captured. Kernels are batch-invariant (n rows in one pass
≡ n one-row steps, chunked ≡ whole) and the span layout does not depend on chunking, so the
KV — and every logit and token after it — is the undisturbed run's, bit for bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs._core import MeshError
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh.replicas import Chain


@dataclass
class SeqState:
    """What the executor keeps of one live sequence: its sessions (one id per station of
    the chain it was opened on) and what rebuilding it on another chain needs — its tokens
    (the prompt, then every token emitted: ``tokens[i]`` sits at position ``i``), how it
    opens, and its cache use."""

    tokens: list[int]
    prompt_len: int
    prefix_hash: int
    opening: wire.OpenSessionRequest
    salt: str | None
    use_cache: bool
    greedy: bool
    sids: list[str] = field(default_factory=list)
    #: The chain ``sids`` live on (None: no sessions now).
    chain: Chain | None = None

    def on(self, chain: Chain) -> bool:
        """Its sessions are live on ``chain`` (same stations, same lives)."""
        return self.chain is not None and self.chain.key == chain.key


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
            session_id=state.sids[0],
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
            session_id=state.sids[0], start=at, tokens=state.tokens[at:end], kind="decode"
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
