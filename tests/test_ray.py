"""Stations on a Ray cluster started by the test: the mesh they form generates exactly what
one process does, and a station killed with SIGKILL comes back (Ray restarts its actor, which
starts the station again on the same port) and serves the same tokens again."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

import amplituhedron_rs as ar
from amplituhedron_rs.mesh.launcher import get_json
from amplituhedron_rs.mesh.ray import RayMesh

pytestmark = [pytest.mark.model, pytest.mark.mesh, pytest.mark.ray]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def consecutive_free_ports(k: int) -> int:
    """A base port such that base … base+k-1 are all free now (a Ray station listens on
    ``base_port + i``), below Linux's ephemeral ports (32768 and up): polling an ephemeral
    port before its station listens can connect the poll's socket to itself, which then
    holds the port the station is about to bind."""
    for _ in range(100):
        base = random.randrange(20000, 32768 - k)
        socks: list[socket.socket] = []
        try:
            for i in range(k):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def test_a_ray_mesh_equals_one_process_and_a_killed_station_comes_back(
    cluster: None, model: ar.Model
) -> None:
    ids = model.chat_ids("You are terse.", "Name a river.")
    plain = model.generate(ids, 6, use_cache=False).output_ids

    async def once(mesh: ar.MeshSpec) -> list[int]:
        async with ar.Coordinator(mesh) as c:
            return (await c.generate(ids, 6, use_cache=False)).output_ids

    rm = RayMesh(2, base_port=consecutive_free_ports(2))
    with rm as mesh:
        assert [s.layer_lo for s in mesh.stations] == [0, mesh.stations[0].layer_hi]
        assert asyncio.run(once(mesh)) == plain
        before = rm.station_pid(1)
        os.kill(before, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # the actor exits, Ray restarts it, and it starts a new station
            try:
                after = rm.station_pid(1)
                if after != before:
                    break
            except ray.exceptions.RayError:
                pass  # the actor is restarting
            assert time.monotonic() < deadline, "the killed station never came back"
            time.sleep(0.5)
        rm.wait_healthy()
        assert asyncio.run(once(mesh)) == plain


def test_mesh_up_ray_writes_a_mesh_file_of_working_stations(
    cluster: None, model: ar.Model, tmp_path: Path
) -> None:
    mesh_file = tmp_path / "mesh.json"
    base = consecutive_free_ports(2)
    argv = [sys.executable, "-m", "amplituhedron_rs.cli", "mesh", "up", "--ray", "auto"]
    argv += ["--stations", "2", "--port", str(base), "--mesh-file", str(mesh_file)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not mesh_file.exists():
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "mesh up --ray wrote no mesh file"
            time.sleep(0.5)
        spec = ar.MeshSpec.load(str(mesh_file))
        assert [s.url.rsplit(":", 1)[1] for s in spec.stations] == [str(base), str(base + 1)]
        ids = model.chat_ids(None, "Count to three.")

        async def once() -> list[int]:
            async with ar.Coordinator(spec) as c:
                return (await c.generate(ids, 4, use_cache=False)).output_ids

        assert asyncio.run(once()) == model.generate(ids, 4, use_cache=False).output_ids
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    # Ctrl-C stopped the stations with their actors.
    with pytest.raises(OSError):
        get_json(f"{spec.stations[0].url}/healthz", timeout=2)


def test_ray_replicas_fail_over_while_ray_restarts_the_killed_station(
    cluster: None, model: ar.Model
) -> None:
    """2 ranges × 2 replicas on Ray: the exit primary is SIGKILLed mid-generation and the
    replica takes over (same tokens); Ray restarts the killed station, the coordinator's
    health checks take it back, and when the replica dies too the range fails over to it."""
    ids = model.chat_ids("You are terse.", "Name a river.")
    plain = model.generate(ids, 12, use_cache=False, stop_at_eos=False).output_ids
    rm = RayMesh(2, replicas=2, base_port=consecutive_free_ports(4))
    with rm as mesh:
        assert [len(r) for r in mesh.ranges] == [2, 2]

        async def go() -> None:
            async with ar.Coordinator(mesh) as c:
                for victim in (2, 3):
                    pid = rm.station_pid(victim)
                    emitted: list[int] = []

                    def kill(token: int, pid: int = pid, emitted: list[int] = emitted) -> None:
                        emitted.append(token)
                        if len(emitted) == 4:
                            os.kill(pid, signal.SIGKILL)

                    g = await c.generate(ids, 12, use_cache=False, on_token=kill)
                    assert g.output_ids == plain
                    url = mesh.stations[victim].url
                    # Ray restarts the actor, which starts the station again on its port.
                    back = c._link.replicas.wait_live
                    assert await asyncio.to_thread(back, url, 120), f"{url} never came back"
                assert c.failover_stats()["failovers"] == 2

        asyncio.run(go())
