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


class Formatter(argparse.HelpFormatter):
    """Help with every option's default shown (unless the help already names it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_ = action.help or ""
        default = action.default
        shown = default not in (None, False, argparse.SUPPRESS, [], "")
        if shown and "default" not in help_ and action.option_strings:
            help_ += " (default: %(default)s)"
        return help_


class _Renamed(argparse.Action):
    """An old spelling kept for one release: sets the new option's value and says so."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kw: object) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kw)  # type: ignore[arg-type]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        err.print(
            f"[yellow]{option_string} is now {self.new}; the old name goes in the next "
            "release[/yellow]",
            soft_wrap=True,
        )
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def renamed(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    old: str,
    new: str,
    dest: str,
    **kw: object,
) -> None:
    """Accepts ``old`` (hidden from help) as ``new``, warning once used."""
    p.add_argument(
        old, dest=dest, action=_Renamed, new=new, help=argparse.SUPPRESS,
        default=argparse.SUPPRESS, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def rate(text: str) -> float:
    """A number in [0, 1]."""
    try:
        x = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from exc
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {x}")
    return x


def positive(text: str) -> int:
    """An integer of at least 1."""
    try:
        n = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def int_list(text: str) -> list[int]:
    """``1,2,4``: a sweep."""
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {exc}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers of at least 1, got {text!r}")
    return values


def add_token(p: argparse.ArgumentParser, help: str, *, insecure: str | None = None) -> None:
    """``--token`` / ``--token-file`` (and ``--insecure`` when ``insecure`` says what it
    does): the mesh's bearer token, one spelling in every subcommand."""
    auth = p.add_mutually_exclusive_group()
    auth.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        metavar="TOKEN",
        help=f"{help} (env {TOKEN_ENV})",
    )
    auth.add_argument("--token-file", metavar="PATH", help="read the mesh token from a file")
    if insecure is not None:
        auth.add_argument("--insecure", action="store_true", help=insecure)


def token_of(a: argparse.Namespace) -> str | None:
    """The token given by ``--token``, ``--token-file`` or the environment."""
    if getattr(a, "token_file", None):
        return read_token_file(a.token_file)
    token: str | None = a.token
    return token


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


def add_model(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """``-m/--model`` (and ``[MODEL]`` when ``positional``): a GGUF path or a known name."""
    if positional:
        p.add_argument(
            "model_arg",
            nargs="?",
            metavar="MODEL",
            help=f"model file or name, as --model ({MODEL_NAMES}; default smollm2-135m)",
        )
    p.add_argument(
        "-m",
        "--model",
        metavar="GGUF",
        help=f"model file or name ({MODEL_NAMES}; default smollm2-135m)",
    )


def model_of(a: argparse.Namespace) -> str | None:
    """The model given as ``MODEL`` or ``--model`` (not both, unless they agree)."""
    given = getattr(a, "model_arg", None)
    if given is not None and a.model is not None and given != a.model:
        raise SystemExit(f"two models given: {given} and --model {a.model}")
    model: str | None = given if given is not None else a.model
    return model


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=positive,
        metavar="N",
        help="this runtime's worker threads, for every model run here and every station "
        "started here (default: one per core; env AMPLITUHEDRON_THREADS)",
    )


def add_max_tokens(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    default: int,
    help: str = "tokens to generate at most",
    *,
    old: tuple[str, ...] = (),
) -> None:
    """``--max-tokens N`` (``old``: its former spellings, kept hidden for one release)."""
    p.add_argument("--max-tokens", type=int, default=default, metavar="N", help=help)
    for o in old:
        renamed(p, o, "--max-tokens", "max_tokens", type=int, metavar="N")


def add_model_limits(p: argparse.ArgumentParser) -> None:
    """``--max-model-len`` and ``--chat-template``: wherever a model runs."""
    p.add_argument(
        "--max-model-len",
        type=positive,
        metavar="N",
        help="positions a request may use, prompt and reply (default: the model's context, "
        "within a session's ring of 4096; a larger value in process sizes the rings)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template to use instead of the model file's (default: the file's)",
    )


def add_cache_options(p: argparse.ArgumentParser, *, no_cache: str) -> None:
    """The volume cache's bounds and policy, as stations and the server take them."""
    from amplituhedron_rs._core import DEFAULTS

    p.add_argument("--no-cache", action="store_true", help=no_cache)
    p.add_argument(
        "--max-entries", type=int, default=DEFAULTS.max_entries, help="volumes the cache holds"
    )
    p.add_argument(
        "--max-prefix-len",
        type=int,
        default=DEFAULTS.max_prefix_len,
        metavar="N",
        help="longest prefix the volume cache captures, in tokens; a longer prompt caches its "
        "first N",
    )
    p.add_argument(
        "--policy",
        choices=["pisot", "lru", "gdsf"],
        default=DEFAULTS.policy,
        help="eviction policy",
    )
    p.add_argument(
        "--min-prefix-reuse",
        type=int,
        default=DEFAULTS.min_prefix_reuse,
        metavar="N",
        help="replay the longest cached prefix of at least N tokens (0: exact prompts only)",
    )


def add_cache_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="persist captured volumes under DIR (one subdirectory per model and layer range); "
        "a restart serves hits from disk at once (default: memory only)",
    )
    p.add_argument(
        "--max-disk-bytes",
        type=int,
        metavar="N",
        help="disk budget of --cache-dir, evicted past it (default: unbounded)",
    )


def add_precision(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument(
        "--precision",
        choices=["refined", "fast"],
        default="refined",
        help=help
        or "activations: 16-bit codes in two byte planes (near-f32 logits) or 8-bit (llama.cpp)",
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
    add_max_tokens(g, 32, old=("--max-new-tokens",))
    g.add_argument("--temperature", type=float, metavar="T", help="sampling temperature")
    g.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest")
    g.add_argument(
        "--top-p", type=float, metavar="P", help="sample within the top-P probability mass"
    )
    g.add_argument("--seed", type=int, default=0, metavar="S", help="the sampler's seed")
    # Greedy is the default; --temperature 0 forces it.
    renamed(g, "--greedy", "the default (or --temperature 0)", "greedy", nargs=0)


def sampling(a: argparse.Namespace) -> SamplingParams:
    """The sampling options as :class:`SamplingParams` (its rule decides greedy)."""
    from amplituhedron_rs.runtime.sampling import SamplingParams

    given = (a.temperature, a.top_k, a.top_p)
    if getattr(a, "greedy", False) and any(v is not None for v in given):
        raise SystemExit("--greedy cannot be combined with --temperature/--top-k/--top-p")
    return SamplingParams(a.temperature, a.top_k, a.top_p, a.seed)
