"""A station's settings and what one of its sessions holds: the ring, its lock, the sampler
and what a capture may freeze (see :mod:`.state`), plus the body decoders and the forward in
pieces that the single-session routes and the batched step share."""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from amplituhedron_rs import _core
from amplituhedron_rs.edge.limits import DEFAULT_JSON_BYTES, EdgeLimits
from amplituhedron_rs.mesh.station.errors import BadBody, Busy, Cancelled, Conflict, NotFound
from amplituhedron_rs.runtime.gguf_file import read_model_file
from amplituhedron_rs.runtime.options import (
    DEFAULT_KV_DTYPE,
    CacheOptions,
    KvDtype,
    Precision,
    SessionOptions,
)
from amplituhedron_rs.runtime.weights import load_indexed_weights, load_weights

FloatArray = np.ndarray[Any, np.dtype[np.float32]]
LogitsRows = Literal["none", "last", "all"]
HiddenRows = Literal["all", "last", "none"]


@dataclass
class StationSettings:
    """Everything a station is started with."""

    layer_lo: int
    layer_hi: int
    model_path: str | None = None
    #: A model index written by the mesh launcher (the header parsed once for K stations).
    model_index: str | None = None
    #: The mesh token every endpoint but /healthz requires; None only for an explicitly
    #: ``--insecure`` station (loopback only, enforced by :func:`~.app.serve`).
    token: str | None = None
    #: Serve /metrics without the token (a scraper on another host holds no mesh token).
    open_metrics: bool = False
    max_sessions: int = 8
    #: A client that vanished between requests leaves its session at most this long.
    session_idle_s: float = 30.0
    #: Octet bodies (forward, decode); JSON bodies get ``max_json_bytes``.
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_bytes: int = DEFAULT_JSON_BYTES
    #: Open connections (idle ones are closed first past it; see amplituhedron_rs.edge),
    #: on the HTTP port and on the step stream each.
    max_connections: int = EdgeLimits.max_connections
    #: The step stream's TCP port (0: any free port; None: steps over HTTP only). Its
    #: bound port is announced in /healthz.
    stream_port: int | None = 0
    #: The host the station listens on (the step stream listens there too).
    stream_host: str = "127.0.0.1"
    #: Rows one forward may carry (None: the session's ``max_chunk``).
    max_forward_rows: int | None = None
    #: Rows of ``logits=all`` one forward may ask for (each row is vocab × 4 bytes).
    max_logits_rows: int = 64
    #: Bytes of KV rings the station may hold (None: a quarter of physical memory).
    memory_budget: int | None = None
    #: How long a worker waits for a busy session before answering 409.
    busy_wait_s: float = 10.0
    cache: CacheOptions = field(default_factory=CacheOptions)
    session: SessionOptions = field(default_factory=SessionOptions)
    fault_injection: bool = False
    precision: Precision = "refined"
    kv_dtype: KvDtype = DEFAULT_KV_DTYPE

    def load_weights(self) -> _core.ModelWeights:
        """The weights of this station's layer range only (see ``runtime.weights.load_range``):
        K stations hold about one model between them, not K."""
        layers = (self.layer_lo, self.layer_hi)
        if self.model_index is not None:
            index = Path(self.model_index)
            return load_indexed_weights(index, self.precision, self.kv_dtype, layers=layers)
        model_file = read_model_file(self.model_path)
        return load_weights(model_file, self.precision, self.kv_dtype, layers=layers)


#: A sampled token, its log-probabilities when asked for, and whether the session's grammar
#: is complete after it.
SampledToken = tuple[int, _core.TokenLogprobs | None, bool]


@dataclass
class LiveSession:
    """A session's ring buffer plus what the station needs to serve it.

    The lock travels with the ring when a closed session's ring is pooled for reuse, so a
    request that still holds the old wrapper serialises with the ring's next owner and then
    sees ``closed``. ``clock`` is the ring's clock as the last Python request left it (the
    step stream's decode steps move the ring on without Python: read ``session.clock``
    under the lock for the current one).
    """

    session: _core.RangeSession
    prompt: list[int]
    salt: str | None
    n_sys: int = 0
    #: Shared with the step stream, which steps the ring under it too (see rust/mesh).
    lock: _core.RingLock = field(default_factory=_core.RingLock)
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False
    clock: int = 0
    # Exit station only: the session's sampler and the logits of its last position, and the
    # state of its grammar when constrained (it consumes every token sampled here).
    sampler: _core.Sampler | None = None
    last_logits: FloatArray | None = None
    grammar: _core.GrammarState | None = None
    # What a capture freezes, all computed here: whether every forwarded prompt position
    # was the prompt's own token (sticky once false), the output row at the prompt's last
    # position, and (exit) that position's logits.
    exact: bool = True
    prompt_tail: FloatArray | None = None
    prompt_logits: FloatArray | None = None

    @contextlib.contextmanager
    def use(self, sid: str, wait: float) -> Iterator[_core.RangeSession]:
        """Exclusive use of the ring, waiting at most ``wait`` seconds (0: the event loop,
        which never waits); Busy if another request holds it, NotFound if it closed."""
        acquired = self.lock.acquire(timeout=wait) if wait > 0 else self.lock.acquire(False)
        if not acquired:
            raise Busy(f"session {sid!r} is busy with another request; retry")
        try:
            if self.closed:
                raise NotFound(f"session {sid!r} was closed")
            try:
                yield self.session
            finally:
                self.clock = int(self.session.clock)
        finally:
            self.lock.release()

    def sample_next(self, sid: str, clock: int, logprobs: int | None) -> SampledToken:
        """Exit station, under the session's lock: the token at position ``clock`` sampled
        from the last logits (under the grammar's mask when constrained: the grammar then
        follows the positions before ``clock``, rolled back if a retry finds it ahead), and
        its log-probabilities (``logprobs`` alternatives) when asked."""
        if (logits := self.last_logits) is None:
            raise Conflict(f"session {sid!r} has no logits yet")
        assert self.sampler is not None
        if self.grammar is not None:
            emitted = clock - len(self.prompt)
            if emitted < 0 or self.grammar.consumed < emitted:
                raise Conflict(
                    f"session {sid!r}: its grammar has consumed {self.grammar.consumed} "
                    f"tokens; position {clock} follows {emitted}"
                )
            self.grammar.align(emitted, 0)
        token = int(self.sampler.sample(logits, clock, self.grammar))
        lp = None if logprobs is None else _core.token_logprobs(logits, token, logprobs)
        return token, lp, self.grammar is not None and self.grammar.done

    def note_prompt(
        self,
        ids: Any,
        start: int,
        h: FloatArray,
        lg: FloatArray | None,
        compute: LogitsRows,
    ) -> None:
        """Records what a later capture may freeze (under the lock): whether the rows
        forwarded into the prompt's positions were its tokens (the entry station can tell;
        the others count positions), and the tail row and logits computed at its last
        position."""
        n = len(self.prompt)
        end = start + h.shape[0]
        if start >= n:
            return
        if ids is not None:
            overlap = min(end, n) - start
            if ids[:overlap].tolist() != self.prompt[start : start + overlap]:
                self.exact = False
        if end >= n:
            at = n - 1 - start
            self.prompt_tail = np.array(h[at], dtype=np.float32)
            if lg is not None and compute == "all":
                self.prompt_logits = np.array(lg[at], dtype=np.float32)
            elif lg is not None and end == n:
                self.prompt_logits = np.array(lg[-1], dtype=np.float32)

    def rollback(self, session: _core.RangeSession, clock: int) -> None:
        """Rolls the ring back to ``clock`` (under the lock)."""
        session.rollback(clock)
        if clock < len(self.prompt):
            # The prompt's last position is gone; it is recorded again when recomputed.
            self.prompt_tail = self.prompt_logits = None


@dataclass(frozen=True)
class Octets:
    """A binary answer: the body and its headers."""

    body: bytes
    headers: dict[str, str]


def floats(body: bytes, what: str) -> FloatArray:
    """A body of little-endian f32, every value finite."""
    if len(body) % 4 != 0:
        raise BadBody(f"{what}: {len(body)} bytes is not a whole number of f32")
    arr = np.frombuffer(body, dtype="<f4")
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise BadBody(f"{what}: value {bad} is not finite")
    return arr


def f32_bytes(a: Any) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def new_session_id() -> str:
    """192 random bits, URL-safe: an id is a capability, so it is unguessable."""
    return secrets.token_urlsafe(24)


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


#: Rows per Rust call within one forward: the points where a departed client's work stops.
PIECE_ROWS = 64


def run_pieces(
    session: _core.RangeSession,
    rows_in: Any,
    tokens: bool,
    compute: LogitsRows,
    cancel: threading.Event | None,
) -> tuple[FloatArray, FloatArray | None]:
    """A forward in pieces (chunked equals unchunked, bit for bit): token ids or hidden
    rows; a set ``cancel`` stops at the next piece, and any failure rolls the ring back."""
    start = int(session.clock)
    rows = len(rows_in)
    hs: list[FloatArray] = []
    lgs: list[FloatArray] = []
    try:
        for lo in range(0, rows, PIECE_ROWS):
            if cancel is not None and cancel.is_set():
                raise Cancelled("the client disconnected; the forward was abandoned")
            hi = min(rows, lo + PIECE_ROWS)
            want: LogitsRows = compute if compute != "last" or hi == rows else "none"
            if tokens:
                h, lg = session.forward_tokens(rows_in[lo:hi].tolist(), logits=want)
            else:
                h, lg = session.forward_hidden(rows_in[lo:hi], logits=want)
            hs.append(h)
            if lg is not None:
                lgs.append(lg)
    except BaseException:
        if int(session.clock) != start:
            session.rollback(start)
        raise
    h_all = hs[0] if len(hs) == 1 else np.concatenate(hs)
    lg_all = None if not lgs else lgs[0] if len(lgs) == 1 else np.concatenate(lgs)
    return h_all, lg_all
