"""``amplituhedron bench``: the falsifiability bench (see :mod:`amplituhedron_rs.bench`)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from amplituhedron_rs.bench.config import BenchConfig, TraceSpec
from amplituhedron_rs.cli.common import add_max_tokens, add_model, add_threads, add_token, token_of

HELP = (
    "the falsifiability bench: the volume cache's predictions P1–P5 and triggers F1–F5, "
    "measured over a mesh"
)
DESCRIPTION = (
    "Measures, on SmolLM2 over a local mesh (or --mesh), whether sessions after the first "
    "skip prefill (P1), session 2 is at least 80 % faster than session 1 (P2), amortized "
    "TPS is at least 2.5× the cache-off baseline (P3), unique prompts never hit (P4), and "
    "Pisot-guard eviction keeps at least LRU's hit rate (P5). F1–F5 fire on a false hit, a "
    "second session not 80 % faster, an uplift below 2×, Pisot-guard below LRU, or a Lean "
    "oracle parity failure. The single-process runtime and llama.cpp run side by side."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, trace = BenchConfig(), TraceSpec()
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--stations",
        type=int,
        default=d.stations,
        metavar="K",
        help="local mesh size",
    )
    where.add_argument("--mesh", metavar="FILE_OR_URL", help="use a running mesh instead")
    add_token(p, "the stations' bearer token")
    add_model(p)
    p.add_argument("--sessions", type=int, default=d.sessions, help="sessions per regime")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=d.prompt_tokens,
        help="tokens of real text in the shared system prompt",
    )
    add_max_tokens(p, d.new_tokens, "greedy tokens per session", old=("--new-tokens",))
    p.add_argument("--chunk", type=int, default=d.chunk, help="prefill rows per request")
    add_threads(p)
    g = p.add_argument_group("eviction traces (Pisot-guard, LRU, cost-aware; in-process)")
    g.add_argument(
        "--trace-prefixes", type=int, default=trace.prefixes, metavar="N", help="distinct prefixes"
    )
    g.add_argument(
        "--trace-entries", type=int, default=trace.max_entries, metavar="N", help="cache entries"
    )
    g.add_argument(
        "--trace-accesses", type=int, default=trace.accesses, metavar="N", help="accesses per seed"
    )
    g.add_argument(
        "--trace-seeds", type=int, default=len(trace.seeds), metavar="N", help="seeds per trace"
    )
    g.add_argument(
        "--zipf-s", type=float, default=trace.zipf_s, metavar="S", help="Zipf exponent of access"
    )
    g.add_argument(
        "--tenant-requests",
        type=int,
        default=trace.tenants.accesses,
        metavar="N",
        help="requests per seed of the multi-tenant traces",
    )
    p.add_argument(
        "--llamacpp-threads",
        type=int,
        default=d.llamacpp_threads,
        metavar="N",
        help="llama.cpp's threads, when llama-cpp-python is installed",
    )
    p.add_argument("--json", metavar="PATH", help="write every raw timing and verdict")
    p.add_argument("--plot", metavar="PATH.png", help="write the plot (needs matplotlib)")
    p.add_argument("--report", metavar="PATH.md", help="write a Markdown report")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    """A validated :class:`BenchConfig` from the parsed command line."""
    trace_defaults = TraceSpec()
    if a.trace_seeds < 1:
        raise ValueError(f"--trace-seeds must be at least 1, got {a.trace_seeds}")
    seeds = tuple(range(a.trace_seeds))
    trace = TraceSpec(
        prefixes=a.trace_prefixes,
        max_entries=a.trace_entries,
        accesses=a.trace_accesses,
        zipf_s=a.zipf_s,
        seeds=seeds,
        tenants=replace(trace_defaults.tenants, accesses=a.tenant_requests, seeds=seeds),
        conversations=replace(
            trace_defaults.conversations, accesses=a.tenant_requests, seeds=seeds
        ),
    )
    return BenchConfig(
        stations=a.stations,
        mesh=a.mesh,
        token=token_of(a),
        sessions=a.sessions,
        prompt_tokens=a.prompt_tokens,
        new_tokens=a.max_tokens,
        chunk=a.chunk,
        model=a.model,
        trace=trace,
        llamacpp_threads=a.llamacpp_threads,
    )


def run(a: argparse.Namespace) -> int:
    cfg = config_from_args(a)
    from amplituhedron_rs.bench.falsifiability import run_and_write

    run_and_write(cfg, json_path=a.json, plot_path=a.plot, report_path=a.report)
    return 0
