"""``amplituhedron bench-chaos``: sessions over a replicated mesh while stations are killed."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import add_max_tokens, add_model, add_threads

HELP = "failover under random station kills: completed sessions, wrong tokens, time added"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument("--sessions", type=int, default=200, help="sessions to run")
    p.add_argument("--stations", type=int, default=2, metavar="K", help="layer ranges")
    p.add_argument("--replicas", type=int, default=2, metavar="N", help="stations per range")
    p.add_argument(
        "--every",
        type=float,
        nargs=2,
        default=[2.0, 4.0],
        metavar=("MIN", "MAX"),
        help="seconds between two kills, drawn uniformly (default 2 4)",
    )
    add_max_tokens(p, 24, "tokens per session", old=("--new-tokens",))
    p.add_argument("--concurrency", type=int, default=8, help="sessions in flight")
    p.add_argument("--seed", type=int, default=0, help="seeds the kills and the sessions")
    add_threads(p)
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import chaos

    return chaos.main(a)
