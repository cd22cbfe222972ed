"""A station's state and what it does: its layer range's weights and pipeline (with the
volume cache), its sessions' rings, and the operations the routes expose. Nothing here
knows HTTP routing; refusals are raised as the types of :mod:`.errors`.

Threading: prefill chunks and captures run in the server's worker threads, decode steps on
the event loop; the Rust calls release the GIL. A session's lock serialises its ring, and
the pipeline lock the shared volume cache (Rust borrows it mutably).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError
from amplituhedron_rs.mesh.protocol import (
    CLOCK,
    HIDDEN_ROWS,
    LOGITS_ROWS,
    REPLAY_KV_LEN,
    REPLAY_LOGITS,
    REPLAY_STATUS,
    TOKEN,
    U64_MAX,
    ConfigureRequest,
    OpenSessionRequest,
    VolumeRequest,
)
from amplituhedron_rs.mesh.station.errors import BadBody, Conflict, Full, NotFound
from amplituhedron_rs.runtime.gguf_file import read_model_file
from amplituhedron_rs.runtime.options import CacheOptions, Precision, SessionOptions
from amplituhedron_rs.runtime.weights import (
    load_indexed_weights,
    load_weights,
    new_pipeline,
    new_session,
)

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
    token: str | None = None
    max_sessions: int = 8
    session_idle_s: float = 300.0
    max_body_bytes: int = 64 * 1024 * 1024
    cache: CacheOptions = field(default_factory=CacheOptions)
    session: SessionOptions = field(default_factory=SessionOptions)
    fault_injection: bool = False
    precision: Precision = "refined"

    def load_weights(self) -> _core.ModelWeights:
        if self.model_index is not None:
            return load_indexed_weights(Path(self.model_index), self.precision)
        return load_weights(read_model_file(self.model_path), self.precision)


@dataclass
class LiveSession:
    """A session's ring buffer plus what the station needs to serve it.

    The lock travels with the ring when a closed session's ring is pooled for reuse, so a
    request that still holds the old wrapper serialises with the ring's next owner and then
    sees ``closed``.
    """

    session: _core.RangeSession
    prompt: list[int]
    salt: str | None
    n_sys: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False
    # Exit station only: the session's sampler and the logits of its last position.
    sampler: _core.Sampler | None = None
    last_logits: FloatArray | None = None
    # ... and of the prompt's last position (what a capture freezes with the volume).
    prompt_logits: FloatArray | None = None

    @contextlib.contextmanager
    def use(self, sid: str) -> Iterator[_core.RangeSession]:
        """Exclusive use of the ring; NotFound if the session closed meanwhile."""
        with self.lock:
            if self.closed:
                raise NotFound(f"session {sid!r} was closed")
            yield self.session


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


def _f32_bytes(a: Any) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


class Station:
    """State of one station process: weights, pipeline (+ volume cache), sessions."""

    def __init__(
        self, settings: StationSettings, weights: _core.ModelWeights | None = None
    ) -> None:
        self.settings = settings
        self.weights = weights if weights is not None else settings.load_weights()
        s = settings
        if not 0 <= s.layer_lo < s.layer_hi <= self.weights.n_layers:
            raise InputError(
                f"layers {s.layer_lo}:{s.layer_hi} are not a range of 0:{self.weights.n_layers}"
            )
        self.pipeline = new_pipeline(self.weights, s.layer_lo, s.layer_hi, s.cache)
        self.is_entry = s.layer_lo == 0
        self.is_exit = s.layer_hi == self.weights.n_layers
        self.hidden = int(self.weights.hidden)
        self.vocab = int(self.weights.vocab)
        self.sessions: dict[str, LiveSession] = {}
        self.sessions_lock = threading.Lock()
        # Rings of closed sessions, reset and kept for reuse (by n_sys): a fresh ring's pages
        # are faulted in on first write, which costs more than replaying a volume into it.
        self.pool: dict[int, list[tuple[_core.RangeSession, threading.Lock]]] = {}
        # The pipeline (volume cache) is shared by all sessions; Rust borrows it mutably.
        self.pipeline_lock = threading.Lock()
        self.forward_rows = 0

    # --- sessions ------------------------------------------------------------------------
    def sweep_idle(self) -> int:
        """Closes sessions idle longer than ``session_idle_s``; returns how many."""
        now = time.monotonic()
        with self.sessions_lock:
            stale = [
                (sid, s)
                for sid, s in self.sessions.items()
                if now - s.last_used > self.settings.session_idle_s and not s.lock.locked()
            ]
            for sid, _ in stale:
                del self.sessions[sid]
        for _, live in stale:
            self._retire(live)
        return len(stale)

    def _retire(self, live: LiveSession) -> None:
        """Marks a removed session closed and pools its ring (bounded) for reuse."""
        with live.lock:
            live.closed = True
            live.session.reset()
            with self.sessions_lock:
                pooled = sum(len(v) for v in self.pool.values())
                if pooled + len(self.sessions) < self.settings.max_sessions:
                    self.pool.setdefault(live.n_sys, []).append((live.session, live.lock))

    def open_session(self, req: OpenSessionRequest) -> tuple[str, LiveSession]:
        self.sweep_idle()
        sid = req.session_id or uuid.uuid4().hex
        with self.sessions_lock:
            if sid in self.sessions:
                raise Conflict(f"session {sid!r} already exists")
            if len(self.sessions) >= self.settings.max_sessions:
                raise Full(
                    f"station full: {len(self.sessions)} live sessions "
                    f"(max {self.settings.max_sessions}); retry later"
                )
            if req.n_sys > len(req.prompt_tokens):
                raise InputError(
                    f"n_sys {req.n_sys} exceeds the {len(req.prompt_tokens)}-token prompt"
                )
            # Checked before a pooled ring is taken, so a refusal changes nothing.
            sampler = req.sampling.params().sampler() if self.is_exit else None
            reusable = self.pool.get(req.n_sys)
            if reusable:
                rs, lock = reusable.pop()
            else:
                s = self.settings
                rs = new_session(self.weights, s.layer_lo, s.layer_hi, s.session, n_sys=req.n_sys)
                lock = threading.Lock()
            live = LiveSession(rs, list(req.prompt_tokens), req.salt, req.n_sys, lock)
            live.sampler = sampler
            self.sessions[sid] = live
        return sid, live

    def get_session(self, sid: str) -> LiveSession:
        with self.sessions_lock:
            live = self.sessions.get(sid)
        if live is None:
            raise NotFound(f"no session {sid!r} (closed, expired, or never opened)")
        live.last_used = time.monotonic()
        return live

    def close_session(self, sid: str) -> None:
        with self.sessions_lock:
            live = self.sessions.pop(sid, None)
        if live is None:
            raise NotFound(f"no session {sid!r}")
        self._retire(live)

    # --- the volume cache ----------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self.pipeline_lock:
            return dict(self.pipeline.amplituhedron_stats())

    def configure(self, req: ConfigureRequest) -> None:
        with self.pipeline_lock:
            p = self.pipeline
            if req.enabled is not None:
                p.amplituhedron_enable(req.enabled)
            if req.max_entries is not None:
                p.amplituhedron_set_max_entries(req.max_entries)
            if req.max_prefix_len is not None:
                p.amplituhedron_set_max_prefix_len(req.max_prefix_len)
            if "max_bytes" in req.model_fields_set:
                p.amplituhedron_set_max_bytes(req.max_bytes)
            if req.min_prefix_reuse is not None:
                p.amplituhedron_set_min_prefix_reuse(req.min_prefix_reuse)

    def clear(self) -> None:
        with self.pipeline_lock:
            self.pipeline.amplituhedron_clear()

    def check_volume_request(self, req: VolumeRequest, live: LiveSession) -> int:
        s = self.settings
        if (req.layer_lo, req.layer_hi) != (s.layer_lo, s.layer_hi):
            raise Conflict(
                f"this station owns layers {s.layer_lo}:{s.layer_hi}, "
                f"not {req.layer_lo}:{req.layer_hi}"
            )
        prefix_hash = int(req.prefix_hash)
        if prefix_hash > U64_MAX:
            raise InputError(f"prefix_hash {req.prefix_hash} does not fit a u64")
        if req.prefix_len > len(live.prompt):
            raise InputError(
                f"prefix_len {req.prefix_len} exceeds the session's {len(live.prompt)}-token prompt"
            )
        expected = int(_core.prefix_hash(live.prompt[: req.prefix_len]))
        if prefix_hash != expected:
            raise Conflict(
                f"prefix_hash {prefix_hash} is not the hash of the session's first "
                f"{req.prefix_len} tokens ({expected})"
            )
        return prefix_hash

    def capture(self, req: VolumeRequest, body: bytes) -> int:
        """Freezes the session's KV for its prompt plus the tail in ``body`` (the exit
        station adds the prompt's logits it kept, unless the body carries them); returns
        the entry's bytes (0: the cache declined)."""
        live = self.get_session(req.session_id)
        self.check_volume_request(req, live)
        values = floats(body, "tail residual")
        with_logits = self.hidden + self.vocab
        if values.size != self.hidden and not (self.is_exit and values.size == with_logits):
            what = "tail residual (+ logits)" if self.is_exit else "tail residual"
            raise BadBody(
                f"body must be the {what}: {self.hidden} f32 "
                f"({self.hidden * 4} bytes), got {len(body)} bytes"
            )
        tail = np.ascontiguousarray(values[: self.hidden])
        logits = None
        if self.is_exit:
            logits = (
                np.ascontiguousarray(values[self.hidden :])
                if values.size == with_logits
                else live.prompt_logits
            )
            if logits is None or req.prefix_len != len(live.prompt):
                raise Conflict(
                    "the exit station can only capture the whole prompt after computing its "
                    "last position"
                )
        with live.use(req.session_id) as session, self.pipeline_lock:
            return int(
                self.pipeline.amplituhedron_capture(
                    session, live.prompt[: req.prefix_len], tail, logits, live.salt
                )
            )

    def replay(self, req: VolumeRequest) -> Octets | None:
        """Splices the prompt's volume into the fresh session: the tail (+ logits) with the
        verdict headers, or None on a miss."""
        live = self.get_session(req.session_id)
        self.check_volume_request(req, live)
        if req.prefix_len != len(live.prompt):
            raise InputError(
                f"replay covers the whole prompt ({len(live.prompt)} tokens), not {req.prefix_len}"
            )
        with live.use(req.session_id) as session, self.pipeline_lock:
            if session.clock != 0:
                raise Conflict(f"session {req.session_id!r} is not fresh")
            r = self.pipeline.amplituhedron_replay(session, live.prompt, live.salt)
        if r is None:
            return None
        live.last_logits = r.logits
        parts = [_f32_bytes(a) for a in (r.tail, r.logits) if a is not None]
        headers = {
            REPLAY_STATUS: r.status,
            REPLAY_KV_LEN: str(r.kv_len),
            REPLAY_LOGITS: "1" if r.logits is not None else "0",
        }
        return Octets(b"".join(parts), headers)

    # --- compute -------------------------------------------------------------------------
    def forward(
        self,
        sid: str,
        body: bytes,
        logits: LogitsRows,
        hidden: HiddenRows,
        *,
        one_row: bool = False,
        sample: bool = False,
    ) -> Octets:
        """Runs a chunk (token ids at the entry station, hidden rows elsewhere); answers the
        requested hidden rows and logits, and with ``sample`` the exit station's next token
        in the ``X-Token`` header."""
        live = self.get_session(sid)
        if self.is_entry:
            if len(body) % 4 != 0 or not body:
                raise BadBody(f"the entry station takes u32 LE token ids; got {len(body)} bytes")
            ids = np.frombuffer(body, dtype="<u4")
            rows = int(ids.size)
        else:
            arr = floats(body, "hidden states")
            if arr.size == 0 or arr.size % self.hidden != 0:
                raise BadBody(f"hidden states must be n × {self.hidden} f32; got {arr.size} values")
            rows = arr.size // self.hidden
        if one_row and rows != 1:
            raise BadBody(f"a decode step is exactly one row, got {rows}")
        if (logits != "none" or sample) and not self.is_exit:
            raise BadBody("only the exit station returns logits or samples")
        # Sampling needs the last position's logits even when they are not returned.
        compute: LogitsRows = "last" if sample and logits == "none" else logits
        token = None
        with live.use(sid) as session:
            if self.is_entry:
                h, lg = session.forward_tokens(ids.tolist(), logits=compute)
            else:
                h, lg = session.forward_hidden(arr.reshape(rows, self.hidden), logits=compute)
            clock = int(session.clock)
            if lg is not None:
                live.last_logits = lg[-1]
                if clock == len(live.prompt):
                    live.prompt_logits = lg[-1]
                if sample:
                    assert live.sampler is not None
                    token = int(live.sampler.sample(lg[-1], clock))
        self.forward_rows += rows
        if hidden == "last":
            h = h[-1:]
        elif hidden == "none":
            h = h[:0]
        returned = lg if logits != "none" else None
        parts = [_f32_bytes(h)] + ([_f32_bytes(returned)] if returned is not None else [])
        headers = {
            HIDDEN_ROWS: str(h.shape[0]),
            LOGITS_ROWS: str(0 if returned is None else returned.shape[0]),
            CLOCK: str(clock),
        }
        if token is not None:
            headers[TOKEN] = str(token)
        return Octets(b"".join(parts), headers)

    def decode_step(
        self,
        sid: str,
        body: bytes,
        logits: Literal["none", "last"],
        hidden: HiddenRows,
        sample: bool,
    ) -> Octets:
        """One decode step: exactly one row (logits only where there are some)."""
        return self.forward(
            sid,
            body,
            logits if self.is_exit else "none",
            hidden,
            one_row=True,
            sample=sample,
        )

    def sample(self, sid: str) -> int:
        """Exit station: the next token from the session's last logits (after an all-hit
        replay, those are the cached logits: the first token needs no model run)."""
        if not self.is_exit:
            raise BadBody("only the exit station samples")
        live = self.get_session(sid)
        with live.use(sid) as session:
            if live.last_logits is None:
                raise Conflict(f"session {sid!r} has no logits yet")
            assert live.sampler is not None
            return int(live.sampler.sample(live.last_logits, int(session.clock)))

    def rollback(self, sid: str, clock: int) -> int:
        live = self.get_session(sid)
        with live.use(sid) as session:
            session.rollback(clock)
            return int(session.clock)

    def damage(self, prompt: list[int], position: int, salt: str | None) -> bool:
        """Fault injection: poisons one cached position (tests and failure drills)."""
        with self.pipeline_lock:
            return bool(self.pipeline.amplituhedron_inject_fault(prompt, position, salt))
