"""``amplituhedron bench-serve``: many streaming clients against OpenAI-compatible servers.

Every client sends requests made of one shared system prompt (real prose) and a question of
its own, asks for ``--max-tokens`` tokens (greedy), and streams the reply. For each
concurrency level (1, 2, 4, 8, 16 clients by default) it reports aggregate output tokens/s,
time to first token (p50/p99) and inter-token latency (p50/p99), and counts errors.

The same workload runs, in the same run, against the peers that are present:
llama.cpp's own ``llama-server`` (``--llama-server PATH``; it has continuous batching with
``-np``) and ``python -m llama_cpp.server`` (the ``peers`` extra). Each system is warmed up
with one request first. Every question of a run is new to the server (it names its round,
level, client and request), so no request is an exact repeat that the prefix cache could
answer whole: the shared system prompt is the only prefix a request can replay, as the
workload intends. ``--stations K`` adds the same server serving through a local mesh
of K station processes (the engine's mesh executor, one request per station per step), so
mesh and single process are measured side by side. ``--json`` writes every figure,
``--plot`` throughput against concurrency.

``--structured`` adds our server under a JSON-schema workload: the same requests with
``response_format`` set to :data:`STRUCTURED_SCHEMA` (its one string field has a minimum
length no reply reaches, so every reply runs to ``--max-tokens`` like the unconstrained ones
and the two do the same number of steps). It runs on the same server, interleaved with the
unconstrained levels, and its row's "ours ×" is unconstrained over constrained throughput,
the median of per-round ratios: what masking costs (engine tok/s shows it without HTTP).

For our server each level also reports its engine's load, read from ``/metrics`` before and
after: how busy the engine was (the fraction of the wall time a batched step was in
flight), its mean rows per step, and the output tokens per second of its steps alone. The
last is the level's throughput with the HTTP layer's cost and the idle gaps taken out: what
a faster front could reach at most.

The machines this runs on are noisy (the same command varies by tens of percent from one
minute to the next), so ``--rounds R`` repeats the whole sweep R times with every system's
server kept up and the systems and levels interleaved (round 1: each system at each level,
round 2: again, ...). Each figure is then the median over the rounds, and every ratio — a
level against one client, ours against a peer at the same level — is the median of the
ratios measured within one round, so a slow minute hits both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from amplituhedron_rs.bench.serve_results import (
    EngineLoad,
    EngineTotals,
    LevelResult,
    RequestRecord,
    SystemResult,
    combine,
    median_ratio,
    parse_engine_totals,
    percentile,
)
from amplituhedron_rs.bench.servers import Server, port_of, served_model, systems
from amplituhedron_rs.bench.textsource import reference_text
from amplituhedron_rs.runtime.gguf_file import read_model_file
from amplituhedron_rs.runtime.tokenizer import Tokenizer

#: The ``--structured`` workload's schema: JSON, with a string no reply finishes.
STRUCTURED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string", "minLength": 100000}},
    "required": ["answer"],
    "additionalProperties": False,
}
#: The name its rows carry in the report.
STRUCTURED_NAME = "amplituhedron json_schema"

QUESTIONS = [
    "what is the main idea of the text",
    "which example in it is the clearest",
    "what would a beginner find hard in it",
    "how would you summarise it for a child",
    "what does it say about errors",
    "which term does it define first",
    "what is one thing it leaves out",
    "how could it be shorter",
]


#: The tag of the warm-up request's question.
WARM_UP = "warm-up"


async def engine_totals(server: Server) -> EngineTotals | None:
    """Reads ``server``'s engine counters (None for a server without them)."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
            http.get(f"{server.url}/metrics") as r,
        ):
            return parse_engine_totals(await r.text()) if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def level_tag(round_index: int, clients: int) -> str:
    """The tag of round ``round_index``'s (from 0) level of ``clients`` clients."""
    return f"r{round_index + 1}c{clients}"


def question(tag: str, client: int, request: int) -> str:
    """Client ``client``'s ``request``-th question in the run part named ``tag``: distinct for
    every distinct (tag, client, request), so none repeats a prompt the server has seen."""
    q = QUESTIONS[(client + request) % len(QUESTIONS)]
    return f"{tag} #{client}.{request}: {q}?"


async def one_request(
    http: aiohttp.ClientSession,
    server: Server,
    system: str,
    question: str,
    max_tokens: int,
    structured: bool = False,
) -> RequestRecord:
    body: dict[str, Any] = {
        "model": server.model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if structured:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": STRUCTURED_SCHEMA, "strict": True},
        }
    started = time.perf_counter()
    first: float | None = None
    last = started
    gaps: list[float] = []
    tokens = 0
    finish_reason = None
    try:
        async with http.post(f"{server.url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return RequestRecord(0.0, [], 0, f"HTTP {r.status}: {await r.text()}")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestRecord(0.0, [], tokens, str(chunk["error"]))
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                finish_reason = choice.get("finish_reason") or finish_reason
                delta = choice.get("delta") or {}
                if not delta.get("content"):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
                tokens += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        return RequestRecord(0.0, [], tokens, repr(exc))
    if finish_reason is None:
        # A reply cut short is not a served request (llama_cpp.server, by default, abandons
        # a streaming request when another arrives: it ends the stream without one).
        return RequestRecord(0.0, [], tokens, "the stream ended without a finish_reason")
    return RequestRecord((first or last) - started, gaps, tokens)


async def run_level(
    server: Server,
    system: str,
    clients: int,
    requests: int,
    max_tokens: int,
    tag: str,
    structured: bool = False,
) -> LevelResult:
    """``clients`` streaming clients, each sending ``requests`` requests in turn; ``tag``
    names this part of the run in every question (see :func:`question`); ``structured``:
    each under :data:`STRUCTURED_SCHEMA`."""
    timeout = aiohttp.ClientTimeout(total=1800)
    # A fresh connection per request, for every system alike: llama-server closes a
    # streamed response's connection, and a reused pooled one then fails to send.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

        async def client(k: int) -> list[RequestRecord]:
            out = []
            for j in range(requests):
                q = question(tag, k, j)
                out.append(await one_request(http, server, system, q, max_tokens, structured))
            return out

        totals_before = await engine_totals(server)
        started = time.perf_counter()
        per_client = await asyncio.gather(*(client(k) for k in range(clients)))
        wall = time.perf_counter() - started
        totals_after = await engine_totals(server) if totals_before else None
    records = [r for rs in per_client for r in rs]
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in records)
    load = (
        totals_before.load(totals_after, wall, tokens)
        if totals_before and totals_after
        else EngineLoad()
    )
    gaps = [g for r in ok for g in r.gaps_s]
    return LevelResult(
        clients=clients,
        requests=len(records),
        errors=len(records) - len(ok),
        wall_s=wall,
        output_tokens=tokens,
        tokens_per_s=tokens / wall if wall > 0 else float("nan"),
        ttft_p50_ms=1e3 * percentile([r.ttft_s for r in ok], 50),
        ttft_p99_ms=1e3 * percentile([r.ttft_s for r in ok], 99),
        itl_p50_ms=1e3 * percentile(gaps, 50),
        itl_p99_ms=1e3 * percentile(gaps, 99),
        error_messages=sorted({r.error for r in records if r.error is not None})[:5],
        engine_busy=load.busy,
        rows_per_step=load.rows_per_step,
        engine_tokens_per_s=load.tokens_per_s,
    )


def run(a: argparse.Namespace) -> dict[str, Any]:
    mf = read_model_file(a.model)
    tok = Tokenizer(mf)
    ids = tok.encode(reference_text(8 * a.system_tokens))[: a.system_tokens]
    system = tok.decode(ids)
    levels = [int(x) for x in a.concurrency.split(",") if x]
    rounds = max(1, a.rounds)
    results: list[SystemResult] = []
    live: list[tuple[SystemResult, Server]] = []
    try:
        for name, cmd in systems(a, str(mf.path)):
            if isinstance(cmd, str):
                results.append(SystemResult(name, note=cmd))
                continue
            srv = Server(name, cmd, port_of(cmd), "model")
            try:
                srv.start()
            except RuntimeError as exc:
                # A peer that cannot start is reported, not fatal: the others still run.
                results.append(SystemResult(name, note=str(exc)))
                print(f"{name}: {exc}", file=sys.stderr)
                continue
            srv.model = asyncio.run(served_model(srv))  # each server's own id for its model
            asyncio.run(run_level(srv, system, 1, 1, 8, WARM_UP))  # caches, pages, threads
            res = SystemResult(name)
            results.append(res)
            live.append((res, srv))
            if name == "amplituhedron" and getattr(a, "structured", False):
                # The same server under the JSON-schema workload (a row of its own).
                asyncio.run(run_level(srv, system, 1, 1, 8, WARM_UP, structured=True))
                constrained = SystemResult(STRUCTURED_NAME)
                results.append(constrained)
                live.append((constrained, srv))
        per_level: dict[str, dict[int, list[LevelResult]]] = {
            res.name: {c: [] for c in levels} for res, _ in live
        }
        for r in range(rounds):
            for res, srv in live:
                for c in levels:
                    structured = res.name == STRUCTURED_NAME
                    tag = level_tag(r, c) + ("j" if structured else "")
                    level = asyncio.run(
                        run_level(srv, system, c, a.requests, a.max_tokens, tag, structured)
                    )
                    per_level[res.name][c].append(level)
                    print(
                        f"{res.name:>24} · {c:>2} clients: {level.tokens_per_s:7.1f} tok/s · "
                        f"TTFT p50 {level.ttft_p50_ms:6.1f} ms p99 {level.ttft_p99_ms:6.1f} · "
                        f"ITL p50 {level.itl_p50_ms:5.1f} p99 {level.itl_p99_ms:5.1f} · "
                        f"errors {level.errors}"
                        + (f" · round {r + 1}/{rounds}" if rounds > 1 else ""),
                        file=sys.stderr,
                    )
    finally:
        for res, srv in live:
            if res.name != STRUCTURED_NAME:  # the same server as ours: closed once
                srv.__exit__()
    ours = per_level.get("amplituhedron", {}) if live else {}
    for res, _ in live:
        mine = per_level[res.name]
        for c in levels:
            level = combine(mine[c])
            if 1 in mine:
                level.over_one_client = median_ratio(
                    level.rounds_tokens_per_s, [x.tokens_per_s for x in mine[1]]
                )
            if res.name != "amplituhedron" and c in ours:
                level.ours_over_this = median_ratio(
                    [x.tokens_per_s for x in ours[c]], level.rounds_tokens_per_s
                )
            res.levels.append(level)
    return {
        "workload": {
            "system_tokens": a.system_tokens,
            "max_tokens": a.max_tokens,
            "requests_per_client": a.requests,
            "rounds": rounds,
            "concurrency": levels,
            "precision": a.precision,
            "kv_dtype": a.kv_dtype,
            "structured_schema": STRUCTURED_SCHEMA if getattr(a, "structured", False) else None,
        },
        "systems": [asdict(r) for r in results],
    }


def write_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in report["systems"]:
        if not s["levels"]:
            continue
        xs = [lv["clients"] for lv in s["levels"]]
        ys = [lv["tokens_per_s"] for lv in s["levels"]]
        ax.plot(xs, ys, marker="o", label=s["name"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streaming clients")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title("bench-serve: shared system prompt, unique questions, greedy")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(a: argparse.Namespace) -> int:
    report = run(a)
    ours = next(s for s in report["systems"] if s["name"] == "amplituhedron")
    base = ours["levels"][0]["tokens_per_s"] if ours["levels"] else float("nan")
    rounds = report["workload"]["rounds"]
    if rounds > 1:
        print(
            f"\n{rounds} rounds, systems and levels interleaved: medians over the rounds; "
            "× own@1 and ours × are medians of per-round ratios."
        )
    print(
        "\n| system | clients | tok/s | × ours@1 | × own@1 | ours × | TTFT p50/p99 ms "
        "| ITL p50/p99 ms | errors | engine busy | rows/step | engine tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def ratio(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}"

    def percent(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.0f} %"

    def figure(x: float | None) -> str:
        return "–" if x is None else f"{x:.1f}"

    for s in report["systems"]:
        if not s["levels"]:
            print(f"| {s['name']} | – | – | – | – | – | – | – | {s['note']} | – | – | – |")
        for lv in s["levels"]:
            own = lv["over_one_client"]
            if own is None:
                own = lv["tokens_per_s"] / s["levels"][0]["tokens_per_s"]
            print(
                f"| {s['name']} | {lv['clients']} | {lv['tokens_per_s']:.1f} | "
                f"{lv['tokens_per_s'] / base:.2f} | {own:.2f} | "
                f"{ratio(lv['ours_over_this'])} | {lv['ttft_p50_ms']:.1f} / "
                f"{lv['ttft_p99_ms']:.1f} | {lv['itl_p50_ms']:.1f} / {lv['itl_p99_ms']:.1f} | "
                f"{lv['errors']} | {percent(lv['engine_busy'])} | {figure(lv['rows_per_step'])} | "
                f"{figure(lv['engine_tokens_per_s'])} |"
            )
    constrained = next((s for s in report["systems"] if s["name"] == STRUCTURED_NAME), None)
    if constrained is not None:
        print("\nJSON schema over unconstrained, same server, same run (per-round medians):")
        for lv, free in zip(constrained["levels"], ours["levels"], strict=True):
            over = lv["ours_over_this"]
            engine = (
                lv["engine_tokens_per_s"] / free["engine_tokens_per_s"]
                if lv["engine_tokens_per_s"] and free["engine_tokens_per_s"]
                else None
            )
            throughput = 1 / over if over else None
            print(
                f"  {lv['clients']:>2} clients: throughput × {ratio(throughput)}"
                f" · engine tok/s × {ratio(engine)}"
            )
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    if a.plot:
        write_plot(report, Path(a.plot))
    return exit_status(report)


def exit_status(report: dict[str, Any]) -> int:
    """1 if our server failed any request, else 0. A peer's errors are reported in the table
    (``llama_cpp.server`` breaks concurrent streams), not taken for a failure of this bench."""
    ours = next(s for s in report["systems"] if s["name"] == "amplituhedron")
    return 0 if all(lv["errors"] == 0 for lv in ours["levels"]) else 1
