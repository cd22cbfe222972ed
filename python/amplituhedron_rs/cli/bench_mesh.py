"""``amplituhedron bench-mesh``: per-hop overhead, cold vs warm over K stations."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import add_max_tokens, add_model, add_threads, int_list, renamed

HELP = "per-hop overhead, cold vs warm over K stations"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument(
        "--station-counts",
        type=int_list,
        default=[1, 2, 3, 5],
        metavar="LIST",
        help="mesh sizes to sweep, e.g. 1,2,3,5 (default: 1,2,3,5)",
    )
    # The sweep was --stations K [K ...]; --stations is a count everywhere else.
    renamed(p, "--stations", "--station-counts", "station_counts", type=int, nargs="+")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length")
    add_max_tokens(p, 32, "tokens decoded per run", old=("--new-tokens",))
    p.add_argument("--repeats", type=int, default=5, help="runs per mesh size")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk rows per request")
    add_threads(p)
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import mesh

    return mesh.main(a)
