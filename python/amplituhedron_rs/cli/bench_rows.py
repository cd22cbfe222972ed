"""``amplituhedron bench-rows``: a decode step against the memory floor, and the row-cost
curve (what a step of n decoding sequences costs against one)."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import add_model, add_threads, positive

HELP = "decode against the memory-bandwidth floor, and the cost of n rows per step"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument(
        "--rows", default="1,2,4,8,16", metavar="LIST", help="decoding sequences per step"
    )
    p.add_argument("--steps", type=positive, default=5, metavar="N", help="timed steps each")
    p.add_argument(
        "--precision", default="refined,fast", metavar="LIST", help="precisions to measure"
    )
    p.add_argument(
        "--probe-threads",
        type=positive,
        default=2,
        metavar="N",
        help="threads of the read-bandwidth probe",
    )
    add_threads(p)
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import rows

    return rows.main(a)
