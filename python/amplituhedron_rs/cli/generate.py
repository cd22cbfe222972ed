"""``amplituhedron generate``: one prompt, in this process or over a mesh of stations."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from amplituhedron_rs.cli.common import (
    add_cache_dir,
    add_kv_dtype,
    add_model,
    add_model_limits,
    add_precision,
    add_prompt,
    add_sampling,
    add_threads,
    add_token,
    err,
    sampling,
    token_of,
)

if TYPE_CHECKING:
    from amplituhedron_rs import _core
    from amplituhedron_rs.runtime import Generation, Model, SamplingParams
    from amplituhedron_rs.runtime.gguf_file import ModelFile
    from amplituhedron_rs.runtime.structured import Constraint
    from amplituhedron_rs.runtime.tokenizer import Tokenizer

HELP = "generate text (single process, or over a mesh)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_prompt(p)
    add_sampling(p)
    add_model(p)
    p.add_argument("--no-cache", action="store_true", help="skip the volume cache for this run")
    add_cache_dir(p)
    add_precision(p)
    add_kv_dtype(p)
    add_threads(p)
    add_model_limits(p)
    p.add_argument(
        "--draft",
        choices=["prompt-lookup", "off"],
        default="off",
        help="speculative decoding by prompt lookup (greedy output unchanged, bit for bit)",
    )
    p.add_argument(
        "--draft-max", type=int, default=8, metavar="K", help="longest draft per verify step"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the same prompt N times (the 2nd+ replays the volume)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per run")
    constrain = p.add_mutually_exclusive_group()
    constrain.add_argument(
        "--json-schema", metavar="FILE", help="the output is JSON valid under this JSON Schema"
    )
    constrain.add_argument("--regex", metavar="PATTERN", help="the output matches this regex")
    constrain.add_argument(
        "--grammar", metavar="FILE", help="the output follows this Lark (or GBNF) grammar"
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--mesh", metavar="FILE_OR_URL", help="drive a running mesh")
    where.add_argument(
        "--stations", type=int, metavar="K", help="start a local mesh of K stations for this call"
    )
    add_token(p, "the mesh token (default: the mesh file's)")


def prompt_of(a: argparse.Namespace, tokenizer: Tokenizer, context: int) -> list[int]:
    """The prompt's ids (through the chat template with --chat or --system), checked against
    ``--max-model-len`` when given (within the model's ``context``)."""
    if a.max_model_len is not None and a.max_model_len > context:
        raise SystemExit(
            f"--max-model-len {a.max_model_len} is more than this model's context of {context}"
        )
    if a.prompt_ids is not None:
        ids: list[int] = a.prompt_ids
    elif a.chat or a.system:
        ids = tokenizer.chat_ids(a.system, a.prompt)
    else:
        ids = tokenizer.encode(a.prompt)
    if a.max_model_len is not None and len(ids) + a.max_tokens > a.max_model_len:
        raise SystemExit(
            f"the prompt ({len(ids)} tokens) and --max-tokens {a.max_tokens} need "
            f"{len(ids) + a.max_tokens} positions, more than --max-model-len {a.max_model_len}"
        )
    return ids


def prepare_tokenizer(a: argparse.Namespace, tokenizer: Tokenizer, model_file: ModelFile) -> None:
    """Applies ``--chat-template``, and says once why chat on a base checkpoint disappoints."""
    from amplituhedron_rs.runtime.gguf_file import chat_warning

    if a.chat_template is not None:
        try:
            with open(a.chat_template, encoding="utf-8") as f:
                tokenizer.set_chat_template(f.read())
        except OSError as exc:
            raise SystemExit(f"cannot read the chat template {a.chat_template}: {exc}") from exc
    elif a.chat or a.system:
        warning = chat_warning(model_file, a.model)
        if warning is not None:
            err.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)


def _context(model_file: ModelFile) -> int:
    return int(model_file.config["context_len"])


def constraint_of(a: argparse.Namespace) -> Constraint | None:
    """``--json-schema`` / ``--regex`` / ``--grammar``, read (the files) but not compiled."""
    from pathlib import Path

    from amplituhedron_rs.runtime import structured

    if a.json_schema:
        return structured.json_schema(Path(a.json_schema).read_text())
    if a.regex:
        return structured.regex(a.regex)
    if a.grammar:
        return structured.lark_or_gbnf(Path(a.grammar).read_text())
    return None


def run(a: argparse.Namespace) -> int:
    params = sampling(a)
    if a.mesh or a.stations:
        return _over_mesh(a, params)
    from dataclasses import replace

    from amplituhedron_rs.runtime import CacheOptions, SessionOptions, load_model

    session = SessionOptions()
    if a.max_model_len is not None and a.max_model_len > session.slots:
        session = replace(session, slots=a.max_model_len)  # rings as long as asked
    with err.status("loading model…"):
        model = load_model(
            a.model,
            session=session,
            cache=CacheOptions(
                enabled=not a.no_cache, cache_dir=a.cache_dir, max_disk_bytes=a.max_disk_bytes
            ),
            precision=a.precision,
            kv_dtype=a.kv_dtype,
        )
    prepare_tokenizer(a, model.tokenizer, model.file)
    ids = prompt_of(a, model.tokenizer, _context(model.file))
    constraint = constraint_of(a)
    grammar = None if constraint is None else constraint.compile(model.tokenizer)
    for _ in range(max(1, a.repeat)):
        g = _generate_once(model, ids, a, params, grammar)
        if a.json:
            print(json.dumps(g.to_json()))
        else:
            verdict = "hit (prefill skipped)" if g.cache_hit else "miss"
            err.print(
                f"[dim]{len(ids)} prompt tokens, {len(g.output_ids)} generated · "
                f"cache {verdict} · prefill {g.prefill_ms:.1f} ms · decode {g.decode_ms:.1f} ms"
                f" ({g.decode_ms / max(1, len(g.output_ids)):.1f} ms/token)"
                + (
                    f" · drafts {g.draft_accepted}/{g.draft_proposed} accepted"
                    f" in {g.verify_steps} verify steps"
                    if a.draft != "off"
                    else ""
                )
                + "[/dim]"
            )
    return 0


def _generate_once(
    model: Model,
    ids: list[int],
    a: argparse.Namespace,
    params: SamplingParams,
    grammar: _core.Grammar | None = None,
) -> Generation:
    """One generation with a prefill progress bar (long prompts) and streamed text."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

    out = Console()
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
            a.max_tokens,
            **params.draw_kwargs(),
            use_cache=not a.no_cache,
            draft=None if a.draft == "off" else a.draft,
            draft_max=a.draft_max,
            grammar=grammar,
            stream=stream,
            on_prefill=on_prefill,
        )
    finally:
        progress.stop()
    if not a.json:
        out.print()
    # The prompt's volume is written behind the capture: have it on disk before exiting.
    model.flush_cache()
    return g


def _over_mesh(a: argparse.Namespace, params: SamplingParams) -> int:
    """``--mesh FILE_OR_URL`` / ``--stations K``. ``--no-cache`` skips replay and capture
    for this run only; the stations' caches stay as they are for their other clients."""
    import asyncio

    from rich.console import Console

    from amplituhedron_rs.mesh.coordinator import Coordinator
    from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec
    from amplituhedron_rs.runtime.gguf_file import read_model_file
    from amplituhedron_rs.runtime.tokenizer import StreamDecoder, Tokenizer

    out = Console()
    with err.status("reading the tokenizer…"):
        model_file = read_model_file(a.model)
        tok = Tokenizer(model_file)
    prepare_tokenizer(a, tok, model_file)
    ids = prompt_of(a, tok, _context(model_file))
    constraint = constraint_of(a)
    grammar = None if constraint is None else constraint.compile(tok)
    local: LocalMesh | None = None
    try:
        if a.stations:
            with err.status(f"starting {a.stations} stations…"):
                disk = ["--cache-dir", a.cache_dir] if a.cache_dir else []
                local = LocalMesh(a.stations, model_path=a.model, station_args=disk)
                mesh = local.start()
        else:
            mesh = MeshSpec.load(a.mesh, token=token_of(a))

        async def generate_all() -> None:
            async with Coordinator(mesh) as c:
                for _ in range(max(1, a.repeat)):
                    decoder = StreamDecoder(tok)

                    def on_token(t: int, decoder: StreamDecoder = decoder) -> None:
                        if not a.json:
                            out.print(decoder.push(t), end="", markup=False, highlight=False)

                    g = await c.generate(
                        ids,
                        a.max_tokens,
                        **params.draw_kwargs(),
                        use_cache=not a.no_cache,
                        stop_ids=[tok.eos_id] if tok.eos_id is not None else [],
                        on_token=on_token,
                        draft=None if a.draft == "off" else a.draft,
                        draft_max=a.draft_max,
                        grammar=grammar,
                    )
                    if a.json:
                        d = g.to_json()
                        d["text"] = tok.decode(g.output_ids, skip_special=True)
                        print(json.dumps(d))
                        continue
                    out.print()
                    verdicts = " ".join(f"{v.layer_lo}:{v.layer_hi}={v.replay}" for v in g.stations)
                    err.print(
                        f"[dim]{len(g.stations)} stations · cache {verdicts} · "
                        f"replay {g.replay_ms:.1f} ms · prefill {g.prefill_ms:.1f} ms · "
                        f"decode {g.decode_ms:.1f} ms · latency {g.latency_ms:.1f} ms[/dim]"
                    )

        asyncio.run(generate_all())
    finally:
        if local is not None:
            local.close()
    return 0
