"""``amplituhedron serve``: the OpenAI-compatible server with continuous batching."""

from __future__ import annotations

import argparse
import os

from amplituhedron_rs.cli.common import (
    add_cache_dir,
    add_cache_options,
    add_kv_dtype,
    add_model,
    add_model_limits,
    add_precision,
    add_threads,
    add_token,
    err,
    model_of,
    renamed,
    token_of,
)
from amplituhedron_rs.serve.options import ServeOptions

HELP = "an OpenAI-compatible server with continuous batching"
DESCRIPTION = (
    "Serves /v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, "
    "/health and /metrics (docs/serving.md). Requests are batched continuously and share "
    "the volume cache."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ServeOptions()
    add_model(p, positional=True)
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id clients send and /v1/models lists (default: the model's known "
        "name, e.g. smollm2-135m, or the GGUF file's stem)",
    )
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on")
    p.add_argument(
        "--api-key",
        action="append",
        default=[k for k in [os.environ.get("AMPLITUHEDRON_API_KEY")] if k],
        metavar="KEY",
        help="accepted API key (repeatable; env AMPLITUHEDRON_API_KEY; default: none, the "
        "server is open)",
    )
    p.add_argument(
        "--shared-cache-keys",
        action="store_true",
        help="let all API keys share one cache partition (off: each key is its own; sharing "
        "lets one key learn another's cached prompts through cached_tokens and latency)",
    )
    p.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="parse special tokens written in message content as control tokens (off: they "
        "are text, so a message cannot forge a system or assistant turn)",
    )
    p.add_argument(
        "--open-metrics",
        action="store_true",
        help="serve /metrics without an API key (for a scraper); off: it needs a key",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        metavar="N",
        help=f"largest request body, counted as it streams (default {d.max_body_bytes})",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        metavar="N",
        help="open connections; past it idle ones are closed first, then new ones get 503 "
        f"(default {d.max_connections})",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout_s,
        metavar="SECONDS",
        help="close a connection that has not sent a complete request head within this "
        f"(default {d.header_timeout_s:g})",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_s,
        metavar="SECONDS",
        help=f"close a connection whose body takes longer (default {d.body_timeout_s:g})",
    )
    p.add_argument(
        "--max-batch", type=int, default=d.max_batch, metavar="N", help="sequences per step"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        metavar="M",
        help="requests waiting for a place; past it, 429",
    )
    p.add_argument(
        "--step-tokens",
        type=int,
        default=d.step_tokens,
        metavar="T",
        help="rows per step: decode rows first, then prompt chunks (bounds inter-token latency)",
    )
    add_precision(p)
    add_kv_dtype(p)
    add_threads(p)
    add_model_limits(p)
    p.add_argument(
        "--draft",
        choices=["prompt-lookup", "off"],
        default="off",
        help="speculative decoding for requests that do not choose (greedy output unchanged)",
    )
    p.add_argument(
        "--draft-max", type=int, default=d.draft_max, metavar="K", help="longest draft per step"
    )
    add_cache_options(p, no_cache="serve without the volume cache (every prompt is prefilled)")
    add_cache_dir(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--mesh",
        metavar="FILE_OR_URLS",
        help="serve through a mesh: a mesh file, or comma-separated station URLs (the model "
        "file then only gives the tokenizer)",
    )
    where.add_argument(
        "--stations",
        type=int,
        metavar="K",
        help="serve through a local mesh of K station processes started with the server",
    )
    add_token(
        p,
        "the stations' bearer token (default: the mesh file's; with --stations: generated)",
    )
    renamed(p, "--mesh-token", "--token", "token", metavar="TOKEN")


#: Options that configure this process's cache or the stations it starts.
_CACHE = ("max_prefix_len", "max_entries", "policy", "min_prefix_reuse")


def run(a: argparse.Namespace) -> int:
    from amplituhedron_rs.serve import serve

    d = ServeOptions()
    changed = [k for k in _CACHE if getattr(a, k) != getattr(d, k)]
    if a.mesh and (changed or a.no_cache or a.cache_dir or a.max_disk_bytes):
        err.print(
            "--no-cache, --max-entries, --max-prefix-len, --policy, --min-prefix-reuse, "
            "--cache-dir and --max-disk-bytes configure this process's cache or the stations "
            "it starts (--stations); a mesh's own stations take them as `amplituhedron "
            "station serve` options"
        )
        return 2
    serve(
        ServeOptions(
            model_path=model_of(a),
            served_model_name=a.served_model_name,
            host=a.host,
            port=a.port,
            api_keys=a.api_key,
            max_batch=a.max_batch,
            max_queue=a.max_queue,
            step_tokens=a.step_tokens,
            precision=a.precision,
            kv_dtype=a.kv_dtype,
            draft=a.draft == "prompt-lookup",
            draft_max=a.draft_max,
            max_prefix_len=a.max_prefix_len,
            cache=not a.no_cache,
            max_entries=a.max_entries,
            policy=a.policy,
            min_prefix_reuse=a.min_prefix_reuse,
            cache_dir=a.cache_dir,
            max_disk_bytes=a.max_disk_bytes,
            mesh=a.mesh,
            stations=a.stations,
            mesh_token=token_of(a),
            max_model_len=a.max_model_len,
            chat_template=a.chat_template,
            shared_cache_keys=a.shared_cache_keys,
            allow_special_tokens_in_content=a.allow_special_tokens_in_content,
            open_metrics=a.open_metrics,
            max_body_bytes=a.max_body_bytes,
            max_connections=a.max_connections,
            header_timeout_s=a.header_timeout,
            body_timeout_s=a.body_timeout,
        )
    )
    return 0
