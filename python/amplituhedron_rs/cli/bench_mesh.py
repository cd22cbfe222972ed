"""``amplituhedron bench-mesh``: per-hop overhead and where it goes, decode and pipelined
prefill over K stations against one process."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import (
    add_max_tokens,
    add_model,
    add_threads,
    int_list,
    positive,
    renamed,
)

HELP = "per-hop overhead and where it goes; decode and prefill over K stations vs one process"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument(
        "--station-counts",
        type=int_list,
        default=[1, 4, 28],
        metavar="LIST",
        help="mesh sizes to sweep, e.g. 1,4,28 (default: 1,4,28)",
    )
    # The sweep was --stations K [K ...]; --stations is a count everywhere else.
    renamed(p, "--stations", "--station-counts", "station_counts", type=int, nargs="+")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length")
    add_max_tokens(p, 32, "tokens decoded per run", old=("--new-tokens",))
    p.add_argument("--repeats", type=int, default=3, help="runs per mesh size")
    p.add_argument("--chunk", type=int, default=64, help="prefill rows per request to a station")
    p.add_argument(
        "--transport",
        nargs="+",
        choices=["stream", "http"],
        default=["stream"],
        help="how steps reach the stations (both: side by side; default: the step stream)",
    )
    p.add_argument(
        "--station-threads",
        type=positive,
        metavar="N",
        help="compute threads per station (default: the host's cores shared among them)",
    )
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="measure memory only: each mesh after a short run (RSS, baseline, weights "
        "resident, rings per station and summed, against the file) and one process's",
    )
    add_threads(p)
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")


def run(a: argparse.Namespace) -> int:
    if a.memory_only:
        from amplituhedron_rs.bench import memory

        return memory.main(a)
    from amplituhedron_rs.bench import mesh

    return mesh.main(a)
