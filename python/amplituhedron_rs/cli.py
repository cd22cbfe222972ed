"""The ``amplituhedron`` command line.

Subcommands: ``generate`` (one generation, single process or over a mesh), ``bench-model``
(runtime vs llama.cpp), ``bench`` (the falsifiability bench), ``station serve`` (one station),
``mesh up`` (a local mesh of stations).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console

err = Console(stderr=True)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers: {exc}")
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (greedy unless a temperature/top-k/top-p is given)")
    g.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    g.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    g.add_argument("--temperature", type=float, default=None, metavar="T")
    g.add_argument("--top-k", type=int, default=0, metavar="K")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P")
    g.add_argument("--seed", type=int, default=0, metavar="S")


def _add_prompt(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text")
    src.add_argument("--prompt-ids", type=_ids, metavar="1,2,3", help="prompt token ids")
    p.add_argument("--system", metavar="TEXT", help="system prompt (implies --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amplituhedron",
        description="Prefix-cached, pipeline-parallel inference on SmolLM2-135M-Instruct.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (single process, or over a mesh)")
    _add_prompt(gen)
    _add_sampling(gen)
    gen.add_argument("--model", metavar="GGUF", help="model file (default: bundled SmolLM2)")
    gen.add_argument("--no-cache", action="store_true", help="disable the volume cache")
    gen.add_argument("--repeat", type=int, default=1, metavar="N",
                     help="run the same prompt N times (the 2nd+ replays the volume)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per run")
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--mesh", metavar="FILE_OR_URL", help="drive a running mesh")
    where.add_argument("--stations", type=int, metavar="K",
                       help="start a local mesh of K stations for this call")
    return parser


def _sampling_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    sampled = a.temperature is not None or a.top_k or a.top_p != 1.0
    if a.greedy and sampled:
        raise SystemExit("--greedy cannot be combined with --temperature/--top-k/--top-p")
    return {
        "greedy": not sampled,
        "temperature": 1.0 if a.temperature is None else a.temperature,
        "top_k": a.top_k,
        "top_p": a.top_p,
        "seed": a.seed,
    }


def _cmd_generate(a: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

    from amplituhedron_rs.model import CacheOptions, load_model

    if a.mesh or a.stations:
        from amplituhedron_rs.coordinator import cli_generate_over_mesh

        return cli_generate_over_mesh(a)
    with err.status("loading model…"):
        model = load_model(a.model, cache=CacheOptions(enabled=not a.no_cache))
    if a.prompt_ids is not None:
        ids = a.prompt_ids
    elif a.chat or a.system:
        ids = model.chat_ids(a.system, a.prompt)
    else:
        ids = model.tokenize(a.prompt)
    kwargs = _sampling_kwargs(a)
    out = Console()
    for _ in range(max(1, a.repeat)):
        progress = Progress(
            TextColumn("prefill"), BarColumn(), TaskProgressColumn(), console=err, transient=True
        )
        task = progress.add_task("prefill", total=len(ids))

        def on_prefill(done: int, total: int) -> None:
            # Only worth a bar when the prompt spans several chunks.
            if total > model.session_options.max_chunk and not progress.live.is_started:
                progress.start()
            progress.update(task, completed=done, total=total)

        def stream(piece: str) -> None:
            if not a.json:
                out.print(piece, end="", markup=False, highlight=False, soft_wrap=True)

        try:
            g = model.generate(
                ids,
                a.max_new_tokens,
                use_cache=not a.no_cache,
                stream=stream,
                on_prefill=on_prefill,
                **kwargs,
            )
        finally:
            progress.stop()
        if a.json:
            print(json.dumps(g.to_json()))
        else:
            out.print()
            verdict = "hit (prefill skipped)" if g.cache_hit else "miss"
            err.print(
                f"[dim]{len(ids)} prompt tokens, {len(g.output_ids)} generated · "
                f"cache {verdict} · prefill {g.prefill_ms:.1f} ms · decode {g.decode_ms:.1f} ms"
                f" ({g.decode_ms / max(1, len(g.output_ids)):.1f} ms/token)[/dim]"
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        if a.command == "generate":
            return _cmd_generate(a)
    except (ValueError, OSError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    parser.error(f"unknown command {a.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
