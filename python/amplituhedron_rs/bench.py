"""``amplituhedron bench``: seed 001's predictions P1–P5 and triggers F1–F5, measured.

One invocation, on SmolLM2 over a mesh of stations (a local mesh of ``--stations K``
processes by default, or a running one with ``--mesh``):

1. **cache disabled vs enabled** — the same prompt (a shared system prompt of
   ``--prompt-tokens`` tokens of real text plus one fixed user question, through the chat
   template) for ``--sessions`` sessions with the stations' caches disabled
   (``configure(enabled=False)``), then enabled; per-session replay / prefill / decode,
   amortized TPS, uplift, and whether both regimes produced identical tokens;
2. **unique prompts** — every session a different system text and question, cache enabled:
   false hits (any hit is false here), latency against the disabled run, resident bytes;
3. **eviction policies** — Pisot-guard vs LRU (the seed's P5) and the cost-aware policy
   against both, in-process on the real cache, tails from the real model, plus the
   multi-tenant traces (:mod:`amplituhedron_rs.bench_eviction`);
4. **verdicts** — P1–P5 upheld / falsified, F1–F5 fired / not fired
   (:mod:`amplituhedron_rs.bench_verdicts`), with F5 from the Lean oracle parity suite;
5. **peers** — the single-process runtime and llama.cpp (when installed) on the same prompt
   (:mod:`amplituhedron_rs.bench_peers`).

The mesh phases run first and alone; the in-process phases start after the local stations
have stopped, so the two never compete for the cores. A warm-up session (its own prompt,
cache disabled) runs before anything is timed. Output: a live progress display, summary
tables, and optionally ``--json``, ``--plot`` and ``--report``
(:mod:`amplituhedron_rs.bench_report`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from amplituhedron_rs._core import prefix_hash
from amplituhedron_rs.bench_eviction import (
    CONVERSATIONS,
    TenantSpec,
    TraceSpec,
    compare_policies,
    model_tails,
)
from amplituhedron_rs.bench_verdicts import (
    Measurements,
    SessionPhases,
    amortized_tps,
    judge,
    uplift,
    verdicts_json,
)
from amplituhedron_rs.coordinator import Coordinator, MeshGeneration
from amplituhedron_rs.mesh import LocalMesh, MeshSpec
from amplituhedron_rs.textsource import text_of_tokens

JSON_SCHEMA_VERSION = 1
DEFAULT_MAX_PREFIX_LEN = 512  # the stations' and the runtime's default (SPEC §2)
PLOT_HINT = "pip install 'amplituhedron-rs[plot]' (or: pip install matplotlib)"

QUESTION = "In one sentence, what is the main idea of the text above?"
"""The fixed user question of the shared prompt."""
UNIQUE_QUESTIONS = (
    "Which term in the text above matters most, and why?",
    "Summarize the text above in five words.",
    "What would a beginner find hardest in the text above?",
    "Name one example that the text above could use.",
)
"""User questions of the unique-prompt regime (cycled; each also has its own system text)."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything one bench run is parameterized by."""

    stations: int = 4
    mesh: str | None = None  #: a running mesh (file or URLs) instead of a local one
    token: str | None = None  #: the stations' bearer token
    sessions: int = 10
    prompt_tokens: int = 256  #: tokens of real text in the shared system prompt
    new_tokens: int = 8
    chunk: int = 64  #: prefill rows per request
    model: str | None = None  #: GGUF path (default: the bundled SmolLM2)
    trace: TraceSpec = field(default_factory=TraceSpec)
    llamacpp_threads: int = 2

    def __post_init__(self) -> None:
        if self.sessions < 2:
            raise ValueError(
                f"--sessions must be at least 2 (P1/P2 compare sessions), got {self.sessions}"
            )
        if self.prompt_tokens < 1:
            raise ValueError(f"--prompt-tokens must be at least 1, got {self.prompt_tokens}")
        if self.new_tokens < 1:
            raise ValueError(f"--new-tokens must be at least 1, got {self.new_tokens}")
        if self.mesh is None and self.stations < 1:
            raise ValueError(f"--stations must be at least 1, got {self.stations}")
        if self.chunk < 1:
            raise ValueError(f"--chunk must be at least 1, got {self.chunk}")
        if self.llamacpp_threads < 1:
            raise ValueError(f"--llamacpp-threads must be at least 1, got {self.llamacpp_threads}")


@dataclass(frozen=True)
class Prompts:
    """Every prompt of one bench run, as token ids."""

    shared: list[int]  #: cache on/off regimes: identical every session
    unique: list[list[int]]  #: one per session of the unique regime
    eviction: list[list[int]]  #: the eviction trace's distinct prefixes
    warmup: list[int]  #: distinct from all the others


def build_prompts(encode: Any, decode: Any, chat_ids: Any, cfg: BenchConfig) -> Prompts:
    """Prompt ``i`` of the unique regime (and of the eviction trace) takes the ``i+1``-th
    slice of ``prompt_tokens`` tokens of reference text as its system prompt; the shared
    prompt takes slice 0. Every prompt is checked distinct."""
    n = cfg.prompt_tokens
    count = max(cfg.sessions, cfg.trace.prefixes) + 2
    stream = text_of_tokens(encode, n * count)

    def system(i: int) -> str:
        return str(decode(stream[i * n : (i + 1) * n]))

    def unique(i: int) -> list[int]:
        q = UNIQUE_QUESTIONS[i % len(UNIQUE_QUESTIONS)]
        return list(chat_ids(system(i + 1), q))

    prompts = Prompts(
        shared=list(chat_ids(system(0), QUESTION)),
        unique=[unique(i) for i in range(cfg.sessions)],
        eviction=[unique(i) for i in range(cfg.trace.prefixes)],
        warmup=unique(count - 2),
    )
    distinct = {tuple(p) for p in [prompts.shared, prompts.warmup, *prompts.unique]}
    if len(distinct) != cfg.sessions + 2 or len({tuple(p) for p in prompts.eviction}) != len(
        prompts.eviction
    ):
        raise ValueError("the reference text repeats: the bench's prompts are not distinct")
    return prompts


# --- live progress ---------------------------------------------------------------------


class Phase:
    """One line of the live display."""

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self._progress = progress
        self._task = task

    def step(self, note: str = "") -> None:
        self._progress.update(self._task, advance=1, note=note)

    def finish(self, note: str = "") -> None:
        total = self._progress.tasks[self._task].total
        self._progress.update(
            self._task, completed=total if total is not None else 1, total=total or 1, note=note
        )


class LiveProgress:
    """The bench's live progress display (rich), one line per phase."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description:<28}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("[dim]{task.fields[note]}"),
            console=console,
        )

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    @contextmanager
    def phase(self, description: str, total: int | None) -> Iterator[Phase]:
        task = self.progress.add_task(description, total=total, note="")
        p = Phase(self.progress, task)
        yield p
        p.finish(self.progress.tasks[task].fields.get("note", ""))


# --- the mesh --------------------------------------------------------------------------


def session_json(index: int, g: MeshGeneration) -> dict[str, Any]:
    """One mesh session's raw timings and verdicts."""
    return {
        "session": index + 1,
        "prompt_tokens": len(g.prompt_ids),
        "prefix_hash": str(prefix_hash(g.prompt_ids)),
        "latency_ms": g.latency_ms,
        "open_ms": g.open_ms,
        "replay_ms": g.replay_ms,
        "prefill_ms": g.prefill_ms,
        "decode_ms": g.decode_ms,
        "replay_hit": g.cache_hit,
        "replayed_tokens": g.replayed_tokens,
        "output_ids": list(g.output_ids),
        "stations": [asdict(v) for v in g.stations],
    }


def regime_json(cache: str, sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """A regime's sessions plus its totals (TPS = generated tokens / summed latency)."""
    generated = sum(len(s["output_ids"]) for s in sessions)
    latencies = [s["latency_ms"] for s in sessions]
    return {
        "cache": cache,
        "sessions": sessions,
        "generated_tokens": generated,
        "total_latency_ms": sum(latencies),
        "median_latency_ms": statistics.median(latencies),
        "median_replay_ms": statistics.median(s["replay_ms"] for s in sessions),
        "median_prefill_ms": statistics.median(s["prefill_ms"] for s in sessions),
        "median_decode_ms": statistics.median(s["decode_ms"] for s in sessions),
        "tps": amortized_tps(generated, latencies),
    }


def _bytes(stats: Sequence[dict[str, Any]]) -> int:
    return sum(int(s["bytes"]) for s in stats)


async def measure_mesh(
    c: Coordinator, prompts: Prompts, cfg: BenchConfig, live: LiveProgress
) -> dict[str, Any]:
    """Warm-up, cache disabled, cache enabled, unique prompts — in that order.

    "Disabled" is what ``amplituhedron generate --no-cache`` does over a mesh: every station
    configured ``enabled=False`` and the coordinator not asking for replay or capture."""
    n = cfg.sessions
    longest = max(len(p) for p in [prompts.shared, *prompts.unique])
    extra: dict[str, Any] = {}
    if longest > DEFAULT_MAX_PREFIX_LEN:
        extra["max_prefix_len"] = longest  # else nothing would be captured
    await c.configure(enabled=False, **extra)
    await c.clear()

    async def sessions(
        phase_name: str, ids_of: Any, total: int, use_cache: bool
    ) -> list[dict[str, Any]]:
        out = []
        with live.phase(phase_name, total) as ph:
            for i in range(total):
                g = await c.generate(ids_of(i), cfg.new_tokens, use_cache=use_cache)
                out.append(session_json(i, g))
                ph.step(f"s{i + 1}: {g.latency_ms:.0f} ms, {'hit' if g.cache_hit else 'miss'}")
        return out

    warmup = (await sessions("warm-up (cache off)", lambda i: prompts.warmup, 1, False))[0]
    await c.clear()
    cold = await sessions("cache disabled", lambda i: prompts.shared, n, False)
    await c.configure(enabled=True)
    await c.clear()
    warm = await sessions("cache enabled", lambda i: prompts.shared, n, True)
    warm_stats = await c.stats()
    await c.clear()
    before = await c.stats()
    unique = await sessions("unique prompts", lambda i: prompts.unique[i], n, True)
    after = await c.stats()
    await c.clear()  # leave a running mesh enabled and empty, not full of bench prompts
    return {
        "warmup": warmup,
        "cold": regime_json("disabled", cold),
        "warm": regime_json("enabled", warm) | {"station_stats": warm_stats},
        "unique_sessions": unique,
        "unique_stats_before": before,
        "unique_stats_after": after,
        "configured": extra,
    }


def bit_exactness(cold: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    """Whether every session of both regimes produced the same tokens."""
    reference = cold["sessions"][0]["output_ids"]
    mismatches = [
        f"{name} session {s['session']}"
        for name, regime in (("disabled", cold), ("enabled", warm))
        for s in regime["sessions"]
        if s["output_ids"] != reference
    ]
    return {"identical": not mismatches, "output_ids": reference, "mismatches": mismatches}


def unique_regime(mesh: dict[str, Any], cold: dict[str, Any]) -> dict[str, Any]:
    """False hits and the cache's cost in the unique-prompt regime."""
    sessions = mesh["unique_sessions"]
    # A unique prompt can never be cached whole: any full hit is false. Reusing a genuinely
    # shared leading part (longest-prefix replay; its token ids are compared) is not.
    reply_hits = sum(1 for s in sessions for v in s["stations"] if v["replay"] == "hit")
    partial_reuses = sum(1 for s in sessions for v in s["stations"] if v["replay"] == "partial")
    before, after = mesh["unique_stats_before"], mesh["unique_stats_after"]
    stats_hits = sum(int(a["hits"]) - int(b["hits"]) for a, b in zip(after, before, strict=True))
    regime = regime_json("enabled", sessions)
    return regime | {
        "distinct_prompts": len({s["prefix_hash"] for s in sessions}),
        "false_hits": {"replies": reply_hits, "stats": stats_hits},
        "shared_prefix_reuses": partial_reuses,
        "station_stats_before": before,
        "station_stats_after": after,
        "resident_bytes": _bytes(after),
        "resident_entries": sum(int(s["entries"]) for s in after),
        "evictions": sum(
            int(a["evictions"]) - int(b["evictions"]) for a, b in zip(after, before, strict=True)
        ),
        "disabled_median_latency_ms": cold["median_latency_ms"],
        "latency_overhead_ms": regime["median_latency_ms"] - cold["median_latency_ms"],
        "latency_ratio": regime["median_latency_ms"] / cold["median_latency_ms"],
    }


# --- in-process phases -----------------------------------------------------------------


def oracle_suite() -> dict[str, Any]:
    """The Lean oracle parity suite, in-process."""
    from amplituhedron_rs.oracles import oracle_parity

    try:
        results = oracle_parity()
    except (OSError, ValueError) as exc:
        return {"total": 0, "passed": 0, "failures": [], "unavailable": str(exc)}
    failures = [f"{r.name} ({r.file}): {r.detail}" for r in results if not r.ok]
    return {
        "total": len(results),
        "passed": len(results) - len(failures),
        "failures": failures,
        "unavailable": None,
        "note": "values parsed from lean/Gnosis/*.lean; no Lean toolchain on this machine, "
        "so lake build was not run",
    }


def measure_in_process(cfg: BenchConfig, prompts: Prompts, live: LiveProgress) -> dict[str, Any]:
    """Eviction traces, the single-process peer, llama.cpp and the oracle suite."""
    from amplituhedron_rs import bench_peers
    from amplituhedron_rs.model import CacheOptions, load_model

    with live.phase("loading model in-process", 1) as ph:
        longest = max(len(p) for p in [prompts.shared, *prompts.eviction])
        model = load_model(
            cfg.model,
            cache=CacheOptions(max_prefix_len=max(DEFAULT_MAX_PREFIX_LEN, longest)),
        )
        ph.step(f"fingerprint {model.fingerprint:016x}")
    with live.phase("eviction: real tails", len(prompts.eviction)) as ph:
        tails, prefill_s_per_token = model_tails(model, prompts.eviction, ph.step)
    with live.phase("eviction: Pisot vs LRU vs cost-aware", 1) as ph:
        eviction = compare_policies(
            cfg.trace,
            prompts.eviction,
            tails,
            fingerprint=model.fingerprint,
            kv_heads=model.weights.n_kv_heads,
            head_dim=model.weights.head_dim,
            prefill_s_per_token=prefill_s_per_token,
        )
        rates = eviction["traces"]["luminary"]["hit_rate"]
        ph.step(
            f"Luminary: Pisot {rates['pisot']:.3f} vs LRU {rates['lru']:.3f} "
            f"vs cost-aware {rates['gdsf']:.3f}"
        )
    with live.phase("oracle parity (F5)", 1) as ph:
        oracles = oracle_suite()
        ph.step(f"{oracles['passed']}/{oracles['total']} pass")
    with live.phase("peer: single process", 2 * cfg.sessions) as ph:
        single = bench_peers.measure_single_process(
            model, prompts.shared, cfg.sessions, cfg.new_tokens, ph.step
        )
    model_path = str(model.file.path)
    fingerprint = model.fingerprint
    del model  # free its pages before llama.cpp maps the same file
    installed = bench_peers.llamacpp_available()
    with live.phase("peer: llama.cpp", 2 * cfg.sessions if installed else 1) as ph:
        llama = bench_peers.measure_llamacpp(
            model_path,
            prompts.shared,
            cfg.sessions,
            cfg.new_tokens,
            ph.step,
            threads=cfg.llamacpp_threads,
        )
        if not installed:
            ph.step("not installed")
    return {
        "model": {"path": model_path, "fingerprint": f"{fingerprint:016x}"},
        "eviction": eviction,
        "oracles": oracles,
        "single_process": single,
        "llamacpp": llama,
    }


# --- the whole run ---------------------------------------------------------------------


def run_bench(cfg: BenchConfig, console: Console) -> dict[str, Any]:
    """Runs every phase and returns the JSON report (raw timings, verdicts, peers)."""
    from amplituhedron_rs.gguf_file import read_model_file
    from amplituhedron_rs.tokenizer import Tokenizer

    started = time.perf_counter()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    with LiveProgress(console) as live:
        with live.phase("tokenizer and prompts", 1) as ph:
            tok = Tokenizer(read_model_file(cfg.model))
            prompts = build_prompts(tok.encode, tok.decode, tok.chat_ids, cfg)
            ph.step(f"{len(prompts.shared)}-token shared prompt")
        local: LocalMesh | None = None
        try:
            with live.phase(
                f"starting {cfg.stations} stations" if cfg.mesh is None else "connecting to mesh",
                1,
            ) as ph:
                if cfg.mesh is None:
                    local = LocalMesh(cfg.stations, model_path=cfg.model, token=cfg.token)
                    spec = local.start()
                else:
                    spec = MeshSpec.load(cfg.mesh)
                ph.step(", ".join(f"{s.layer_lo}:{s.layer_hi}" for s in spec.stations))

            async def drive() -> tuple[dict[str, Any], str]:
                async with Coordinator(spec, token=cfg.token, chunk=cfg.chunk) as c:
                    return await measure_mesh(c, prompts, cfg, live), c.fingerprint

            mesh, mesh_fingerprint = asyncio.run(drive())
        finally:
            if local is not None:
                local.close()
        in_process = measure_in_process(cfg, prompts, live)

    cold, warm = mesh["cold"], mesh["warm"]
    reference = cold["sessions"][0]["output_ids"]
    for peer in (in_process["single_process"], in_process["llamacpp"]):
        if peer.get("installed"):
            peer["same_tokens_as_mesh"] = all(
                s["output_ids"] == reference
                for regime in (peer["cold"], peer["warm"])
                for s in regime["sessions"]
            )
    unique = unique_regime(mesh, cold)
    eviction = in_process["eviction"]
    lum = eviction["traces"]["luminary"]
    oracles = in_process["oracles"]
    measurements = Measurements(
        warm_sessions=tuple(
            SessionPhases(tuple(v["replay"] for v in s["stations"]), s["prefill_ms"])
            for s in warm["sessions"]
        ),
        session1_ms=warm["sessions"][0]["latency_ms"],
        session2_ms=warm["sessions"][1]["latency_ms"],
        cold_tps=cold["tps"],
        warm_tps=warm["tps"],
        reply_false_hits=unique["false_hits"]["replies"],
        stats_false_hits=unique["false_hits"]["stats"],
        pisot_hits=lum["hits"]["pisot"],
        lru_hits=lum["hits"]["lru"],
        trace_accesses=lum["accesses"],
        oracle_total=oracles["total"],
        oracle_failures=tuple(oracles["failures"]),
        oracle_unavailable=oracles["unavailable"],
    )
    predictions, triggers = judge(measurements)
    report: dict[str, Any] = {
        "schema": JSON_SCHEMA_VERSION,
        "started_at": started_at,
        "config": asdict(cfg) | {"token": "***" if cfg.token else None},
        "model": in_process["model"] | {"mesh_fingerprint": mesh_fingerprint},
        "mesh": {
            "kind": "local" if cfg.mesh is None else "remote",
            "stations": [asdict(s) for s in spec.stations],
            "configured": mesh["configured"],
        },
        "prompt": {
            "system_tokens": cfg.prompt_tokens,
            "prompt_tokens": len(prompts.shared),
            "question": QUESTION,
            "new_tokens": cfg.new_tokens,
            "sampling": "greedy",
            "text": tok.decode(prompts.shared),
        },
        "warmup": mesh["warmup"],
        "cold": cold,
        "warm": warm,
        "uplift": uplift(cold["tps"], warm["tps"]),
        "bit_exact": bit_exactness(cold, warm),
        "output_text": tok.decode(cold["sessions"][0]["output_ids"], skip_special=True),
        "unique": unique,
        "eviction": eviction,
        "oracles": oracles,
        "peers": {
            "mesh": {"cold_tps": cold["tps"], "warm_tps": warm["tps"]},
            "single_process": in_process["single_process"],
            "llamacpp": in_process["llamacpp"],
        },
        **verdicts_json(predictions, triggers),
    }
    report["wall_s"] = time.perf_counter() - started
    return report


# --- the command -----------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--stations", type=int, default=4, metavar="K", help="local mesh size (default 4)"
    )
    where.add_argument("--mesh", metavar="FILE_OR_URL", help="use a running mesh instead")
    p.add_argument(
        "--token",
        default=os.environ.get("AMPLITUHEDRON_TOKEN"),
        help="the stations' bearer token (env AMPLITUHEDRON_TOKEN)",
    )
    p.add_argument("--model", metavar="GGUF", help="model file (default: bundled SmolLM2)")
    p.add_argument("--sessions", type=int, default=10, help="sessions per regime (default 10)")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=256,
        help="tokens of real text in the shared system prompt (default 256)",
    )
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per session")
    p.add_argument("--chunk", type=int, default=64, help="prefill rows per request")
    g = p.add_argument_group("eviction traces (Pisot-guard, LRU, cost-aware; in-process)")
    d = TraceSpec()
    g.add_argument("--trace-prefixes", type=int, default=d.prefixes, metavar="N")
    g.add_argument("--trace-entries", type=int, default=d.max_entries, metavar="N")
    g.add_argument("--trace-accesses", type=int, default=d.accesses, metavar="N")
    g.add_argument("--trace-seeds", type=int, default=len(d.seeds), metavar="N")
    g.add_argument("--zipf-s", type=float, default=d.zipf_s, metavar="S")
    g.add_argument(
        "--tenant-requests",
        type=int,
        default=d.tenants.accesses,
        metavar="N",
        help="requests per seed of the multi-tenant traces",
    )
    p.add_argument("--llamacpp-threads", type=int, default=2, metavar="N")
    p.add_argument("--json", metavar="PATH", help="write every raw timing and verdict")
    p.add_argument("--plot", metavar="PATH.png", help="write the plot (needs matplotlib)")
    p.add_argument("--report", metavar="PATH.md", help="write a Markdown report")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    """A validated :class:`BenchConfig` from the parsed command line."""
    if a.trace_seeds < 1:
        raise ValueError(f"--trace-seeds must be at least 1, got {a.trace_seeds}")
    seeds = tuple(range(a.trace_seeds))
    trace = TraceSpec(
        prefixes=a.trace_prefixes,
        max_entries=a.trace_entries,
        accesses=a.trace_accesses,
        zipf_s=a.zipf_s,
        seeds=seeds,
        tenants=replace(TenantSpec(), accesses=a.tenant_requests, seeds=seeds),
        conversations=replace(CONVERSATIONS, accesses=a.tenant_requests, seeds=seeds),
    )
    return BenchConfig(
        stations=a.stations,
        mesh=a.mesh,
        token=a.token,
        sessions=a.sessions,
        prompt_tokens=a.prompt_tokens,
        new_tokens=a.new_tokens,
        chunk=a.chunk,
        model=a.model,
        trace=trace,
        llamacpp_threads=a.llamacpp_threads,
    )


def main(a: argparse.Namespace) -> int:
    from amplituhedron_rs import bench_report

    cfg = config_from_args(a)
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"--plot needs matplotlib, which is not installed: {PLOT_HINT}")
    err = Console(stderr=True)
    report = run_bench(cfg, err)
    out = Console()
    for table in bench_report.summary_tables(report):
        out.print(table)
    out.print(f"wall time {report['wall_s']:.1f} s")
    if a.json:
        _write(Path(a.json), json.dumps(report, indent=2) + "\n")
        err.print(f"wrote {a.json}")
    if a.plot:
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        bench_report.write_plot(report, Path(a.plot))
        err.print(f"wrote {a.plot}")
    if a.report:
        _write(
            Path(a.report), bench_report.markdown(report, Path(a.report), a.plot and Path(a.plot))
        )
        err.print(f"wrote {a.report}")
    return 0


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


if __name__ == "__main__":  # pragma: no cover
    from amplituhedron_rs.cli import main as cli_main

    sys.exit(cli_main(["bench", *sys.argv[1:]]))
