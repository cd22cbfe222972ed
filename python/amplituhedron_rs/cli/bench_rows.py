"""``amplituhedron bench-rows``: a decode step against the memory floor, and the row-cost
curve (what a step of n decoding sequences costs against one)."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import add_model, add_threads, positive, rate

HELP = (
    "decode against the memory-bandwidth floor, the cost of n rows per step and of a "
    "speculative verify step of k drafts"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument(
        "--rows", default="1,2,4,8,16", metavar="LIST", help="decoding sequences per step"
    )
    p.add_argument(
        "--drafts",
        default="1,2,3,4,5,6,7,8",
        metavar="LIST",
        help="drafted tokens per verify step to measure (empty: none)",
    )
    p.add_argument(
        "--acceptance",
        type=rate,
        default=None,
        metavar="A",
        help="draft acceptance rate the verify speed-ups assume (default: SmolLM2-135M's "
        "measured one with prompt-lookup drafts)",
    )
    p.add_argument("--steps", type=positive, default=5, metavar="N", help="timed steps each")
    p.add_argument(
        "--precision", default="refined,fast", metavar="LIST", help="precisions to measure"
    )
    add_threads(p)
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import rows

    if a.acceptance is None:
        a.acceptance = rows.SMOLLM2_ACCEPTANCE
    return rows.main(a)
