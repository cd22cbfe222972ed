"""``amplituhedron bench-mesh``: what the HTTP mesh costs and what the volume cache saves.

For each mesh size K (default 1, 2, 3, 5 stations on loopback), one run measures a cold
session (cache miss: pipelined prefill + capture), a warm session (all stations replay, no
prefill) and the decode rate, next to the single-process runtime measured in the same run.
The per-hop overhead is ``(mesh decode ms/token − single-process ms/token) / K``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import urllib.request
from typing import Any

from amplituhedron_rs.bench.memory import measure_memory, memory_table
from amplituhedron_rs.bench.report import write_json
from amplituhedron_rs.bench.textsource import text_of_tokens
from amplituhedron_rs.mesh.coordinator import Coordinator
from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec
from amplituhedron_rs.mesh.protocol import DECODE_ROUTE
from amplituhedron_rs.runtime import load_model


def decode_handling_seconds(spec: MeshSpec) -> list[tuple[float, float]]:
    """Per station: (seconds spent handling decode requests, number of them), from the
    station's own request-latency histogram."""
    out = []
    for s in spec.stations:
        text = urllib.request.urlopen(f"{s.url}/metrics", timeout=10).read().decode()
        total = count = 0.0
        for line in text.splitlines():
            if f'endpoint="{DECODE_ROUTE}"' not in line:
                continue
            if line.startswith("amplituhedron_request_seconds_sum"):
                total = float(line.split()[-1])
            elif line.startswith("amplituhedron_request_seconds_count"):
                count = float(line.split()[-1])
        out.append((total, count))
    return out


async def _mesh_sessions(
    c: Coordinator, spec: MeshSpec, prompt: list[int], new_tokens: int, repeats: int
) -> dict[str, Any]:
    await c.clear()
    cold = await c.generate(prompt, new_tokens)
    before = decode_handling_seconds(spec)
    warm = [await c.generate(prompt, new_tokens) for _ in range(repeats)]
    after = decode_handling_seconds(spec)
    assert all(w.cache_hit for w in warm), "a warm session missed the cache"
    decode = [w.decode_ms / max(1, new_tokens - 1) for w in warm]
    # What each station spent inside its handler per decode step, and so what is left for
    # the transport (client, loopback, server framework before the handler).
    station_ms = [
        (t1 - t0) / max(1.0, n1 - n0) * 1e3
        for (t0, n0), (t1, n1) in zip(before, after, strict=True)
    ]
    return {
        "station_decode_ms": station_ms,
        "cold": cold.to_json(),
        "warm": [w.to_json() for w in warm],
        "cold_latency_ms": cold.latency_ms,
        "warm_latency_ms": statistics.median(w.latency_ms for w in warm),
        "decode_ms_per_token": statistics.median(decode),
        "same_tokens": all(w.output_ids == cold.output_ids for w in warm),
    }


def _transport_ms(r: dict[str, Any], k: int) -> float:
    return float(r["decode_ms_per_token"] - sum(r["station_decode_ms"])) / k


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    err = Console(stderr=True)
    with err.status("loading model…"):
        model = load_model(args.model)
    prompt = text_of_tokens(model.tokenize, args.prompt_tokens)
    model.generate(prompt[:16], 4, use_cache=False)
    single = [
        model.generate(prompt, args.new_tokens, use_cache=False, stop_at_eos=False)
        for _ in range(args.repeats)
    ]
    single_decode = statistics.median(g.decode_ms / max(1, args.new_tokens - 1) for g in single)
    single_prefill = statistics.median(g.prefill_ms for g in single)
    model.clear_cache()
    report: dict[str, Any] = {
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "single_process": {"decode_ms_per_token": single_decode, "prefill_ms": single_prefill},
        "meshes": {},
    }
    del model  # free the single-process weights' pages before the stations map theirs
    table = Table(title=f"{len(prompt)}-token prompt, {args.new_tokens} new tokens")
    for col in (
        "stations",
        "cold latency",
        "warm latency",
        "warm/cold",
        "decode ms/token",
        "per-hop overhead",
    ):
        table.add_column(col, justify="right")
    table.add_row(
        "1 process", f"{single_prefill:.0f} ms prefill", "—", "—", f"{single_decode:.2f}", "—"
    )
    for k in args.stations:
        with err.status(f"{k} stations…"), LocalMesh(k, model_path=args.model) as spec:

            async def measure() -> dict[str, Any]:
                async with Coordinator(spec, chunk=args.chunk) as c:
                    return await _mesh_sessions(c, spec, prompt, args.new_tokens, args.repeats)

            r = asyncio.run(measure())
            r["memory"] = measure_memory(spec, args.model)
        r["per_hop_overhead_ms"] = (r["decode_ms_per_token"] - single_decode) / k
        r["per_hop_transport_ms"] = _transport_ms(r, k)
        report["meshes"][str(k)] = r
        table.add_row(
            str(k),
            f"{r['cold_latency_ms']:.0f} ms",
            f"{r['warm_latency_ms']:.0f} ms",
            f"{r['warm_latency_ms'] / r['cold_latency_ms']:.2f}",
            f"{r['decode_ms_per_token']:.2f}",
            f"{r['per_hop_overhead_ms']:.2f} ms",
            f"{r['per_hop_transport_ms']:.2f} ms",
        )
    err.print(table)
    for k, r in report["meshes"].items():
        err.print(memory_table(r["memory"], f"{k} stations: memory per station (MB)"))
    err.print(
        "[dim]per hop: total = (mesh − single-process decode) / K; transport = (mesh decode − "
        "the stations' own handling time) / K. The difference is the stations' compute "
        "resuming after idling while the others run — on one shared host, not the wire.[/dim]"
    )
    return report


def main(args: argparse.Namespace) -> int:
    write_json(args.json, run(args))
    return 0
