"""``amplituhedron bench-spec``: speculative decoding (prompt lookup) against plain decoding."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import add_kv_dtype, add_max_tokens, add_model, add_threads

HELP = "speculative decoding (prompt lookup) against plain decoding"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    add_max_tokens(p, 128, "tokens generated per prompt", old=("--max-new-tokens",))
    p.add_argument("--rounds", type=int, default=3, metavar="R", help="runs per prompt")
    p.add_argument(
        "--precision",
        default="refined,fast",
        metavar="LIST",
        help="precisions to measure",
    )
    p.add_argument("--draft-max", type=int, default=8, metavar="K", help="longest draft")
    add_kv_dtype(p)
    p.add_argument(
        "--stations",
        type=int,
        default=0,
        metavar="K",
        help="also run over a local mesh of K stations (0: single process only)",
    )
    add_threads(p)
    p.add_argument(
        "--llamacpp-threads",
        type=int,
        default=2,
        metavar="N",
        help="llama.cpp peer threads, when llama-cpp-python is installed (this option was "
        "--threads, which now sets this runtime's)",
    )
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import spec

    return spec.main(a)
