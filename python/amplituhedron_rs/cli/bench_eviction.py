"""``amplituhedron bench-eviction``: the eviction traces alone (no mesh phases)."""

from __future__ import annotations

import argparse

from amplituhedron_rs.cli.common import add_threads

HELP = "every eviction policy on every trace, on the bundled model (no mesh phases)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write every run")
    add_threads(p)


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.bench import eviction

    eviction.run(a.json)
    return 0
