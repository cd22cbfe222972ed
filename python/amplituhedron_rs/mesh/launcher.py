"""Meshes of stations: the mesh file, layer splits, and a local mesh of station processes.

A mesh file is JSON ``{"stations": [{"url", "layer_lo", "layer_hi"}, …], "token": …}`` whose
ranges tile ``[0, n_layers)``; stations may live on other hosts. Several stations may list
the same range: they are replicas of it (SPEC §13), and the executor fails over between
them. The token is the mesh token the stations require (SPEC §14): the file holding it is
written mode 0600. ``LocalMesh`` starts K×N station processes on loopback (``amplituhedron
mesh up --stations K --replicas N``) with a fresh random token unless told otherwise, waits
until each answers its health check, and stops them all on exit.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from amplituhedron_rs._core import MeshError
from amplituhedron_rs.runtime.gguf_file import read_model_file, resolve_model_path
from amplituhedron_rs.runtime.weights import write_model_index


def get_json(url: str, timeout: float = 10.0) -> Any:
    """GET ``url`` and parse JSON (start-up and discovery only; not a hot path).

    A reply that is not HTTP raises ``ConnectionError`` (an ``OSError``, as a refused
    connection does): polling a loopback port in the ephemeral range that nobody listens on
    yet can connect the socket to itself, and then the "reply" is our own request line."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except http.client.HTTPException as exc:
        raise ConnectionError(f"{url} did not answer in HTTP: {exc!r}") from exc


@dataclass(frozen=True)
class StationInfo:
    """Where one station lives and which layers it owns."""

    url: str
    layer_lo: int
    layer_hi: int


@dataclass(frozen=True)
class MeshSpec:
    """Stations whose layer ranges tile the model, and the mesh token they require (None:
    an ``--insecure`` mesh). Stations listing the same range are its replicas; distinct
    ranges must tile ``[0, n_layers)`` (replicas of a range share ``layer_lo`` and
    ``layer_hi``: a station covering part of another's range is refused)."""

    stations: tuple[StationInfo, ...]
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.stations:
            raise MeshError("a mesh needs at least one station")
        urls = [s.url for s in self.stations]
        twice = sorted({u for u in urls if urls.count(u) > 1})
        if twice:
            raise MeshError(f"a station is listed twice in the mesh: {twice}")
        expected = 0
        for replicas in self.ranges:
            s = replicas[0]
            if s.layer_lo != expected or s.layer_hi <= s.layer_lo:
                raise MeshError(
                    f"station {s.url} owns layers {s.layer_lo}:{s.layer_hi}; ranges must tile "
                    f"the model (next expected to start at {expected}; replicas of a range "
                    "share its layer_lo and layer_hi)"
                )
            expected = s.layer_hi

    @property
    def ranges(self) -> tuple[tuple[StationInfo, ...], ...]:
        """The replicas of each layer range, ranges in layer order, replicas in the order
        the mesh lists them."""
        by_range: dict[tuple[int, int], list[StationInfo]] = {}
        for s in self.stations:
            by_range.setdefault((s.layer_lo, s.layer_hi), []).append(s)
        return tuple(tuple(by_range[r]) for r in sorted(by_range))

    @property
    def chain(self) -> tuple[StationInfo, ...]:
        """The first replica of every range, in layer order (the whole mesh without
        replicas)."""
        return tuple(r[0] for r in self.ranges)

    @property
    def replicas(self) -> int:
        """The fewest replicas any range has."""
        return min(len(r) for r in self.ranges)

    @property
    def n_layers(self) -> int:
        return self.ranges[-1][0].layer_hi

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"stations": [asdict(s) for s in self.stations]}
        if self.token is not None:
            data["token"] = self.token
        return data

    def write(self, path: str | Path) -> None:
        """Writes the mesh file, readable by its owner only (it holds the mesh token)."""
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: Any) -> MeshSpec:
        try:
            stations = tuple(
                StationInfo(str(s["url"]).rstrip("/"), int(s["layer_lo"]), int(s["layer_hi"]))
                for s in data["stations"]
            )
            token = data.get("token")
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise MeshError(
                'a mesh file is {"stations": [{"url", "layer_lo", "layer_hi"}, ...], '
                '"token"?}: ' + str(exc)
            ) from exc
        if token is not None and (not isinstance(token, str) or not token):
            raise MeshError("the mesh file's token must be a non-empty string")
        return cls(stations, token)

    @classmethod
    def load(cls, where: str, token: str | None = None) -> MeshSpec:
        """A mesh from a file path, or from comma-separated station URLs (ranges discovered
        from each station's ``/healthz``); ``token`` overrides the file's."""
        if where.startswith(("http://", "https://")):
            infos = []
            for url in (u.strip().rstrip("/") for u in where.split(",") if u.strip()):
                try:
                    health = get_json(f"{url}/healthz")
                except (OSError, ValueError) as exc:
                    raise MeshError(f"station {url} does not answer /healthz: {exc}") from exc
                infos.append(StationInfo(url, int(health["layer_lo"]), int(health["layer_hi"])))
            return cls(tuple(sorted(infos, key=lambda s: s.layer_lo)), token)
        path = Path(where)
        if not path.is_file():
            raise MeshError(f"no mesh file at {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise MeshError(f"{path} is not JSON: {exc}") from exc
        spec = cls.from_json(data)
        return spec if token is None else cls(spec.stations, token)


def split_layers(n_layers: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous ranges of ``n_layers`` layers, sizes differing by at most one."""
    if not 1 <= k <= n_layers:
        raise MeshError(f"cannot split {n_layers} layers over {k} stations")
    base, extra = divmod(n_layers, k)
    ranges, lo = [], 0
    for i in range(k):
        hi = lo + base + (1 if i < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


#: The environment variable that sets a process's compute threads (the core's pool).
THREADS_ENV = "AMPLITUHEDRON_THREADS"


#: A station holding at least this many bytes of weights gets every core: its pass streams
#: them from DRAM for milliseconds, next to which waking a second thread is noise.
#: Measured: 28 single-layer stations of qwen2-7b (172 MB each) on 2 cores prefill 64
#: tokens in 3.9 s with two threads each against 5.9 s with one, and decode at the same
#: speed (docs/performance.md).
WHOLE_HOST_STATION_BYTES = 64 * 1024 * 1024

#: Set to "0" in every station process (by ``station serve``, unless the environment sets
#: it): the core's pool then lets its idle workers sleep instead of keeping them awake
#: through each pass, which only pays in a process that has the cores to itself (see
#: ``keeps_awake`` in rust/model/mod.rs; docs/performance.md).
KEEP_AWAKE_ENV = "AMPLITUHEDRON_KEEP_AWAKE"


def station_threads(stations: int, cores: int | None = None, station_bytes: int = 0) -> int:
    """Compute threads for each of ``stations`` processes sharing this host's cores. A few
    stations (at most two per core) or a station of ``station_bytes`` ≥
    :data:`WHOLE_HOST_STATION_BYTES` get every core: one computes while the others wait
    for their turn (measured: 4 stations of SmolLM2 on 2 cores decode in 6.9–10.3 ms/token
    with two threads each against 9.5–11.2 with one). Many small stations divide the cores
    among them, at least one thread each: their passes are too short to wake a second
    thread for, and its idle spins take the core the busy station needs (28 stations of
    SmolLM2 on 2 cores decode as fast with one thread each and burn less CPU)."""
    cores = cores or os.cpu_count() or 1
    if station_bytes >= WHOLE_HOST_STATION_BYTES or stations <= 2 * cores:
        return cores
    return max(1, cores // max(1, stations))


def model_station_bytes(model_path: str | Path | None, stations: int) -> int:
    """The bytes of the model file per station (the share each holds, roughly)."""
    return resolve_model_path(model_path).stat().st_size // max(1, stations)


def free_ports(k: int) -> list[int]:
    """``k`` distinct ports the OS reports free on loopback right now."""
    sockets, ports = [], []
    for _ in range(k):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def wait_healthy(
    urls: list[str], timeout: float, *, alive: Callable[[str], None] | None = None
) -> None:
    """Blocks until every station at ``urls`` answers ``/healthz``; MeshError after
    ``timeout`` seconds, or as soon as ``alive(url)`` raises (a station process that died)."""
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        for url in list(pending):
            if alive is not None:
                alive(url)
            try:
                get_json(f"{url}/healthz", timeout=2)
                pending.remove(url)
            except (OSError, ValueError):
                pass
        if pending and time.monotonic() > deadline:
            raise MeshError(f"stations not healthy after {timeout}s: {pending}")
        if pending:
            time.sleep(0.1)


def station_memory(spec: MeshSpec, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Each station's memory report (its ``/healthz``), with its URL and range, in mesh
    order; sum them with :func:`~.station.memory.mesh_memory`."""
    out = []
    for s in spec.stations:
        health = get_json(f"{s.url}/healthz", timeout=timeout)
        memory = health.get("memory") or {}
        out.append({"url": s.url, "layer_lo": s.layer_lo, "layer_hi": s.layer_hi} | memory)
    return out


class LocalMesh:
    """K station processes on loopback (``replicas`` of each of K layer ranges: K×N in all),
    started together and stopped together. They require ``token``, or a fresh random one
    (``spec.token``); ``insecure=True`` runs them open. ``station_env`` adds environment
    variables to some stations (by index in ``spec.stations``: failure drills). ``threads``:
    each station's compute threads (default: :func:`station_threads`, unless the
    environment sets ``AMPLITUHEDRON_THREADS``)."""

    def __init__(
        self,
        stations: int,
        *,
        replicas: int = 1,
        base_port: int | None = None,
        model_path: str | None = None,
        token: str | None = None,
        insecure: bool = False,
        station_args: list[str] | None = None,
        station_env: Mapping[int, Mapping[str, str]] | None = None,
        startup_timeout: float = 120.0,
        threads: int | None = None,
    ) -> None:
        if insecure and token is not None:
            raise MeshError("an insecure mesh has no token")
        if replicas < 1:
            raise MeshError(f"a mesh needs at least one replica of each range, got {replicas}")
        self.k = stations
        self.replicas = replicas
        self.base_port = base_port
        self.model_path = model_path
        self.token = None if insecure else token or secrets.token_urlsafe(32)
        self.station_args = station_args or []
        self.station_env = {i: dict(e) for i, e in (station_env or {}).items()}
        self.startup_timeout = startup_timeout
        if threads is not None and threads < 1:
            raise MeshError(f"a station needs at least one compute thread, got {threads}")
        self.threads = threads
        self.processes: list[subprocess.Popen[bytes]] = []
        self.spec: MeshSpec | None = None
        #: Each station's command line and environment (a restart reuses them).
        self._commands: list[list[str]] = []
        self._env: dict[str, str] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="amplituhedron-mesh-")

    def start(self) -> MeshSpec:
        # The header is parsed once here, so K stations start without parsing the
        # 49k-token vocabulary K times.
        model_file = read_model_file(self.model_path)
        index = write_model_index(model_file, Path(self._tmp.name) / "model-index.json")
        n_layers = int(model_file.config["n_layers"])
        # Range-major: the replicas of a range are neighbours in the mesh file.
        ranges = [r for r in split_layers(n_layers, self.k) for _ in range(self.replicas)]
        n = len(ranges)
        # Each station's HTTP port, then its step stream's: fixed here, so a restarted
        # station listens where it did.
        ports = (
            [self.base_port + i for i in range(2 * n)]
            if self.base_port is not None
            else free_ports(2 * n)
        )
        env = dict(os.environ)
        env.pop("AMPLITUHEDRON_TOKEN", None)  # the stations take this mesh's token, or none
        if self.threads is not None or THREADS_ENV not in env:
            share = model_file.path.stat().st_size // self.k
            env[THREADS_ENV] = str(self.threads or station_threads(n, station_bytes=share))
        self._env = env
        if self.token is None:
            auth = ["--insecure"]
        else:
            # A file in the private temporary directory: not on a command line `ps` shows.
            token_file = Path(self._tmp.name) / "token"
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.token)
            auth = ["--token-file", str(token_file)]
        infos = []
        for i, ((lo, hi), port) in enumerate(zip(ranges, ports[:n], strict=True)):
            cmd = [
                sys.executable,
                "-m",
                "amplituhedron_rs.cli",
                "station",
                "serve",
                "--layers",
                f"{lo}:{hi}",
                "--port",
                str(port),
                *(
                    []
                    if "--no-stream" in self.station_args
                    else ["--stream-port", str(ports[n + i])]
                ),
                "--model-index",
                str(index),
                *auth,
                *self.station_args,
            ]
            self._commands.append(cmd)
            infos.append(StationInfo(f"http://127.0.0.1:{port}", lo, hi))
            self.processes.append(self._launch(i, port, self.station_env.get(i, {})))
        try:
            self._wait_healthy(infos)
        except BaseException:
            self.stop()
            raise
        self.spec = MeshSpec(tuple(infos), self.token)
        return self.spec

    def _launch(
        self, index: int, port: int | str, extra: Mapping[str, str]
    ) -> subprocess.Popen[bytes]:
        """Starts station ``index``'s process (its output appended to its log)."""
        # The child keeps its own descriptor of the log; ours closes at once.
        with open(self._log_path(port), "ab") as log:
            return subprocess.Popen(
                self._commands[index],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self._env, **extra},
            )

    def restart_station(
        self, index: int, *, env: Mapping[str, str] | None = None, wait: bool = True
    ) -> None:
        """Starts station ``index`` again on its port after it died or was killed (empty:
        its sessions are gone; its volumes too unless it has a ``--cache-dir``); ``env``
        replaces its extra environment. ``wait``: block until it answers ``/healthz``."""
        if self.spec is None:
            raise MeshError("the mesh is not started")
        old = self.processes[index]
        if old.poll() is None:
            raise MeshError(f"station {index} is still running")
        info = self.spec.stations[index]
        extra = self.station_env.get(index, {}) if env is None else env
        self.processes[index] = self._launch(index, info.url.rsplit(":", 1)[1], extra)
        if wait:
            self._wait_healthy([info], [self.processes[index]])

    def _wait_healthy(
        self, infos: list[StationInfo], processes_: list[subprocess.Popen[bytes]] | None = None
    ) -> None:
        procs = self.processes if processes_ is None else processes_
        processes = {s.url: (s, p) for s, p in zip(infos, procs, strict=True)}

        def alive(url: str) -> None:
            info, proc = processes[url]
            if proc.poll() is not None:
                raise MeshError(
                    f"station {url} exited with code {proc.returncode} during start-up:\n"
                    + self.station_log(info)
                )

        wait_healthy([s.url for s in infos], self.startup_timeout, alive=alive)

    def _log_path(self, port: int | str) -> Path:
        return Path(self._tmp.name) / f"station-{port}.log"

    def station_log(self, info: StationInfo) -> str:
        """The end of one station's output (start-up failures quote it)."""
        path = self._log_path(info.url.rsplit(":", 1)[1])
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def kill_station(self, index: int) -> None:
        """Kills one station abruptly, SIGKILL (failure drills and tests)."""
        self.processes[index].kill()
        self.processes[index].wait(timeout=10)

    def alive(self, index: int) -> bool:
        """Whether station ``index``'s process is running."""
        return self.processes[index].poll() is None

    def stop(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.processes.clear()

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> MeshSpec:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
