"""The ``amplituhedron`` command line: a thin dispatcher over one module per subcommand.

Subcommands: ``generate`` (one generation, single process or over a mesh), ``models`` (what
the runtime supports, which model files are installed), ``serve`` (the OpenAI-compatible
server), ``station serve`` (one station), ``mesh up`` (a local mesh of stations), ``bench``
(the falsifiability bench), ``bench-eviction`` (the eviction traces alone), ``bench-model``
(the runtime vs llama.cpp), ``bench-serve`` (streaming clients against the server),
``bench-spec`` (speculative decoding against plain), ``bench-mesh`` (what the mesh costs per
hop), ``bench-chaos`` (failover while stations are killed), ``synth`` (a synthetic checkpoint
of a real model's shape).

A ``--model synthetic:…`` argument of any subcommand is resolved to its file (written on
first use) before the subcommand runs, so stations, peers and benches all get a path.

Every subcommand module defines its arguments with light imports only and imports what it
runs inside ``run``, so ``amplituhedron generate`` never loads the mesh's HTTP stacks.
Nothing in the package imports the CLI.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from rich.markup import escape

from amplituhedron_rs._core import AmplituhedronError
from amplituhedron_rs.cli.common import err

#: Subcommand → the module that defines (``add_arguments``, ``HELP``) and runs (``run``) it.
COMMANDS = {
    "generate": "amplituhedron_rs.cli.generate",
    "models": "amplituhedron_rs.cli.models",
    "serve": "amplituhedron_rs.cli.serve",
    "station": "amplituhedron_rs.cli.station",
    "mesh": "amplituhedron_rs.cli.mesh",
    "bench": "amplituhedron_rs.cli.bench",
    "bench-eviction": "amplituhedron_rs.cli.bench_eviction",
    "bench-model": "amplituhedron_rs.cli.bench_model",
    "bench-serve": "amplituhedron_rs.cli.bench_serve",
    "bench-spec": "amplituhedron_rs.cli.bench_spec",
    "bench-mesh": "amplituhedron_rs.cli.bench_mesh",
    "bench-chaos": "amplituhedron_rs.cli.bench_chaos",
    "synth": "amplituhedron_rs.cli.synth",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amplituhedron",
        description="Prefix-cached, pipeline-parallel inference on GGUF models (SmolLM2, "
        "Gemma 3, any Llama / Qwen 2 / Gemma 3 file).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=getattr(module, "DESCRIPTION", None))
        module.add_arguments(p)
    return parser


def _resolve_synthetic(a: argparse.Namespace) -> None:
    """Replaces a ``synthetic:…`` ``--model`` by its file's path (writing it if needed)."""
    model = getattr(a, "model", None)
    if isinstance(model, str) and model.startswith("synthetic:"):
        from amplituhedron_rs.runtime.synthetic import resolve

        a.model = str(resolve(model))


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        _resolve_synthetic(a)
        code: int = importlib.import_module(COMMANDS[a.command]).run(a)
    except (AmplituhedronError, ValueError, OSError, RuntimeError) as exc:
        # Escaped: messages quote things like "pkg[extra]" that rich would read as markup.
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    return code
