"""``amplituhedron bench-model``: the runtime against llama.cpp on the same GGUF."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import add_kv_dtype, add_model

HELP = "the runtime vs llama.cpp on the same GGUF"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument("--precision", choices=["refined", "fast"], default="refined")
    add_kv_dtype(p)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument(
        "--long-stream",
        type=int,
        default=0,
        metavar="N",
        help="also score an N-token stream through a small ring vs full context",
    )
    p.add_argument("--stream-slots", type=int, default=1024)
    p.add_argument("--json", metavar="PATH", help="write every raw timing as JSON")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import model

    return model.main(a)
