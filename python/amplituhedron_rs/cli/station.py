"""``amplituhedron station serve``: one station (a layer range) over HTTP."""

from __future__ import annotations

import argparse

from amplituhedron_rs._core import DEFAULTS
from amplituhedron_rs.cli.common import add_cache_dir, add_model, add_token, layer_range

HELP = "run one station"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="station_command", required=True)
    serve = sub.add_parser("serve", help="serve a layer range over HTTP")
    serve.add_argument("--layers", required=True, metavar="LO:HI", type=layer_range)
    serve.add_argument("--port", type=int, default=8100)
    serve.add_argument("--host", default="127.0.0.1")
    add_model(serve)
    serve.add_argument("--model-index", metavar="JSON", help=argparse.SUPPRESS)
    add_token(serve, "bearer token required on capture/clear/configure")
    serve.add_argument("--max-sessions", type=int, default=8)
    serve.add_argument("--session-idle", type=float, default=300.0, metavar="SECONDS")
    serve.add_argument(
        "--max-entries",
        type=int,
        default=DEFAULTS.max_entries,
        help=f"volumes the cache holds (default {DEFAULTS.max_entries})",
    )
    serve.add_argument(
        "--max-prefix-len",
        type=int,
        default=DEFAULTS.max_prefix_len,
        help=f"longest prefix captured, in tokens (default {DEFAULTS.max_prefix_len})",
    )
    serve.add_argument(
        "--policy",
        choices=["pisot", "lru", "gdsf"],
        default=DEFAULTS.policy,
        help=f"eviction policy (default {DEFAULTS.policy})",
    )
    serve.add_argument(
        "--min-prefix-reuse",
        type=int,
        default=DEFAULTS.min_prefix_reuse,
        metavar="N",
        help="replay the longest cached prefix of at least N tokens (0: exact prompts only; "
        f"default {DEFAULTS.min_prefix_reuse})",
    )
    serve.add_argument("--no-cache", action="store_true", help="start with the cache disabled")
    add_cache_dir(serve)
    serve.add_argument(
        "--precision",
        choices=["refined", "fast"],
        default="refined",
        help="activation precision (every station of a mesh must use the same)",
    )
    serve.add_argument(
        "--fault-injection",
        action="store_true",
        help="expose POST /debug/damage (tests and failure drills only)",
    )


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.mesh.station import StationSettings, serve
    from amplituhedron_rs.runtime import CacheOptions

    lo, hi = a.layers
    settings = StationSettings(
        layer_lo=lo,
        layer_hi=hi,
        model_path=a.model,
        model_index=a.model_index,
        token=a.token,
        max_sessions=a.max_sessions,
        session_idle_s=a.session_idle,
        cache=CacheOptions(
            enabled=not a.no_cache,
            max_entries=a.max_entries,
            max_prefix_len=a.max_prefix_len,
            policy=a.policy,
            min_prefix_reuse=a.min_prefix_reuse,
            cache_dir=a.cache_dir,
            max_disk_bytes=a.max_disk_bytes,
        ),
        fault_injection=a.fault_injection,
        precision=a.precision,
    )
    serve(settings, host=a.host, port=a.port)
    return 0
