"""``amplituhedron bench-model``: the runtime against llama.cpp on the same GGUF."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import (
    add_kv_dtype,
    add_max_tokens,
    add_model,
    add_precision,
    add_threads,
)

HELP = "the runtime vs llama.cpp on the same GGUF"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    add_precision(p)
    add_kv_dtype(p)
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length")
    add_max_tokens(p, 32, "tokens decoded per run", old=("--decode-tokens",))
    p.add_argument("--runs", type=int, default=5, help="runs per figure")
    add_threads(p)
    p.add_argument(
        "--llamacpp-threads",
        type=int,
        default=2,
        metavar="N",
        help="llama.cpp's threads (this option was --threads, which now sets this runtime's)",
    )
    p.add_argument(
        "--long-stream",
        type=int,
        default=0,
        metavar="N",
        help="also score an N-token stream through a small ring vs full context (0: no)",
    )
    p.add_argument("--stream-slots", type=int, default=1024, help="that small ring's slots")
    p.add_argument("--json", metavar="PATH", help="write every raw timing as JSON")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import model

    return model.main(a)
