"""``amplituhedron bench``: the volume cache's predictions P1–P5 and triggers F1–F5, measured.

One invocation, on SmolLM2 over a mesh of stations (a local mesh of ``--stations K``
processes by default, or a running one with ``--mesh``):

1. **cache disabled vs enabled** — the same prompt (a shared system prompt of
   ``--prompt-tokens`` tokens of real text plus one fixed user question, through the chat
   template) for ``--sessions`` sessions with the stations' caches disabled
   (``configure(enabled=False)``, and the coordinator asking for no replay or capture),
   then enabled; per-session replay / prefill / decode,
   amortized TPS, uplift, and whether both regimes produced identical tokens;
2. **unique prompts** — every session a different system text and question, cache enabled:
   false hits (any hit is false here), latency against the disabled run, resident bytes;
3. **eviction policies** — Pisot-guard vs LRU (P5) and the cost-aware policy against
   both, in-process on the real cache, tails from the real model, plus the multi-tenant
   traces (:mod:`amplituhedron_rs.bench.eviction`);
4. **verdicts** — P1–P5 upheld / falsified, F1–F5 fired / not fired
   (:mod:`amplituhedron_rs.bench.verdicts`), with F5 from the Lean oracle parity suite;
5. **peers** — the single-process runtime and llama.cpp (when installed) on the same prompt
   (:mod:`amplituhedron_rs.bench.peers`).

The mesh phases run first and alone; the in-process phases start after the local stations
have stopped, so the two never compete for the cores. A warm-up session (its own prompt,
cache disabled) runs before anything is timed. Output: a live progress display, summary
tables, and optionally ``--json``, ``--plot`` and ``--report``
(:mod:`amplituhedron_rs.bench.report`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from amplituhedron_rs._core import DEFAULTS, InputError, prefix_hash
from amplituhedron_rs.bench.config import BenchConfig
from amplituhedron_rs.bench.eviction import compare_policies, model_tails
from amplituhedron_rs.bench.memory import measure_memory, memory_table
from amplituhedron_rs.bench.progress import LiveProgress
from amplituhedron_rs.bench.prompts import QUESTION, Prompts, build_prompts
from amplituhedron_rs.bench.verdicts import (
    SEED_ESTIMATE,
    Measurements,
    SessionPhases,
    amortized_tps,
    judge,
    uplift,
    verdicts_json,
)
from amplituhedron_rs.mesh.coordinator import Coordinator, MeshGeneration
from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec

JSON_SCHEMA_VERSION = 1
PLOT_HINT = "pip install 'amplituhedron-rs[plot]' (or: pip install matplotlib)"

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

    "Disabled": every station configured ``enabled=False`` and the coordinator asking for no
    replay or capture (``generate --no-cache`` only does the latter, for its own run)."""
    n = cfg.sessions
    longest = max(len(p) for p in [prompts.shared, *prompts.unique])
    extra: dict[str, Any] = {}
    if longest > DEFAULTS.max_prefix_len:
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
    from amplituhedron_rs.oracle import parity

    try:
        results = parity()
    except (OSError, ValueError) as exc:
        return {"total": 0, "passed": 0, "failures": [], "unavailable": str(exc)}
    failures = [f"{r.name} ({r.file}): {r.detail}" for r in results if not r.ok]
    return {
        "total": len(results),
        "passed": len(results) - len(failures),
        "failures": failures,
        "unavailable": None,
        "note": "values parsed from the Lean modules built into the extension (lean/Gnosis); "
        "no Lean toolchain on this machine, so lake build was not run",
    }


def measure_in_process(cfg: BenchConfig, prompts: Prompts, live: LiveProgress) -> dict[str, Any]:
    """Eviction traces, the single-process peer, llama.cpp and the oracle suite."""
    from amplituhedron_rs.bench import peers
    from amplituhedron_rs.runtime import CacheOptions, load_model

    with live.phase("loading model in-process", 1) as ph:
        longest = max(len(p) for p in [prompts.shared, *prompts.eviction])
        model = load_model(
            cfg.model,
            cache=CacheOptions(max_prefix_len=max(DEFAULTS.max_prefix_len, longest)),
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
        single = peers.measure_single_process(
            model, prompts.shared, cfg.sessions, cfg.new_tokens, ph.step
        )
    model_path = str(model.file.path)
    fingerprint = model.fingerprint
    del model  # free its pages before llama.cpp maps the same file
    installed = peers.llamacpp_available()
    with live.phase("peer: llama.cpp", 2 * cfg.sessions if installed else 1) as ph:
        llama = peers.measure_llamacpp(
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
    from amplituhedron_rs.runtime.gguf_file import read_model_file
    from amplituhedron_rs.runtime.tokenizer import Tokenizer

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
                    spec = MeshSpec.load(cfg.mesh, token=cfg.token)
                ph.step(", ".join(f"{s.layer_lo}:{s.layer_hi}" for s in spec.stations))

            async def drive() -> tuple[dict[str, Any], str]:
                async with Coordinator(spec, token=cfg.token, chunk=cfg.chunk) as c:
                    return await measure_mesh(c, prompts, cfg, live), c.fingerprint

            mesh, mesh_fingerprint = asyncio.run(drive())
            mesh["memory"] = measure_memory(spec, cfg.model)
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
            "memory": mesh["memory"],
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
        "seed_estimate": SEED_ESTIMATE.to_json(),
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


# --- the command's body ----------------------------------------------------------------


def run_and_write(
    cfg: BenchConfig,
    *,
    json_path: str | None = None,
    plot_path: str | None = None,
    report_path: str | None = None,
) -> dict[str, Any]:
    """Runs the bench, prints the summary tables, writes the requested files."""
    from amplituhedron_rs.bench import report as present

    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise InputError(f"--plot needs matplotlib, which is not installed: {PLOT_HINT}")
    err = Console(stderr=True)
    report = run_bench(cfg, err)
    out = Console()
    for table in present.summary_tables(report):
        out.print(table)
    out.print(memory_table(report["mesh"]["memory"]))
    out.print(f"wall time {report['wall_s']:.1f} s")
    if json_path:
        present.write_json(json_path, report)
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        present.write_plot(report, Path(plot_path))
        err.print(f"wrote {plot_path}")
    if report_path:
        plot = Path(plot_path) if plot_path else None
        present.write_text(Path(report_path), present.markdown(report, Path(report_path), plot))
        err.print(f"wrote {report_path}")
    return report
