"""The ``amplituhedron`` command line.

Subcommands: ``generate`` (one generation, single process or over a mesh), ``models`` (what
the runtime supports and which model files are installed), ``bench-model`` (runtime vs
llama.cpp), ``bench`` (the falsifiability bench), ``station serve`` (one station), ``mesh up``
(a local mesh of stations).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from amplituhedron_rs.model import Generation, Model

err = Console(stderr=True)
_MODEL_NAMES = "smollm2-135m, gemma3-270m"


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids takes comma-separated integers: {exc}"
        ) from exc
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
        description="Prefix-cached, pipeline-parallel inference on GGUF models (SmolLM2, "
        "Gemma 3, any Llama / Qwen 2 / Gemma 3 file).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (single process, or over a mesh)")
    _add_prompt(gen)
    _add_sampling(gen)
    gen.add_argument(
        "--model", metavar="GGUF", help=f"model file or name ({_MODEL_NAMES}; default SmolLM2)"
    )
    gen.add_argument("--no-cache", action="store_true", help="disable the volume cache")
    gen.add_argument(
        "--precision",
        choices=["refined", "fast"],
        default="refined",
        help="activations: two 8-bit passes (near-f32 logits) or one (llama.cpp)",
    )
    gen.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the same prompt N times (the 2nd+ replays the volume)",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object per run")
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--mesh", metavar="FILE_OR_URL", help="drive a running mesh")
    where.add_argument(
        "--stations", type=int, metavar="K", help="start a local mesh of K stations for this call"
    )
    gen.add_argument(
        "--token",
        default=os.environ.get("AMPLITUHEDRON_TOKEN"),
        help="bearer token of the stations (env AMPLITUHEDRON_TOKEN)",
    )

    station = sub.add_parser("station", help="run one station").add_subparsers(
        dest="station_command", required=True
    )
    serve = station.add_parser("serve", help="serve a layer range over HTTP")
    serve.add_argument("--layers", required=True, metavar="LO:HI", type=_layers)
    serve.add_argument("--port", type=int, default=8100)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--model", metavar="GGUF", help="model file (default: bundled SmolLM2)")
    serve.add_argument("--model-index", metavar="JSON", help=argparse.SUPPRESS)
    serve.add_argument(
        "--token",
        default=os.environ.get("AMPLITUHEDRON_TOKEN"),
        help="bearer token required on capture/clear/configure (env AMPLITUHEDRON_TOKEN)",
    )
    serve.add_argument("--max-sessions", type=int, default=8)
    serve.add_argument("--session-idle", type=float, default=300.0, metavar="SECONDS")
    serve.add_argument("--max-entries", type=int, default=4)
    serve.add_argument("--max-prefix-len", type=int, default=512)
    serve.add_argument(
        "--policy",
        choices=["pisot", "lru", "gdsf"],
        default=None,
        help="eviction policy (default: the cost-aware gdsf)",
    )
    serve.add_argument(
        "--min-prefix-reuse",
        type=int,
        default=16,
        metavar="N",
        help="replay the longest cached prefix of at least N tokens (0: exact prompts only)",
    )
    serve.add_argument("--no-cache", action="store_true", help="start with the cache disabled")
    serve.add_argument(
        "--precision",
        choices=["refined", "fast"],
        default="refined",
        help="activation precision (every station of a mesh must use the same)",
    )
    serve.add_argument(
        "--fault-injection",
        action="store_true",
        help="expose POST /debug/damage (tests and failure drills only)",
    )

    models = sub.add_parser(
        "models", help="supported architectures and tensor types, installed model files"
    )
    models.add_argument("--json", action="store_true", help="print JSON")

    from amplituhedron_rs import bench, bench_mesh, bench_model, bench_serve, bench_spec

    bm = sub.add_parser("bench-model", help="the runtime vs llama.cpp on the same GGUF")
    bench_model.add_arguments(bm)
    bserve = sub.add_parser(
        "bench-serve", help="streaming clients 1..16 against the server (and llama.cpp's)"
    )
    bench_serve.add_arguments(bserve)
    bspec = sub.add_parser(
        "bench-spec", help="speculative decoding (prompt lookup) against plain decoding"
    )
    bench_spec.add_arguments(bspec)
    bmesh = sub.add_parser("bench-mesh", help="per-hop overhead, cold vs warm over K stations")
    bench_mesh.add_arguments(bmesh)
    fals = sub.add_parser(
        "bench",
        help="the falsifiability bench: seed 001's P1–P5 and F1–F5, measured over a mesh",
        description="Measures seed 001's predictions P1–P5 and triggers F1–F5 on SmolLM2 over "
        "a local mesh (or --mesh): cache disabled vs enabled, unique prompts, Pisot-guard vs "
        "LRU eviction, the Lean oracle parity suite, and peers side by side.",
    )
    bench.add_arguments(fals)

    srv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server with continuous batching",
        description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health and "
        "/metrics. Requests are batched continuously and share the volume cache.",
    )
    srv.add_argument("--model", metavar="GGUF", help="model file (default: bundled SmolLM2)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--api-key",
        action="append",
        default=[k for k in [os.environ.get("AMPLITUHEDRON_API_KEY")] if k],
        metavar="KEY",
        help="accepted API key (repeatable; env AMPLITUHEDRON_API_KEY); none: open",
    )
    srv.add_argument("--max-batch", type=int, default=8, metavar="N", help="sequences per step")
    srv.add_argument("--max-queue", type=int, default=64, metavar="M", help="waiting requests")
    srv.add_argument(
        "--step-tokens",
        type=int,
        default=64,
        metavar="T",
        help="rows per step: decode rows first, then prompt chunks (bounds inter-token latency)",
    )
    srv.add_argument("--precision", choices=["refined", "fast"], default="refined")
    srv.add_argument(
        "--draft",
        choices=["prompt-lookup", "off"],
        default="off",
        help="speculative decoding for requests that do not choose (greedy output unchanged)",
    )
    srv.add_argument("--draft-max", type=int, default=8, metavar="K")

    mesh = sub.add_parser("mesh", help="local meshes").add_subparsers(
        dest="mesh_command", required=True
    )
    up = mesh.add_parser("up", help="start K stations on loopback until Ctrl-C")
    up.add_argument("--stations", type=int, default=3, metavar="K")
    up.add_argument("--port", type=int, default=8100, metavar="BASE")
    up.add_argument("--mesh-file", default="mesh.json", metavar="PATH")
    up.add_argument("--model", metavar="GGUF")
    up.add_argument("--token", default=os.environ.get("AMPLITUHEDRON_TOKEN"))
    return parser


def _cmd_models(a: argparse.Namespace) -> int:
    from rich.table import Table

    from amplituhedron_rs import _core
    from amplituhedron_rs.gguf_file import known_models

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
                }
                for m in known
            ],
        }
        print(json.dumps(report, indent=1))
        return 0
    out = Console()
    out.print(f"architectures: {', '.join(archs)}", highlight=False)
    out.print(f"tensor types:  {', '.join(types)}", highlight=False)
    table = Table("name (--model)", "wheel", "status")
    table.add_column("file", overflow="fold")
    for m in known:
        if m.version is None:
            status, where = "not installed", m.install_hint
        elif m.path is None:
            status, where = f"installed {m.version}", "assembled on first load"
        else:
            status, where = f"installed {m.version}", str(m.path)
        table.add_row(m.name, m.wheel, status, escape(where))
    out.print(table)
    return 0


def _layers(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--layers takes LO:HI, got {text!r}") from exc
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"--layers {text}: need 0 <= LO < HI")
    return lo, hi


def _cmd_station(a: argparse.Namespace) -> int:
    from amplituhedron_rs.station import StationSettings, serve

    lo, hi = a.layers
    settings = StationSettings(
        layer_lo=lo,
        layer_hi=hi,
        model_path=a.model,
        token=a.token,
        max_sessions=a.max_sessions,
        session_idle_s=a.session_idle,
        max_entries=a.max_entries,
        max_prefix_len=a.max_prefix_len,
        policy=a.policy,
        cache_enabled=not a.no_cache,
        fault_injection=a.fault_injection,
        precision=a.precision,
        min_prefix_reuse=a.min_prefix_reuse,
    )
    serve(settings, host=a.host, port=a.port, model_index=a.model_index)
    return 0


def _cmd_mesh_up(a: argparse.Namespace) -> int:
    import signal
    import threading

    from amplituhedron_rs.mesh import LocalMesh

    mesh = LocalMesh(a.stations, base_port=a.port, model_path=a.model, token=a.token)
    with err.status(f"starting {a.stations} stations…"):
        spec = mesh.start()
    spec.write(a.mesh_file)
    for s in spec.stations:
        err.print(f"  station {s.url}  layers {s.layer_lo}:{s.layer_hi}")
    err.print(f"mesh file: {a.mesh_file} — stop with Ctrl-C")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            dead = [p for p in mesh.processes if p.poll() is not None]
            if dead:
                err.print(f"[red]a station exited (code {dead[0].returncode}); stopping[/red]")
                return 1
    finally:
        mesh.close()
        err.print("stations stopped")
    return 0


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
    from amplituhedron_rs.model import CacheOptions, load_model

    if a.mesh or a.stations:
        from amplituhedron_rs.coordinator import cli_generate_over_mesh

        return cli_generate_over_mesh(a)
    with err.status("loading model…"):
        model = load_model(
            a.model, cache=CacheOptions(enabled=not a.no_cache), precision=a.precision
        )
    if a.prompt_ids is not None:
        ids = a.prompt_ids
    elif a.chat or a.system:
        ids = model.chat_ids(a.system, a.prompt)
    else:
        ids = model.tokenize(a.prompt)
    kwargs = _sampling_kwargs(a)
    for _ in range(max(1, a.repeat)):
        g = _generate_once(model, ids, a, kwargs)
        if a.json:
            print(json.dumps(g.to_json()))
        else:
            verdict = "hit (prefill skipped)" if g.cache_hit else "miss"
            err.print(
                f"[dim]{len(ids)} prompt tokens, {len(g.output_ids)} generated · "
                f"cache {verdict} · prefill {g.prefill_ms:.1f} ms · decode {g.decode_ms:.1f} ms"
                f" ({g.decode_ms / max(1, len(g.output_ids)):.1f} ms/token)[/dim]"
            )
    return 0


def _generate_once(
    model: Model, ids: list[int], a: argparse.Namespace, kwargs: dict[str, Any]
) -> Generation:
    """One generation with a prefill progress bar (long prompts) and streamed text."""
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
            a.max_new_tokens,
            use_cache=not a.no_cache,
            stream=stream,
            on_prefill=on_prefill,
            **kwargs,
        )
    finally:
        progress.stop()
    if not a.json:
        out.print()
    return g


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        if a.command == "generate":
            return _cmd_generate(a)
        if a.command == "models":
            return _cmd_models(a)
        if a.command == "station":
            return _cmd_station(a)
        if a.command == "mesh":
            return _cmd_mesh_up(a)
        if a.command == "serve":
            from amplituhedron_rs.serve import ServeOptions, serve

            serve(
                ServeOptions(
                    model_path=a.model,
                    host=a.host,
                    port=a.port,
                    api_keys=a.api_key,
                    max_batch=a.max_batch,
                    max_queue=a.max_queue,
                    step_tokens=a.step_tokens,
                    precision=a.precision,
                    draft=a.draft == "prompt-lookup",
                    draft_max=a.draft_max,
                )
            )
            return 0
        if a.command == "bench-model":
            from amplituhedron_rs import bench_model

            return bench_model.main(a)
        if a.command == "bench":
            from amplituhedron_rs import bench

            return bench.main(a)
        if a.command == "bench-serve":
            from amplituhedron_rs import bench_serve

            return bench_serve.main(a)
        if a.command == "bench-spec":
            from amplituhedron_rs import bench_spec

            return bench_spec.main(a)
        if a.command == "bench-mesh":
            from amplituhedron_rs import bench_mesh

            return bench_mesh.main(a)
    except (ValueError, OSError, RuntimeError) as exc:
        # Escaped: messages quote things like "pkg[extra]" that rich would read as markup.
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    parser.error(f"unknown command {a.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
