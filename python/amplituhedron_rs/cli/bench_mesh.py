"""``amplituhedron bench-mesh``: per-hop overhead and where it goes, decode and pipelined
prefill over K stations against one process."""

from __future__ import annotations

import argparse

HELP = "per-hop overhead and where it goes; decode and prefill over K stations vs one process"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="GGUF")
    p.add_argument("--stations", type=int, nargs="+", default=[1, 4, 28], metavar="K")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
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
        type=int,
        metavar="N",
        help="compute threads per station (default: the host's cores shared among them)",
    )
    p.add_argument("--json", metavar="PATH")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import mesh

    return mesh.main(a)
