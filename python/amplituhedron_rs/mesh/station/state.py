"""A station's state and what it does: its layer range's weights and pipeline (with the
volume cache), its sessions' rings, and the operations the routes expose. Nothing here
knows HTTP routing; refusals are raised as the types of :mod:`.errors`.

Threading: compute runs in the server's worker threads (a decode step runs on the event
loop only when nothing else is in flight and its session is free: see :mod:`.fastpath`);
the Rust calls release the GIL. A session's lock serialises its ring, and the pipeline lock
the shared volume cache (Rust borrows it mutably). The event loop never waits on a lock:
it tries once, and a worker waits (bounded) instead.

Trust (SPEC §14): a station caches only what it computed itself. Each session remembers
whether its forwarded positions are exactly its prompt (the entry station compares the token
ids; every station counts positions), the tail row it emitted at the prompt's last position
and, at the exit, that position's logits; a capture freezes those, and takes no tensors
from the client.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError
from amplituhedron_rs.mesh.protocol import (
    BATCH_ROUTE,
    CLOCK,
    HIDDEN_ROWS,
    LOGITS_ROWS,
    TOKEN,
    ConfigureRequest,
    OpenSessionRequest,
)
from amplituhedron_rs.mesh.station.errors import (
    BadBody,
    Conflict,
    Forbidden,
    Full,
    NotFound,
    TooLarge,
)
from amplituhedron_rs.mesh.station.memory import process_rss, station_memory
from amplituhedron_rs.mesh.station.session import (
    HiddenRows,
    LiveSession,
    LogitsRows,
    Octets,
    SampledToken,
    StationSettings,
    f32_bytes,
    floats,
    new_session_id,
    physical_memory,
    run_pieces,
)
from amplituhedron_rs.mesh.station.volumes import StationVolumes
from amplituhedron_rs.runtime.gguf_file import read_model_file
from amplituhedron_rs.runtime.tokenizer import Tokenizer
from amplituhedron_rs.runtime.weights import new_pipeline, new_session

__all__ = ["HiddenRows", "LiveSession", "LogitsRows", "Octets", "Station", "StationSettings"]


class Station(StationVolumes):
    """State of one station process: weights, pipeline (+ volume cache), sessions."""

    def __init__(
        self, settings: StationSettings, weights: _core.ModelWeights | None = None
    ) -> None:
        self.settings = settings
        #: The process's resident set before this station loaded its weights.
        self.baseline_rss = process_rss()
        self.weights = weights if weights is not None else settings.load_weights()
        s = settings
        if not 0 <= s.layer_lo < s.layer_hi <= self.weights.n_layers:
            raise InputError(
                f"layers {s.layer_lo}:{s.layer_hi} are not a range of 0:{self.weights.n_layers}"
            )
        self.pipeline = new_pipeline(self.weights, s.layer_lo, s.layer_hi, s.cache)
        #: The cache's longest captured prefix (kept in step with ``configure``).
        self.max_prefix_len = s.cache.max_prefix_len
        self.is_entry = s.layer_lo == 0
        self.is_exit = s.layer_hi == self.weights.n_layers
        self.hidden = int(self.weights.hidden)
        self.vocab = int(self.weights.vocab)
        self.max_prompt = int(self.weights.context_len)
        # Only the entry station can check what it is sent (token ids against the prompt);
        # the others trust the hidden states of the mesh-token holder. An open station has
        # no such holder, so there only the entry station caches.
        self.declines_captures = (
            None
            if s.token is not None or self.is_entry
            else "an open (--insecure) station cannot verify the hidden states it is sent, "
            "so it caches nothing; run the mesh with a token"
        )
        self.max_rows = s.max_forward_rows or s.session.max_chunk
        self.sessions: dict[str, LiveSession] = {}
        self.sessions_lock = threading.Lock()
        # Rings of closed sessions, reset and kept for reuse (by n_sys): a fresh ring's pages
        # are faulted in on first write, which costs more than replaying a volume into it.
        self.pool: dict[int, list[tuple[_core.RangeSession, _core.RingLock]]] = {}
        # The first ring, made now: its slots size the memory budget's unit; it is pooled.
        first = new_session(self.weights, s.layer_lo, s.layer_hi, s.session)
        value_bytes = int(self.weights.kv_value_bytes)
        kv_row = 2 * int(self.weights.n_kv_heads) * int(self.weights.head_dim) * value_bytes
        self.ring_bytes = sum(int(n) for n in first.kv_slots) * kv_row
        self.memory_budget = s.memory_budget or physical_memory() // 4
        if self.ring_bytes > self.memory_budget:
            raise InputError(
                f"one session's rings need {self.ring_bytes} bytes, more than the "
                f"{self.memory_budget}-byte memory budget"
            )
        self.pool[s.session.n_sys] = [(first, _core.RingLock())]
        # The pipeline (volume cache) is shared by all sessions; Rust borrows it mutably.
        self.pipeline_lock = threading.Lock()
        # Compute calls running now (the decode fast path runs on the event loop only at 0);
        # updated from worker threads, so under a lock (`+=` is not atomic across threads).
        self.inflight = 0
        self._inflight_lock = threading.Lock()
        self._tokenizer: Tokenizer | None = None
        self._grammar_lock = threading.Lock()
        #: The step stream, once it listens (None: steps over HTTP only); it steps the
        #: sessions registered with it (all of them) without Python.
        self.stream: _core.StepStream | None = None
        self.stream_port: int | None = None

    def attach_stream(self, stream: _core.StepStream) -> None:
        """Lets ``stream`` step this station's sessions (registered as they open)."""
        with self.sessions_lock:
            self.stream = stream
            self.stream_port = int(stream.port)
            stream.set_max_prefix_len(self.max_prefix_len)
            for sid, live in self.sessions.items():
                _register(stream, sid, live)

    def detach_stream(self) -> None:
        """Stops the step stream (shutdown)."""
        with self.sessions_lock:
            stream, self.stream = self.stream, None
        if stream is not None:
            stream.close()

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Counts a compute call in flight (the decode fast path stays off the event loop
        while any runs)."""
        with self._inflight_lock:
            self.inflight += 1
        try:
            yield
        finally:
            with self._inflight_lock:
                self.inflight -= 1

    def is_idle(self) -> bool:
        """No session open and no compute call in flight."""
        with self.sessions_lock:
            if self.sessions:
                return False
        with self._inflight_lock:
            return self.inflight == 0

    def memory(self) -> dict[str, Any]:
        """What the station holds in memory (see :mod:`.memory`); reads /proc and takes the
        sessions' lock, so not on the event loop."""
        with self.sessions_lock:
            rings = self._rings_held() * self.ring_bytes
        return station_memory(self.weights.memory(), self.baseline_rss, rings)

    # --- sessions ------------------------------------------------------------------------
    def sweep_idle(self) -> int:
        """Closes sessions idle longer than ``session_idle_s``; returns how many."""
        now = time.monotonic()
        with self.sessions_lock:
            stale = [
                (sid, s)
                for sid, s in self.sessions.items()
                if now - self._last_used(sid, s) > self.settings.session_idle_s
                and not s.lock.locked()
            ]
            for sid, _ in stale:
                del self.sessions[sid]
        for sid, live in stale:
            self._retire(sid, live)
        return len(stale)

    def _last_used(self, sid: str, live: LiveSession) -> float:
        """When a request last used the session, here or on the step stream."""
        on_stream = None if self.stream is None else self.stream.last_used(sid)
        return live.last_used if on_stream is None else max(live.last_used, on_stream)

    def _retire(self, sid: str, live: LiveSession) -> None:
        """Marks a removed session closed and pools its ring (bounded) for reuse."""
        with live.lock:
            live.closed = True
            if self.stream is not None:
                # Under the lock: a step the stream began waits for it, then sees it closed.
                self.stream.unregister(sid)
            live.session.reset()
            with self.sessions_lock:
                if self._rings_held() < self.settings.max_sessions:
                    self.pool.setdefault(live.n_sys, []).append((live.session, live.lock))

    def _rings_held(self) -> int:
        """Rings alive now, in sessions and in the pool (call under ``sessions_lock``)."""
        return len(self.sessions) + sum(len(v) for v in self.pool.values())

    def salt_of(self, tenant: str | None) -> str | None:
        """The cache salt of a tenant: keyed by the mesh token, so it derives from the
        authenticated caller; an open (``--insecure``) station has no caller to vouch for a
        tenant, and refuses one."""
        if tenant is None:
            return None
        token = self.settings.token
        if token is None:
            raise Forbidden("a tenant needs an authenticated caller; this station runs --insecure")
        if not 1 <= len(tenant) <= 256:
            raise BadBody("the tenant header must be 1 to 256 characters")
        return hmac.new(token.encode(), tenant.encode(), hashlib.sha256).hexdigest()

    def open_session(
        self, req: OpenSessionRequest, tenant: str | None = None
    ) -> tuple[str, LiveSession]:
        self.sweep_idle()
        salt = self.salt_of(tenant)
        if len(req.prompt_tokens) > self.max_prompt:
            raise InputError(
                f"the prompt has {len(req.prompt_tokens)} tokens; the model's context is "
                f"{self.max_prompt}"
            )
        if req.n_sys > len(req.prompt_tokens):
            raise InputError(f"n_sys {req.n_sys} exceeds the {len(req.prompt_tokens)}-token prompt")
        bad = next((t for t in req.prompt_tokens if t >= self.vocab), None)
        if bad is not None:
            raise InputError(f"token id {bad} is outside the vocabulary of {self.vocab}")
        # Checked before a pooled ring is taken, so a refusal changes nothing.
        sampler = req.sampling.params().sampler(req.prompt_tokens) if self.is_exit else None
        # Only the exit station samples, so only it follows the grammar (compiled here, in
        # the route's worker thread; a grammar llguidance rejects is a 400).
        grammar = (
            _core.Grammar(self.grammar_vocabulary(), req.grammar.kind, req.grammar.text).start()
            if self.is_exit and req.grammar is not None
            else None
        )
        sid = new_session_id()
        with self.sessions_lock:
            if len(self.sessions) >= self.settings.max_sessions:
                raise Full(
                    f"station full: {len(self.sessions)} live sessions "
                    f"(max {self.settings.max_sessions}); retry later"
                )
            reusable = self.pool.get(req.n_sys)
            if reusable:
                rs, lock = reusable.pop()
            else:
                self._admit_new_ring()
                s = self.settings
                rs = new_session(self.weights, s.layer_lo, s.layer_hi, s.session, n_sys=req.n_sys)
                lock = _core.RingLock()
            live = LiveSession(rs, list(req.prompt_tokens), salt, req.n_sys, lock)
            live.sampler = sampler
            live.grammar = grammar
            self.sessions[sid] = live
            if self.stream is not None:
                _register(self.stream, sid, live)
        return sid, live

    def grammar_vocabulary(self) -> _core.GrammarVocabulary:
        """The model's vocabulary for grammars, read from its file on first use."""
        with self._grammar_lock:
            if self._tokenizer is None:
                s = self.settings
                path = s.model_path
                if path is None and s.model_index is not None:
                    path = json.loads(Path(s.model_index).read_text())["path"]
                self._tokenizer = Tokenizer(read_model_file(path))
        return self._tokenizer.grammar_vocabulary()

    def _admit_new_ring(self) -> None:
        """Room for one more ring within the memory budget (under ``sessions_lock``): pooled
        rings of other shapes go first; past the budget, 503 with Retry-After."""
        while (self._rings_held() + 1) * self.ring_bytes > self.memory_budget:
            spare = next((k for k, v in self.pool.items() if v), None)
            if spare is None:
                raise Full(
                    f"station memory budget reached: {len(self.sessions)} sessions hold "
                    f"{len(self.sessions) * self.ring_bytes} of {self.memory_budget} bytes; "
                    "retry later"
                )
            self.pool[spare].pop()

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
        self._retire(sid, live)

    # --- the volume cache ----------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self.pipeline_lock:
            return dict(self.pipeline.amplituhedron_stats())

    def flush_volumes(self) -> None:
        """Waits until every captured volume queued for the cache directory is on disk
        (captures write behind, off the step path); called at shutdown."""
        with self.pipeline_lock:
            self.pipeline.amplituhedron_flush()

    def configure(self, req: ConfigureRequest) -> None:
        with self.pipeline_lock:
            p = self.pipeline
            if req.enabled is not None:
                p.amplituhedron_enable(req.enabled)
            if req.max_entries is not None:
                p.amplituhedron_set_max_entries(req.max_entries)
            if req.max_prefix_len is not None:
                p.amplituhedron_set_max_prefix_len(req.max_prefix_len)
                self.max_prefix_len = req.max_prefix_len
                if self.stream is not None:
                    self.stream.set_max_prefix_len(req.max_prefix_len)
            if "max_bytes" in req.model_fields_set:
                p.amplituhedron_set_max_bytes(req.max_bytes)
            if req.min_prefix_reuse is not None:
                p.amplituhedron_set_min_prefix_reuse(req.min_prefix_reuse)

    def clear(self) -> None:
        with self.pipeline_lock:
            self.pipeline.amplituhedron_clear()

    def forward(
        self,
        sid: str,
        body: bytes,
        logits: LogitsRows,
        hidden: HiddenRows,
        *,
        one_row: bool = False,
        sample: bool = False,
        wait: float | None = None,
        cancel: threading.Event | None = None,
    ) -> Octets:
        """Runs a chunk (token ids at the entry station, hidden rows elsewhere); answers the
        requested hidden rows and logits, and with ``sample`` the exit station's next token
        in the ``X-Token`` header.

        At most ``max_rows`` rows (and ``max_logits_rows`` rows of ``logits=all``). The
        rows run in pieces; a set ``cancel`` (the client left) stops at the next piece and
        rolls the session back, so the request changes nothing."""
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
        if rows > self.max_rows:
            raise TooLarge(
                f"{rows} rows in one forward; at most {self.max_rows} (send the rest as "
                "further chunks)"
            )
        if logits == "all" and rows > self.settings.max_logits_rows:
            raise TooLarge(
                f"logits=all for {rows} rows; at most {self.settings.max_logits_rows} rows "
                "of logits per forward"
            )
        if (logits != "none" or sample) and not self.is_exit:
            raise BadBody("only the exit station returns logits or samples")
        if sample and live.grammar is not None:
            # Its grammar follows token ids, which only the batched step carries here.
            raise Conflict(f"session {sid!r} is constrained: it samples in {BATCH_ROUTE}")
        if self.is_entry:
            bad = ids[ids >= self.vocab]
            if bad.size:
                raise InputError(
                    f"token id {int(bad[0])} is outside the vocabulary of {self.vocab}"
                )
        # Sampling needs the last position's logits even when they are not returned.
        compute: LogitsRows = "last" if sample and logits == "none" else logits
        token = None
        with self.computing():
            waited = self.settings.busy_wait_s if wait is None else wait
            with live.use(sid, waited) as session:
                start = int(session.clock)
                rows_in = ids if self.is_entry else arr.reshape(rows, self.hidden)
                h, lg = run_pieces(session, rows_in, self.is_entry, compute, cancel)
                clock = int(session.clock)
                live.note_prompt(ids if self.is_entry else None, start, h, lg, compute)
                if lg is not None:
                    live.last_logits = lg[-1]
                    if sample:
                        assert live.sampler is not None
                        token = int(live.sampler.sample(lg[-1], clock))
        if hidden == "last":
            h = h[-1:]
        elif hidden == "none":
            h = h[:0]
        returned = lg if logits != "none" else None
        parts = [f32_bytes(h)] + ([f32_bytes(returned)] if returned is not None else [])
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
        wait: float | None = None,
    ) -> Octets:
        """One decode step: exactly one row (logits only where there are some)."""
        return self.forward(
            sid,
            body,
            logits if self.is_exit else "none",
            hidden,
            one_row=True,
            sample=sample,
            wait=wait,
        )

    def sample(self, sid: str, logprobs: int | None = None) -> SampledToken:
        """Exit station: the next token from the session's last logits (after an all-hit
        replay, those are the cached logits: the first token needs no model run)."""
        if not self.is_exit:
            raise BadBody("only the exit station samples")
        live = self.get_session(sid)
        with live.use(sid, self.settings.busy_wait_s) as session:
            return live.sample_next(sid, int(session.clock), logprobs)

    def rollback(self, sid: str, clock: int) -> int:
        live = self.get_session(sid)
        with live.use(sid, self.settings.busy_wait_s) as session:
            live.rollback(session, clock)
            return int(session.clock)

    def damage(self, prompt: list[int], position: int, tenant: str | None) -> bool:
        """Fault injection: poisons one cached position (tests and failure drills)."""
        salt = self.salt_of(tenant)
        with self.pipeline_lock:
            return bool(self.pipeline.amplituhedron_inject_fault(prompt, position, salt))


def _register(stream: _core.StepStream, sid: str, live: LiveSession) -> None:
    """Lets ``stream`` step session ``sid``; at the exit with its sampler, unless a grammar
    constrains it (its steps there stay Python's)."""
    sampler = live.sampler if live.grammar is None else None
    stream.register(sid, live.session, live.lock, live.prompt, sampler)
