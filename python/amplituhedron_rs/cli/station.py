"""``amplituhedron station serve``: one station (a layer range) over HTTP."""

from __future__ import annotations

import argparse
import os

from amplituhedron_rs.cli.common import (
    TOKEN_ENV,
    add_cache_dir,
    add_cache_options,
    add_kv_dtype,
    add_model,
    add_precision,
    add_threads,
    add_token,
    layer_range,
    token_of,
)
from amplituhedron_rs.edge.limits import EdgeLimits

HELP = "run one station"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="station_command", required=True)
    serve = sub.add_parser("serve", help="serve a layer range over HTTP")
    serve.add_argument(
        "--layers", required=True, metavar="LO:HI", type=layer_range, help="the layers served"
    )
    serve.add_argument("--port", type=int, default=8100, help="port to listen on")
    stream = serve.add_mutually_exclusive_group()
    stream.add_argument(
        "--stream-port",
        type=int,
        default=0,
        metavar="PORT",
        help="the step stream's TCP port on the same host (default 0: any free port, "
        "announced in /healthz)",
    )
    stream.add_argument(
        "--no-stream",
        action="store_true",
        help="serve batched steps over HTTP only (slower hops)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    add_model(serve)
    serve.add_argument("--model-index", metavar="JSON", help=argparse.SUPPRESS)
    add_token(
        serve,
        "the mesh token every endpoint but /healthz requires",
        insecure="serve without a token: anyone who can connect may use the station "
        "(loopback hosts only)",
    )
    serve.add_argument(
        "--open-metrics", action="store_true", help="serve /metrics without the token"
    )
    serve.add_argument(
        "--max-sessions", type=int, default=8, help="sessions (sequences) held at once"
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=EdgeLimits.max_connections,
        metavar="N",
        help="open connections; past it idle ones are closed first, then 503 "
        f"(default {EdgeLimits.max_connections})",
    )
    serve.add_argument(
        "--session-idle",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="close a session unused this long (a vanished client's)",
    )
    serve.add_argument(
        "--memory-budget",
        type=int,
        metavar="MB",
        help="KV rings the station may hold; past it, opens get 503 (default: a quarter of RAM)",
    )
    add_cache_options(serve, no_cache="start with the cache disabled")
    add_cache_dir(serve)
    add_precision(serve, "activation precision (every station of a mesh must use the same)")
    add_kv_dtype(serve)
    add_threads(serve)
    serve.add_argument(
        "--fault-injection",
        action="store_true",
        help="expose POST /debug/damage (tests and failure drills only)",
    )


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.mesh.launcher import KEEP_AWAKE_ENV
    from amplituhedron_rs.mesh.station import StationSettings, serve
    from amplituhedron_rs.mesh.station.app import is_loopback
    from amplituhedron_rs.runtime import CacheOptions

    # A station shares the host's cores with its coordinator (and often other stations):
    # its pool's idle workers sleep (set before the first pass reads it).
    os.environ.setdefault(KEEP_AWAKE_ENV, "0")
    token = token_of(a)
    if a.insecure:
        token = None
        if not is_loopback(a.host):
            raise SystemExit(f"--insecure serves only loopback hosts, not {a.host}")
    elif not token:
        raise SystemExit(
            "a station needs the mesh token: --token, --token-file or "
            f"{TOKEN_ENV} (or --insecure, on loopback only)"
        )
    lo, hi = a.layers
    settings = StationSettings(
        layer_lo=lo,
        layer_hi=hi,
        model_path=a.model,
        model_index=a.model_index,
        token=token,
        open_metrics=a.open_metrics,
        max_sessions=a.max_sessions,
        max_connections=a.max_connections,
        session_idle_s=a.session_idle,
        memory_budget=None if a.memory_budget is None else a.memory_budget * 1024 * 1024,
        cache=CacheOptions(
            enabled=not a.no_cache,
            max_entries=a.max_entries,
            max_prefix_len=a.max_prefix_len,
            policy=a.policy,
            min_prefix_reuse=a.min_prefix_reuse,
            cache_dir=a.cache_dir,
            max_disk_bytes=a.max_disk_bytes,
        ),
        stream_port=None if a.no_stream else a.stream_port,
        fault_injection=a.fault_injection,
        precision=a.precision,
        kv_dtype=a.kv_dtype,
    )
    serve(settings, host=a.host, port=a.port)
    return 0
