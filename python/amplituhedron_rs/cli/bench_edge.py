"""``amplituhedron bench-edge``: /health latency and RSS while the server is attacked."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import add_model, positive

HELP = "/health latency and RSS while the server takes hostile traffic"
DESCRIPTION = (
    "Starts the OpenAI server and probes /health every 10 ms while it receives a huge prompt "
    "with a valid key, then several huge bodies without a key; reports latency against the "
    "idle baseline of the same run, and the server's RSS."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument(
        "--prompt-mb", type=positive, default=10, help="size of the huge prompt (default: 10)"
    )
    p.add_argument(
        "--bodies", type=positive, default=4, help="unauthenticated uploads at once (default: 4)"
    )
    p.add_argument(
        "--body-mb", type=positive, default=100, help="size of each upload (default: 100)"
    )
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import edge

    return edge.main(a)
