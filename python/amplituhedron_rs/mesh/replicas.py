"""Which replica serves each layer range now, which stations are down, and bringing them back
(SPEC §13).

A mesh may list several stations for one layer range. The executor sends every sequence of a
range to one of them, the range's *primary*, so a sequence's sessions form one chain of
stations. When a station dies or stops answering, :meth:`Replicas.fail` marks it down and the
range's next live replica becomes its primary (the executor then rebuilds the affected
sequences there). Primaries are sticky: a station that comes back does not take its range
back, it only becomes a spare again, so a revival never forces a rebuild.

Down stations are probed in a background thread (``GET /healthz``, which needs no token,
with exponential backoff): a station that answers with the mesh's model and its own layer
range is live again — empty, since a restarted station holds no sessions (its volumes may
come back from its ``--cache-dir``). Each station has a *life* counter, bumped when it is
marked down, so a chain built before a death never matches one built after the revival.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from amplituhedron_rs._core import MeshError
from amplituhedron_rs.mesh.launcher import MeshSpec, StationInfo, get_json

#: A chain and the life of each of its stations: equal keys mean the same sessions hold.
ChainKey = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Chain:
    """One live station per range, in layer order, and its key."""

    stations: tuple[StationInfo, ...]
    key: ChainKey


class Replicas:
    """The primary of each range, the down stations and their health checks. Thread-safe:
    the executor's event loop and the health-check thread share it."""

    def __init__(
        self,
        mesh: MeshSpec,
        *,
        probe_timeout: float = 2.0,
        first_backoff: float = 0.2,
        max_backoff: float = 2.0,
    ) -> None:
        self.mesh = mesh
        self.ranges = mesh.ranges
        self.probe_timeout = probe_timeout
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        #: The model every station must run (set by the mesh check; None: not checked).
        self.fingerprint: str | None = None
        self._lock = threading.Lock()
        self._primary = [0] * len(self.ranges)
        self._life = {s.url: 0 for s in mesh.stations}
        #: Down stations: url → (next probe time, current backoff).
        self._down: dict[str, tuple[float, float]] = {}
        #: Why each down station was marked down (the last error).
        self.why: dict[str, str] = {}
        self.failovers = 0
        self.revivals = 0
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None

    # --- the executor's view -----------------------------------------------------------
    def chain(self) -> Chain:
        """The live primary of every range; MeshError naming a range none of whose
        replicas is live."""
        with self._lock:
            stations = []
            for i, replicas in enumerate(self.ranges):
                pick = self._pick(i)
                if pick is None:
                    raise MeshError(self._no_replica(replicas))
                stations.append(pick)
            return Chain(tuple(stations), tuple((s.url, self._life[s.url]) for s in stations))

    def _no_replica(self, replicas: tuple[StationInfo, ...]) -> str:
        """Why a range has no live replica: the range, then why each replica is down."""
        r = replicas[0]
        reasons = "; ".join(self.why.get(s.url, f"station {s.url} is down") for s in replicas)
        where = f"layers {r.layer_lo}:{r.layer_hi} ({len(replicas)} listed)"
        return f"no live replica of {where}: {reasons}"

    def no_replica(self, station: StationInfo) -> str | None:
        """None if ``station``'s range has a live replica, else why not (see ``chain``)."""
        with self._lock:
            replicas = self.range_of(station)
            if any(s.url not in self._down for s in replicas):
                return None
            return self._no_replica(replicas)

    def _pick(self, i: int) -> StationInfo | None:
        """Range ``i``'s primary, moved to its next live replica if it is down."""
        replicas = self.ranges[i]
        for step in range(len(replicas)):
            j = (self._primary[i] + step) % len(replicas)
            if replicas[j].url not in self._down:
                self._primary[i] = j
                return replicas[j]
        return None

    def live(self) -> list[StationInfo]:
        """Every station not marked down, in mesh order."""
        with self._lock:
            return [s for s in self.mesh.stations if s.url not in self._down]

    def is_down(self, url: str) -> bool:
        with self._lock:
            return url in self._down

    def range_of(self, station: StationInfo) -> tuple[StationInfo, ...]:
        """The replicas of ``station``'s range."""
        return next(r for r in self.ranges if r[0].layer_lo == station.layer_lo)

    def fail(self, station: StationInfo, why: str, *, failover: bool = True) -> bool:
        """Marks ``station`` down (its sessions are lost) and starts probing it; True if it
        was live (its range moves to another replica: a failover, counted unless
        ``failover=False``, a station already down when the mesh is checked), False if it
        was down already."""
        with self._wake:
            if station.url in self._down or station.url not in self._life:
                return False
            self._down[station.url] = (time.monotonic() + self.first_backoff, self.first_backoff)
            self._life[station.url] += 1
            self.why[station.url] = why
            self.failovers += failover
            self._ensure_thread()
            self._wake.notify_all()
            return True

    def restarted(self, station: StationInfo, chain: Chain | None) -> bool:
        """``station`` answers but lost the sessions of ``chain`` (it restarted before it
        was seen down): a new life makes every chain through it stale. True once per life
        (another sequence of the same chain hearing it too changes nothing)."""
        with self._lock:
            seen = dict(chain.key).get(station.url) if chain is not None else None
            if station.url not in self._life or seen != self._life[station.url]:
                return False
            self._life[station.url] += 1
            return True

    # --- health checks -----------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(
                target=self._probe_loop, name="amplituhedron-replicas", daemon=True
            )
            self._thread.start()

    def _probe_loop(self) -> None:
        with self._wake:
            while not self._closed:
                now = time.monotonic()
                due = [u for u, (at, _) in self._down.items() if at <= now]
                if not due:
                    nxt = min((at for at, _ in self._down.values()), default=None)
                    self._wake.wait(None if nxt is None else max(0.0, nxt - now))
                    continue
                self._lock.release()
                try:
                    answers = {u: self._probe(u) for u in due}
                finally:
                    self._lock.acquire()
                for url, ok in answers.items():
                    if url not in self._down:
                        continue
                    if ok:
                        self._revive(url)
                    else:
                        _, backoff = self._down[url]
                        backoff = min(self.max_backoff, backoff * 2)
                        self._down[url] = (time.monotonic() + backoff, backoff)

    def probe_range(self, station: StationInfo, timeout: float = 0.5) -> bool:
        """Probes the down replicas of ``station``'s range now (blocking, ``timeout`` each),
        reviving those that answer; True if the range has a live replica then. The last
        resort before failing a range: a replica may have come back since its last
        probe (or have lost only a pooled connection when it restarted)."""
        with self._lock:
            down = [s.url for s in self.range_of(station) if s.url in self._down]
        answers = {url: self._probe(url, timeout) for url in down}
        with self._wake:
            for url, ok in answers.items():
                if ok and url in self._down:
                    self._revive(url)
            self._wake.notify_all()
            return any(s.url not in self._down for s in self.range_of(station))

    def _revive(self, url: str) -> None:
        """Under the lock: ``url`` is live again (empty)."""
        del self._down[url]
        self.why.pop(url, None)
        self.revivals += 1

    def _probe(self, url: str, timeout: float | None = None) -> bool:
        """The station answers ``/healthz`` with the mesh's model and its own range."""
        info = next(s for s in self.mesh.stations if s.url == url)
        try:
            h = get_json(f"{url}/healthz", timeout=timeout or self.probe_timeout)
            same_range = (int(h["layer_lo"]), int(h["layer_hi"])) == (info.layer_lo, info.layer_hi)
            same_model = self.fingerprint is None or str(h["fingerprint"]) == self.fingerprint
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return same_range and same_model

    def wait_live(self, url: str, timeout: float) -> bool:
        """Blocks until ``url`` is live again (tests and drills); False after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while url in self._down:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.05))
            return True

    def close(self) -> None:
        """Stops the health checks."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.probe_timeout + 1)
