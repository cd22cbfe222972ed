"""A station's sessions: the live ring with what a capture may freeze, the binary answer,
and the forward in pieces. No HTTP; refusals are the types of :mod:`.errors`.

Trust (SPEC §14): a station caches only what it computed itself. Each session remembers
whether its forwarded positions are exactly its prompt (the entry station compares the token
ids; every station counts positions), the tail row it emitted at the prompt's last position
and, at the exit, that position's logits; a capture freezes those, and takes no tensors
from the client.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from amplituhedron_rs import _core
from amplituhedron_rs.mesh.station.errors import BadBody, Busy, Cancelled, NotFound

FloatArray = np.ndarray[Any, np.dtype[np.float32]]
LogitsRows = Literal["none", "last", "all"]
HiddenRows = Literal["all", "last", "none"]


@dataclass
class LiveSession:
    """A session's ring buffer plus what the station needs to serve it.

    The lock travels with the ring when a closed session's ring is pooled for reuse, so a
    request that still holds the old wrapper serialises with the ring's next owner and then
    sees ``closed``. ``clock`` mirrors the ring's clock (read without borrowing the ring,
    which a forward in another thread holds mutably).
    """

    session: _core.RangeSession
    prompt: list[int]
    salt: str | None
    n_sys: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False
    clock: int = 0
    # Exit station only: the session's sampler and the logits of its last position.
    sampler: _core.Sampler | None = None
    last_logits: FloatArray | None = None
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


#: Rows per Rust call within one forward: the points where a departed client's work stops.
PIECE_ROWS = 64


def run_pieces(
    session: _core.RangeSession,
    is_entry: bool,
    rows_in: Any,
    rows: int,
    compute: LogitsRows,
    cancel: threading.Event | None,
    start: int,
) -> tuple[FloatArray, FloatArray | None]:
    """The forward in pieces (chunked equals unchunked, bit for bit)."""
    hs: list[FloatArray] = []
    lgs: list[FloatArray] = []
    try:
        for lo in range(0, rows, PIECE_ROWS):
            if cancel is not None and cancel.is_set():
                raise Cancelled("the client disconnected; the forward was abandoned")
            hi = min(rows, lo + PIECE_ROWS)
            want: LogitsRows = compute if compute != "last" or hi == rows else "none"
            if is_entry:
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


def note_prompt(
    live: LiveSession,
    ids: Any,
    start: int,
    h: FloatArray,
    lg: FloatArray | None,
    compute: LogitsRows,
) -> None:
    """Records what a later capture may freeze: whether the rows forwarded into the
    prompt's positions were its tokens (the entry station can tell; the others count
    positions), and the tail row and logits computed at its last position."""
    n = len(live.prompt)
    end = start + h.shape[0]
    if start >= n:
        return
    if ids is not None:
        overlap = min(end, n) - start
        if ids[:overlap].tolist() != live.prompt[start : start + overlap]:
            live.exact = False
    if end >= n:
        at = n - 1 - start
        live.prompt_tail = np.array(h[at], dtype=np.float32)
        if lg is not None and compute == "all":
            live.prompt_logits = np.array(lg[at], dtype=np.float32)
        elif lg is not None and end == n:
            live.prompt_logits = np.array(lg[-1], dtype=np.float32)
