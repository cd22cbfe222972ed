"""``amplituhedron bench-rows``: what a decode step costs against the memory floor, and what
each extra row of a step costs (issue 46, SPEC §15).

A decode step streams every weight the model multiplies (every layer's matrices and the LM
head; one embedding row is gathered) from DRAM once, whatever the number of rows: on a
model much larger than the L3 that read is the floor of a step. The bench prints

- the bytes a decode step streams, the host's read bandwidth (two threads summing a buffer
  larger than any cache, measured in the same run) and their quotient, the floor;
- one sequence's decode ms/token and its ratio to the floor;
- the row-cost curve: a step of n decoding sequences (n = 1, 2, 4, 8, 16), ms per step and
  its ratio to one row's: what n streams can gain over one at most.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from amplituhedron_rs.bench.host import describe_host
from amplituhedron_rs.runtime import BatchOptions, CacheOptions, Model, load_model

#: Bytes the bandwidth probe reads: larger than any L3 this runs on (up to 260 MB).
PROBE_BYTES = 1 << 30


def read_bandwidth(threads: int = 2, repeats: int = 5) -> float:
    """Bytes per second read by ``threads`` threads summing disjoint halves of a buffer
    larger than the caches (numpy releases the GIL while it sums): the best of ``repeats``."""
    words = np.ones(PROBE_BYTES // 8, dtype=np.int64)
    parts = np.array_split(words, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, words.nbytes / (time.perf_counter() - t0))
    return best


def streamed_bytes(model: Model) -> int:
    """Bytes a decode step reads from the weights: all held but the embedding, of which one
    row is gathered — unless the head is tied to it, and then read whole as the head."""
    held = int(model.weights.memory()["held"])
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(model.file.path).tensors}
    return held - sizes["token_embd.weight"] if "output.weight" in sizes else held


def step_costs(model: Model, rows: int, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` engine steps in which ``rows`` sequences decode one
    token each (after their prompts are in; greedy, the cache off)."""
    # No stop tokens: every sequence decodes through every timed step.
    seqs = [
        model.engine.submit(
            list(model.tokenize(f"Sequence {i} counts on:")),
            steps + 8,
            stop_ids=[],
            use_cache=False,
        )
        for i in range(rows)
    ]
    started: set[int] = set()
    while len(started) < rows:  # prompts in, first tokens out
        for ev in model.engine.step():
            if ev.kind == "token":
                started.add(ev.seq)
            elif ev.kind == "finished":
                raise RuntimeError(f"sequence {ev.seq} ended early: {ev.reason} {ev.error}")
    costs = []
    for _ in range(steps):
        t0 = time.perf_counter()
        events = model.engine.step()
        costs.append((time.perf_counter() - t0) * 1e3)
        tokens = sum(ev.kind == "token" for ev in events)
        if tokens != rows:
            raise RuntimeError(f"a step of {rows} decoding sequences emitted {tokens} tokens")
    for s in seqs:
        model.engine.cancel(s)
    while model.engine.step():
        pass
    return costs


def measure(a: argparse.Namespace) -> dict[str, Any]:
    counts = sorted({int(n) for n in a.rows.split(",") if n})
    bandwidth = read_bandwidth(threads=a.probe_threads)
    out: dict[str, Any] = {
        "host": describe_host(),
        "model": str(a.model),
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "precisions": {},
    }
    for precision in [p for p in a.precision.split(",") if p]:
        model = load_model(
            a.model,
            cache=CacheOptions(enabled=False),
            precision=precision,
            batch=BatchOptions(max_running=max(counts)),
        )
        streamed = streamed_bytes(model)
        step_costs(model, 1, 2)  # warm-up: weights and pools in
        curve = {n: statistics.median(step_costs(model, n, a.steps)) for n in counts}
        one = curve.get(1) or statistics.median(step_costs(model, 1, a.steps))
        out["streamed_bytes"] = streamed
        out["floor_ms"] = streamed / bandwidth * 1e3
        out["precisions"][precision] = {
            "decode_ms_per_token": one,
            "of_floor": out["floor_ms"] / one,
            "rows_ms": curve,
            "rows_over_one": {n: ms / one for n, ms in curve.items()},
        }
        del model
    return out


def main(a: argparse.Namespace) -> int:
    r = measure(a)
    print(r["host"])
    print(
        f"{r['model']}: a decode step streams {r['streamed_bytes'] / 1e6:,.1f} MB of weights; "
        f"read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s ({a.probe_threads} threads) "
        f"→ floor {r['floor_ms']:.1f} ms/token"
    )
    counts = sorted(next(iter(r["precisions"].values()))["rows_ms"])
    print()
    print(
        "| precision | decode ms/token | floor ÷ decode | "
        + " | ".join(f"{n} rows ms (×1)" for n in counts)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(counts))
    for precision, p in r["precisions"].items():
        cells = " | ".join(f"{p['rows_ms'][n]:.1f} ({p['rows_over_one'][n]:.2f})" for n in counts)
        print(f"| {precision} | {p['decode_ms_per_token']:.1f} | {p['of_floor']:.0%} | {cells} |")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0
