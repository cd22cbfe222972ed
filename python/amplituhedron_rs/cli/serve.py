"""``amplituhedron serve``: the OpenAI-compatible server with continuous batching."""

from __future__ import annotations

import argparse
import os

from amplituhedron_rs.cli.common import add_model

HELP = "an OpenAI-compatible server with continuous batching"
DESCRIPTION = (
    "Serves /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics. "
    "Requests are batched continuously and share the volume cache."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="append",
        default=[k for k in [os.environ.get("AMPLITUHEDRON_API_KEY")] if k],
        metavar="KEY",
        help="accepted API key (repeatable; env AMPLITUHEDRON_API_KEY); none: open",
    )
    p.add_argument("--max-batch", type=int, default=8, metavar="N", help="sequences per step")
    p.add_argument("--max-queue", type=int, default=64, metavar="M", help="waiting requests")
    p.add_argument(
        "--step-tokens",
        type=int,
        default=64,
        metavar="T",
        help="rows per step: decode rows first, then prompt chunks (bounds inter-token latency)",
    )
    p.add_argument("--precision", choices=["refined", "fast"], default="refined")
    p.add_argument(
        "--draft",
        choices=["prompt-lookup", "off"],
        default="off",
        help="speculative decoding for requests that do not choose (greedy output unchanged)",
    )
    p.add_argument("--draft-max", type=int, default=8, metavar="K")


def run(a: argparse.Namespace) -> int:
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
