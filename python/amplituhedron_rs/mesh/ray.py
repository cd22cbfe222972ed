"""Stations placed on a Ray cluster (``amplituhedron mesh up --ray [ADDRESS]``).

Each station is a Ray actor that supervises one station process on its node: the actor runs
``amplituhedron station serve`` (the same entry point as a local mesh, so a Ray station is
exactly a station), bound to every interface, and advertises the node's address. When the
station process dies, the actor exits, and Ray restarts it (``max_restarts=-1``) on a live
node, where it starts the station again on the same port; the station's process dies with
its actor (``PR_SET_PDEATHSIG``), so a killed actor leaves no orphan behind. Actors are
spread over the nodes and reserve no CPU of Ray's (the station's own threads do the work).

Every node needs this package and the model file (the bundled wheel, or the same ``--model``
path). Ray is an optional dependency: ``pip install 'amplituhedron-rs[ray]'``. Ray stations
listen beyond loopback, so they always require the mesh token (given, or a fresh random
one in ``spec.token``); it reaches each actor in its environment, so whoever can read the
Ray cluster's actor specs can read it: run Ray on a private network.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import threading
from typing import Any

from amplituhedron_rs._core import MeshError
from amplituhedron_rs.mesh.launcher import MeshSpec, StationInfo, split_layers, wait_healthy
from amplituhedron_rs.runtime.gguf_file import read_model_file

#: How every station actor is placed: restarted forever, spread over the nodes, no CPU
#: reservation (the station's compute threads are not Ray tasks).
ACTOR_OPTIONS: dict[str, Any] = {
    "max_restarts": -1,
    "num_cpus": 0,
    "scheduling_strategy": "SPREAD",
}
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the station process before exec: SIGTERM when the actor's process dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class StationSupervisor:
    """The body of a station actor (wrapped by ``ray.remote`` in :func:`station_actor`)."""

    def __init__(self, station_argv: list[str], port: int, env: dict[str, str]) -> None:
        import ray

        self.port = port
        self.host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.stopping = False
        cmd = [sys.executable, "-m", "amplituhedron_rs.cli", "station", "serve"]
        cmd += [*station_argv, "--host", "0.0.0.0", "--port", str(port)]
        self.process = subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=_die_with_parent)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        self.process.wait()
        if not self.stopping:
            # The station died: end the actor so that Ray restarts it (and the station).
            os._exit(1)

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def station_pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        self.stopping = True
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def station_actor() -> Any:
    """The Ray actor class of a station (Ray imported on first use)."""
    import ray

    return ray.remote(**ACTOR_OPTIONS)(StationSupervisor)


class RayMesh:
    """K layer ranges × N replicas as Ray actors; a context manager like ``LocalMesh``.

    ``address`` is the cluster's (``"auto"`` for the one this host belongs to); ``None``
    connects as ``ray.init()`` does (``RAY_ADDRESS``, or a new local cluster). Station ``i``
    (range-major, as in the mesh file) listens on ``base_port + i`` on its node; SPREAD
    placement puts a range's replicas on different nodes where there are several.
    """

    def __init__(
        self,
        stations: int,
        *,
        replicas: int = 1,
        address: str | None = None,
        base_port: int = 8100,
        model_path: str | None = None,
        token: str | None = None,
        insecure: bool = False,
        station_args: list[str] | None = None,
        startup_timeout: float = 180.0,
    ) -> None:
        if insecure:
            raise MeshError("Ray stations listen beyond loopback: they always require a token")
        if replicas < 1:
            raise MeshError(f"a mesh needs at least one replica of each range, got {replicas}")
        self.k = stations
        self.replicas = replicas
        self.address = address
        self.base_port = base_port
        self.model_path = model_path
        self.token = token or secrets.token_urlsafe(32)
        self.station_args = station_args or []
        self.startup_timeout = startup_timeout
        self.actors: list[Any] = []
        self.spec: MeshSpec | None = None
        self._started_ray = False

    def start(self) -> MeshSpec:
        try:
            import ray
        except ImportError as exc:
            raise MeshError(
                "placement on Ray needs the ray extra: pip install 'amplituhedron-rs[ray]'"
            ) from exc
        if not ray.is_initialized():
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
            self._started_ray = True
        n_layers = int(read_model_file(self.model_path).config["n_layers"])
        env = {"AMPLITUHEDRON_TOKEN": self.token}  # what `station serve` reads
        model = ["--model", self.model_path] if self.model_path else []
        actor = station_actor()
        ranges = [r for r in split_layers(n_layers, self.k) for _ in range(self.replicas)]
        try:
            for i, (lo, hi) in enumerate(ranges):
                argv = ["--layers", f"{lo}:{hi}", *model, *self.station_args]
                self.actors.append(actor.remote(argv, self.base_port + i, env))
            urls = ray.get([a.url.remote() for a in self.actors], timeout=self.startup_timeout)
            infos = [StationInfo(u, lo, hi) for u, (lo, hi) in zip(urls, ranges, strict=True)]
            self.wait_healthy(infos)
        except BaseException:
            self.close()
            raise
        self.spec = MeshSpec(tuple(infos), self.token)
        return self.spec

    def wait_healthy(self, infos: list[StationInfo] | None = None) -> None:
        """Blocks until every station answers ``/healthz`` (after start or a restart)."""
        infos = infos or (list(self.spec.stations) if self.spec else [])
        wait_healthy([s.url for s in infos], self.startup_timeout)

    def station_pid(self, index: int) -> int:
        """The station process behind actor ``index`` (failure drills and tests)."""
        import ray

        pid: int = ray.get(self.actors[index].station_pid.remote(), timeout=60)
        return pid

    def close(self) -> None:
        import ray

        for a in self.actors:
            # An actor already gone (or restarting) needs no stopping.
            with contextlib.suppress(Exception):
                ray.get(a.stop.remote(), timeout=30)
            ray.kill(a, no_restart=True)
        self.actors.clear()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> MeshSpec:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
