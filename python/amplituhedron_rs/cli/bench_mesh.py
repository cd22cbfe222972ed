"""``amplituhedron bench-mesh``: per-hop overhead, cold vs warm over K stations."""

from __future__ import annotations

import argparse

HELP = "per-hop overhead, cold vs warm over K stations"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="GGUF")
    p.add_argument("--stations", type=int, nargs="+", default=[1, 2, 3, 5], metavar="K")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk rows per request")
    p.add_argument("--json", metavar="PATH")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import mesh

    return mesh.main(a)
