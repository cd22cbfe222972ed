"""A station's volume cache operations: capture (freezing what the station computed for a
session's prompt) and replay, and the checks a volume request passes first (SPEC §14: a
station caches only what it computed itself)."""

from __future__ import annotations

import threading

import numpy as np

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError
from amplituhedron_rs.mesh.protocol import (
    REPLAY_KV_LEN,
    REPLAY_LOGITS,
    REPLAY_STATUS,
    U64_MAX,
    VolumeRequest,
)
from amplituhedron_rs.mesh.station.errors import (
    BadBody,
    Conflict,
)
from amplituhedron_rs.mesh.station.session import (
    LiveSession,
    Octets,
    StationSettings,
    f32_bytes,
)


class StationVolumes:
    """The volume operations of :class:`~.state.Station`, which holds the state declared
    here."""

    settings: StationSettings
    pipeline: _core.NativeLlamaPipeline
    pipeline_lock: threading.Lock
    is_exit: bool
    declines_captures: str | None

    def get_session(self, sid: str) -> LiveSession:
        raise NotImplementedError  # the station's

    def check_volume_request(self, req: VolumeRequest, live: LiveSession) -> int:
        """The request names this station's layers and the session's whole prompt (a
        volume is always a whole prompt: the station computed its tail there)."""
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
        if req.prefix_len != len(live.prompt):
            raise InputError(
                f"a volume covers the whole prompt ({len(live.prompt)} tokens), "
                f"not {req.prefix_len}"
            )
        expected = int(_core.prefix_hash(live.prompt))
        if prefix_hash != expected:
            raise Conflict(
                f"prefix_hash {prefix_hash} is not the hash of the session's "
                f"{req.prefix_len}-token prompt ({expected})"
            )
        return prefix_hash

    def capture(self, req: VolumeRequest, body: bytes) -> int:
        """Freezes the session's KV for its prompt with the tail row it emitted at the
        prompt's last position (and at the exit station the logits it computed there);
        returns the entry's bytes (0: the cache declined). Refused unless the session's
        forwarded positions are exactly its prompt."""
        if body:
            raise BadBody(
                "a capture takes no body: the station captures the tail (and logits) it "
                f"computed itself; got {len(body)} bytes"
            )
        live = self.get_session(req.session_id)
        self.check_volume_request(req, live)
        with live.use(req.session_id, self.settings.busy_wait_s) as session:
            return self.capture_own(live, session)

    def capture_own(self, live: LiveSession, session: _core.RangeSession) -> int:
        """The capture itself, under the session's lock (the capture endpoint and the
        batched step share it): Conflict unless the session computed exactly its prompt."""
        n = len(live.prompt)
        clock = int(session.clock)
        if not live.exact:
            raise Conflict(
                "the session's forwarded tokens are not the prompt it was opened with; "
                "nothing to capture"
            )
        tail, logits = live.prompt_tail, live.prompt_logits
        if tail is None or clock < n or (self.is_exit and logits is None):
            raise Conflict(
                f"the session has not computed its {n}-token prompt (clock {clock}); "
                "a capture freezes only what the station computed"
            )
        if self.declines_captures is not None:
            return 0
        with self.pipeline_lock:
            return int(
                self.pipeline.amplituhedron_capture(
                    session, live.prompt, tail, logits if self.is_exit else None, live.salt
                )
            )

    def replay(self, req: VolumeRequest) -> Octets | None:
        """Splices the prompt's volume into the fresh session: the tail (+ logits) with the
        verdict headers, or None on a miss. An open station answers whole-prompt hits only:
        a partial hit's length would tell an unauthenticated caller how much of another
        user's cached prompt it guessed."""
        live = self.get_session(req.session_id)
        self.check_volume_request(req, live)
        with live.use(req.session_id, self.settings.busy_wait_s) as session:
            if int(session.clock) != 0:
                raise Conflict(f"session {req.session_id!r} is not fresh")
            with self.pipeline_lock:
                r = self.pipeline.amplituhedron_replay(session, live.prompt, live.salt)
            if r is not None and r.status != "hit" and self.settings.token is None:
                session.reset()
                r = None
            if r is None:
                return None
            live.last_logits = r.logits
            if r.status == "hit":
                # The cache holds only station-computed volumes of this very prompt.
                live.prompt_tail = np.asarray(r.tail, dtype=np.float32)
                live.prompt_logits = r.logits
        parts = [f32_bytes(a) for a in (r.tail, r.logits) if a is not None]
        headers = {
            REPLAY_STATUS: r.status,
            REPLAY_KV_LEN: str(r.kv_len),
            REPLAY_LOGITS: "1" if r.logits is not None else "0",
        }
        return Octets(b"".join(parts), headers)

    # --- compute -------------------------------------------------------------------------
