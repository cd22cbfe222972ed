"""The ``amplituhedron`` command line: a thin dispatcher over one module per subcommand.

Subcommands: ``generate`` (one generation, single process or over a mesh), ``models`` (what
the runtime supports, which model files are installed), ``serve`` (the OpenAI-compatible
server), ``station serve`` (one station), ``mesh up`` (a local mesh of stations), ``bench``
(the falsifiability bench), ``bench-eviction`` (the eviction traces alone), ``bench-model``
(the runtime vs llama.cpp), ``bench-serve`` (streaming clients against the server),
``bench-spec`` (speculative decoding against plain), ``bench-rows`` (decode against the
memory floor, the cost of n rows per step), ``bench-mesh`` (what the mesh costs per
hop), ``bench-chaos`` (failover while stations are killed), ``bench-edge`` (the server under
hostile traffic), ``synth`` (a synthetic checkpoint of a real model's shape).

A ``synthetic:…`` model argument of any subcommand is checked with the others, then resolved
to its file (written on first use) before the subcommand runs, so stations, peers and
benches all get a path.

Every subcommand module defines its arguments with light imports only and imports what it
runs inside ``run``, so ``amplituhedron generate`` never loads the mesh's HTTP stacks.
Nothing in the package imports the CLI.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Sequence
from typing import Any

from rich.markup import escape

from amplituhedron_rs._core import AmplituhedronError, __version__
from amplituhedron_rs.cli.common import Formatter, err

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
    "bench-rows": "amplituhedron_rs.cli.bench_rows",
    "bench-mesh": "amplituhedron_rs.cli.bench_mesh",
    "bench-chaos": "amplituhedron_rs.cli.bench_chaos",
    "bench-edge": "amplituhedron_rs.cli.bench_edge",
    "synth": "amplituhedron_rs.cli.synth",
}


class Parser(argparse.ArgumentParser):
    """Every (sub)command's parser: defaults shown in help, and the parser remembered in
    the namespace, so an unknown flag is reported with its subcommand's usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)
        self.set_defaults(_parser=self)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="amplituhedron",
        description="Prefix-cached, pipeline-parallel inference on GGUF models (SmolLM2, "
        "Gemma 3, any Llama / Qwen 2 / Gemma 3 file).",
    )
    parser.add_argument("--version", action="version", version=f"amplituhedron {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=getattr(module, "DESCRIPTION", None))
        module.add_arguments(p)
    return parser


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked: an unknown flag is an error with its subcommand's usage,
    an unknown model name lists the known ones."""
    a, unknown = build_parser().parse_known_args(argv)
    if unknown:
        a._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    for attr in ("model", "model_arg"):
        _check_model(a, getattr(a, attr, None))
    return a


def _check_model(a: argparse.Namespace, model: str | None) -> None:
    if model is None or os.path.isfile(model):
        return
    if model.startswith("synthetic:"):
        from amplituhedron_rs.runtime.synthetic import SyntheticError, parse_spec

        try:
            parse_spec(model)
        except SyntheticError as exc:
            a._parser.error(str(exc))
        return
    from amplituhedron_rs.cli.common import MODEL_NAMES
    from amplituhedron_rs.runtime.gguf_file import KNOWN_MODELS

    if model not in KNOWN_MODELS:
        a._parser.error(
            f"unknown model {model!r}: give a GGUF file or a known name "
            f"({MODEL_NAMES}; `amplituhedron models` lists them)"
        )


def _resolve_synthetic(a: argparse.Namespace) -> None:
    """Replaces a ``synthetic:…`` model argument by its file's path (writing it if needed)."""
    for attr in ("model", "model_arg"):
        model = getattr(a, attr, None)
        if isinstance(model, str) and model.startswith("synthetic:"):
            from amplituhedron_rs.runtime.synthetic import resolve

            setattr(a, attr, str(resolve(model)))


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    if getattr(a, "threads", None):
        # Read by the core when its pool starts (the first forward pass), and inherited by
        # every station process started from here.
        os.environ["AMPLITUHEDRON_THREADS"] = str(a.threads)
    try:
        _resolve_synthetic(a)
        code: int = importlib.import_module(COMMANDS[a.command]).run(a)
    except (AmplituhedronError, ValueError, OSError, RuntimeError) as exc:
        # Escaped: messages quote things like "pkg[extra]" that rich would read as markup.
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    return code
