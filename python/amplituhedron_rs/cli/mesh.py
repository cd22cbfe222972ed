"""``amplituhedron mesh up``: a local mesh of station processes, until Ctrl-C."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import (
    add_cache_dir,
    add_model,
    add_threads,
    add_token,
    err,
    token_of,
)

HELP = "local meshes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="mesh_command", required=True)
    up = sub.add_parser("up", help="start K stations (× N replicas) on loopback until Ctrl-C")
    up.add_argument("--stations", type=int, default=3, metavar="K", help="layer ranges")
    up.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="stations per layer range; the executor fails over between them",
    )
    up.add_argument(
        "--port", type=int, default=8100, metavar="BASE", help="the first station's port"
    )
    up.add_argument(
        "--mesh-file", default="mesh.json", metavar="PATH", help="where the mesh file is written"
    )
    add_model(up)
    add_token(
        up,
        "the mesh token the stations require (default: a fresh random one, written to the "
        "mesh file)",
        insecure="run the stations without a token (loopback)",
    )
    add_cache_dir(up)
    add_threads(up)
    up.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="place the stations as Ray actors across a cluster (ADDRESS, or 'auto' for this "
        "host's; none: RAY_ADDRESS or a new local cluster); needs the ray extra",
    )


def run(a: argparse.Namespace) -> int:
    import signal
    import threading

    from amplituhedron_rs.bench.memory import measure_memory, memory_table
    from amplituhedron_rs.mesh.launcher import LocalMesh
    from amplituhedron_rs.mesh.ray import RayMesh

    station_args = []
    if a.cache_dir:
        station_args += ["--cache-dir", a.cache_dir]
    if a.max_disk_bytes is not None:
        station_args += ["--max-disk-bytes", str(a.max_disk_bytes)]
    mesh: LocalMesh | RayMesh
    if a.ray is not None:
        mesh = RayMesh(
            a.stations,
            replicas=a.replicas,
            address=a.ray or None,
            base_port=a.port,
            model_path=a.model,
            token=None if a.insecure else token_of(a),
            insecure=a.insecure,
            station_args=station_args,
        )
    else:
        mesh = LocalMesh(
            a.stations,
            replicas=a.replicas,
            base_port=a.port,
            model_path=a.model,
            token=None if a.insecure else token_of(a),
            insecure=a.insecure,
            station_args=station_args,
        )
    total = a.stations * a.replicas
    with err.status(f"starting {total} stations ({a.stations} ranges × {a.replicas})…"):
        spec = mesh.start()
    spec.write(a.mesh_file)
    for s in spec.stations:
        err.print(f"  station {s.url}  layers {s.layer_lo}:{s.layer_hi}")
    err.print(memory_table(measure_memory(spec, a.model)))
    auth = "no token (--insecure)" if spec.token is None else "mesh token inside, mode 0600"
    err.print(f"mesh file: {a.mesh_file} ({auth}) — stop with Ctrl-C")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            if isinstance(mesh, RayMesh):
                continue  # Ray restarts a station that dies
            dead = {i for i in range(len(mesh.processes)) if not mesh.alive(i)}
            # A range keeps serving while one of its replicas runs (failover covers it).
            down = [r for r in spec.ranges if all(spec.stations.index(s) in dead for s in r)]
            if down:
                lo, hi = down[0][0].layer_lo, down[0][0].layer_hi
                err.print(f"[red]every station of layers {lo}:{hi} exited; stopping[/red]")
                return 1
    finally:
        mesh.close()
        err.print("stations stopped")
    return 0
