"""Meshes of stations: the mesh file, layer splits, and a local mesh of station processes.

A mesh file is JSON ``{"stations": [{"url", "layer_lo", "layer_hi"}, …], "token": …}`` whose
ranges tile ``[0, n_layers)`` in order; stations may live on other hosts. The token is the
mesh token the stations require (SPEC §14): the file holding it is written mode 0600.
``LocalMesh`` starts K station processes on loopback (``amplituhedron mesh up``) with a fresh
random token unless told otherwise, waits until each answers its health check, and stops
them all on exit.
"""

from __future__ import annotations

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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from amplituhedron_rs._core import MeshError
from amplituhedron_rs.runtime.gguf_file import read_model_file
from amplituhedron_rs.runtime.weights import write_model_index


def get_json(url: str, timeout: float = 10.0) -> Any:
    """GET ``url`` and parse JSON (start-up and discovery only; not a hot path)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@dataclass(frozen=True)
class StationInfo:
    """Where one station lives and which layers it owns."""

    url: str
    layer_lo: int
    layer_hi: int


@dataclass(frozen=True)
class MeshSpec:
    """An ordered list of stations whose layer ranges tile the model, and the mesh token
    they require (None: an ``--insecure`` mesh)."""

    stations: tuple[StationInfo, ...]
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.stations:
            raise MeshError("a mesh needs at least one station")
        expected = 0
        for s in self.stations:
            if s.layer_lo != expected or s.layer_hi <= s.layer_lo:
                raise MeshError(
                    f"station {s.url} owns layers {s.layer_lo}:{s.layer_hi}; ranges must tile "
                    f"the model in order (next expected to start at {expected})"
                )
            expected = s.layer_hi

    @property
    def n_layers(self) -> int:
        return self.stations[-1].layer_hi

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


class LocalMesh:
    """K station processes on loopback, started together and stopped together. They require
    ``token``, or a fresh random one (``spec.token``); ``insecure=True`` runs them open."""

    def __init__(
        self,
        stations: int,
        *,
        base_port: int | None = None,
        model_path: str | None = None,
        token: str | None = None,
        insecure: bool = False,
        station_args: list[str] | None = None,
        startup_timeout: float = 120.0,
    ) -> None:
        if insecure and token is not None:
            raise MeshError("an insecure mesh has no token")
        self.k = stations
        self.base_port = base_port
        self.model_path = model_path
        self.token = None if insecure else token or secrets.token_urlsafe(32)
        self.station_args = station_args or []
        self.startup_timeout = startup_timeout
        self.processes: list[subprocess.Popen[bytes]] = []
        self.spec: MeshSpec | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="amplituhedron-mesh-")

    def start(self) -> MeshSpec:
        # The header is parsed once here, so K stations start without parsing the
        # 49k-token vocabulary K times.
        model_file = read_model_file(self.model_path)
        index = write_model_index(model_file, Path(self._tmp.name) / "model-index.json")
        n_layers = int(model_file.config["n_layers"])
        ranges = split_layers(n_layers, self.k)
        ports = (
            [self.base_port + i for i in range(self.k)]
            if self.base_port is not None
            else free_ports(self.k)
        )
        env = dict(os.environ)
        env.pop("AMPLITUHEDRON_TOKEN", None)  # the stations take this mesh's token, or none
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
        for (lo, hi), port in zip(ranges, ports, strict=True):
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
                "--model-index",
                str(index),
                *auth,
                *self.station_args,
            ]
            # The child keeps its own descriptor of the log; ours closes at once.
            with open(self._log_path(port), "wb") as log:
                self.processes.append(
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                )
            infos.append(StationInfo(f"http://127.0.0.1:{port}", lo, hi))
        try:
            self._wait_healthy(infos)
        except BaseException:
            self.stop()
            raise
        self.spec = MeshSpec(tuple(infos), self.token)
        return self.spec

    def _wait_healthy(self, infos: list[StationInfo]) -> None:
        processes = {s.url: (s, p) for s, p in zip(infos, self.processes, strict=True)}

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
        """Kills one station abruptly (failure drills and tests)."""
        self.processes[index].kill()
        self.processes[index].wait(timeout=10)

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
