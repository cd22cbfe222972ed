"""What several subcommands share: argument types, the prompt and sampling options, and the
consoles. Light to import: nothing here loads the runtime, the mesh or an HTTP stack."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from amplituhedron_rs.runtime.sampling import SamplingParams

err = Console(stderr=True)
TOKEN_ENV = "AMPLITUHEDRON_TOKEN"


def prompt_ids(text: str) -> list[int]:
    """``--prompt-ids 1,2,3``."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids takes comma-separated integers: {exc}"
        ) from exc
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def layer_range(text: str) -> tuple[int, int]:
    """``--layers LO:HI``."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--layers takes LO:HI, got {text!r}") from exc
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"--layers {text}: need 0 <= LO < HI")
    return lo, hi


def add_token(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"{help} (env {TOKEN_ENV})")


def read_token_file(path: str) -> str:
    """A token from a file (stripped); a clear exit if it is missing or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"cannot read the token file {path}: {exc}") from exc
    if not token:
        raise SystemExit(f"the token file {path} is empty")
    return token


#: The model names ``--model`` takes besides a path (see ``amplituhedron models``).
MODEL_NAMES = "smollm2-135m, gemma3-270m, synthetic:PRESET[:QUANT][:layers=N]"


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", metavar="GGUF", help=f"model file or name ({MODEL_NAMES}; default SmolLM2)"
    )


def add_cache_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="persist captured volumes under DIR (one subdirectory per model and layer range); "
        "a restart serves hits from disk at once",
    )
    p.add_argument(
        "--max-disk-bytes", type=int, metavar="N", help="disk budget of --cache-dir (evicted)"
    )


def add_kv_dtype(p: argparse.ArgumentParser) -> None:
    from amplituhedron_rs._core import DEFAULTS

    p.add_argument(
        "--kv-dtype",
        choices=["f16", "f32"],
        default=DEFAULTS.kv_dtype,
        help="how sessions store K and V: f16 halves their memory and the bytes attention "
        f"reads, as llama.cpp; f32 keeps them exact (default {DEFAULTS.kv_dtype})",
    )


def add_prompt(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text")
    src.add_argument("--prompt-ids", type=prompt_ids, metavar="1,2,3", help="prompt token ids")
    p.add_argument("--system", metavar="TEXT", help="system prompt (implies --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")


def add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "sampling (greedy unless a temperature, top-k or top-p is given; --temperature 0 is "
        "greedy; a given --temperature 1 samples)"
    )
    g.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    g.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    g.add_argument("--temperature", type=float, metavar="T")
    g.add_argument("--top-k", type=int, metavar="K")
    g.add_argument("--top-p", type=float, metavar="P")
    g.add_argument("--seed", type=int, default=0, metavar="S")


def sampling(a: argparse.Namespace) -> SamplingParams:
    """The sampling options as :class:`SamplingParams` (its rule decides greedy)."""
    from amplituhedron_rs.runtime.sampling import SamplingParams

    given = (a.temperature, a.top_k, a.top_p)
    if a.greedy and any(v is not None for v in given):
        raise SystemExit("--greedy cannot be combined with --temperature/--top-k/--top-p")
    return SamplingParams(a.temperature, a.top_k, a.top_p, a.seed)
