"""``amplituhedron bench-serve``: streaming clients against the server (and llama.cpp's)."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import add_kv_dtype, add_model, add_precision, add_threads

HELP = "streaming clients 1..16 against the server (and llama.cpp's)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument(
        "--concurrency",
        default="1,2,4,8,16",
        metavar="LIST",
        help="client counts to sweep",
    )
    p.add_argument("--requests", type=int, default=2, metavar="R", help="requests per client")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="repeat the sweep N times, systems and levels interleaved; report medians",
    )
    p.add_argument(
        "--max-tokens", type=int, default=64, metavar="N", help="tokens per request at most"
    )
    p.add_argument(
        "--system-tokens", type=int, default=200, metavar="N", help="shared system prompt length"
    )
    add_precision(p)
    add_kv_dtype(p)
    add_threads(p)
    p.add_argument(
        "--max-batch", type=int, default=16, metavar="N", help="our server's --max-batch"
    )
    p.add_argument(
        "--step-tokens", type=int, default=64, metavar="T", help="our server's --step-tokens"
    )
    p.add_argument(
        "--stations",
        type=int,
        default=0,
        metavar="K",
        help="also serve through a local mesh of K stations, side by side (0: no mesh)",
    )
    p.add_argument(
        "--structured",
        action="store_true",
        help="also run our server under a JSON-schema response_format (masking's cost)",
    )
    p.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary")
    p.add_argument("--llama-parallel", type=int, default=8, metavar="NP", help="its -np")
    p.add_argument(
        "--no-llama-cpp-python", action="store_true", help="skip python -m llama_cpp.server"
    )
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--plot", metavar="PNG", help="throughput against concurrency")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import serve

    return serve.main(a)
