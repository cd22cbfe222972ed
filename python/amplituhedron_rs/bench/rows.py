"""``amplituhedron bench-rows``: what a decode step costs against the memory floor, and what
each extra row of a step costs (issue 46, SPEC §15).

A decode step streams every weight the model multiplies (every layer's matrices and the LM
head; one embedding row is gathered) from DRAM once, whatever the number of rows: on a
model much larger than the L3 that read is the floor of a step. The bench prints

- the bytes a decode step streams, the host's read bandwidth (``_core.ReadProbe``: the
  runtime's own workers reading a buffer larger than any cache, in the same run) and their
  quotient, the floor;
- one sequence's decode ms/token and its ratio to the floor, each decode step timed right
  after a probe of the bandwidth (it drifts on a shared host) and the ratios' median taken;
- the row-cost curve: a step of n decoding sequences (n = 1, 2, 4, 8, 16), ms per step and
  its ratio to one row's: what n streams can gain over one at most;
- the verify-cost curve: a speculative verify step of k drafted tokens is one sequence's
  forward of k + 1 rows with logits at every row (k = 1 … 8), its ratio to a plain step, and
  the speed-up it implies at a draft acceptance rate: a verify emits 1 + acceptance × k
  tokens on average (acceptance = accepted ÷ proposed drafts, as ``bench-spec`` reports it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf

from amplituhedron_rs import _core
from amplituhedron_rs.bench.host import describe_host
from amplituhedron_rs.runtime import BatchOptions, CacheOptions, Model, load_model

#: Bytes the bandwidth probe reads: larger than any L3 this runs on (up to 260 MB).
PROBE_BYTES = 1 << 30

#: The acceptance the verify curve's speed-ups assume by default: SmolLM2-135M's with
#: prompt-lookup drafts in process (``bench-spec``: 58–64 % on copy-heavy and summarise
#: prompts, docs/performance.md).
SMOLLM2_ACCEPTANCE = 0.6

#: Prompt tokens in before a verify step is timed (the drafts attend to them).
VERIFY_CONTEXT = 64


def streamed_bytes(model: Model) -> int:
    """Bytes a decode step reads from the weights: all held but the embedding, of which one
    row is gathered — unless the head is tied to it, and then read whole as the head."""
    held = int(model.weights.memory()["held"])
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(model.file.path).tensors}
    return held - sizes["token_embd.weight"] if "output.weight" in sizes else held


def step_costs(
    model: Model, rows: int, steps: int, before_step: Callable[[], object] | None = None
) -> list[float]:
    """Milliseconds of each of ``steps`` engine steps in which ``rows`` sequences decode one
    token each (after their prompts are in; greedy, the cache off); ``before_step`` runs
    before each one, untimed."""
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
        if before_step is not None:
            before_step()
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


def verify_costs(model: Model, drafts: list[int], steps: int) -> dict[int, float]:
    """Median milliseconds of one sequence's forward of k + 1 rows with logits at each (a
    verify step of k drafted tokens; k = 0 is a plain decode step), after a prompt of
    ``VERIFY_CONTEXT`` tokens; each step is rolled back, so every one sees the same context."""
    session = model.new_session(0, model.weights.n_layers)
    prompt = (model.tokenize("Verify steps count on: " + "one two three " * 40))[:VERIFY_CONTEXT]
    session.forward_tokens(prompt, logits="none")
    clock = session.clock
    costs: dict[int, float] = {}
    for k in [0, *drafts]:
        rows = prompt[: k + 1]
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            session.forward_tokens(rows, logits="all")
            times.append((time.perf_counter() - t0) * 1e3)
            session.rollback(clock)
        costs[k] = statistics.median(times)
    return costs


def measure(a: argparse.Namespace) -> dict[str, Any]:
    counts = sorted({int(n) for n in a.rows.split(",") if n})
    drafts = sorted({int(k) for k in a.drafts.split(",") if k})
    if any(not 1 <= k < VERIFY_CONTEXT for k in drafts):
        raise SystemExit(f"--drafts: each k is in 1..{VERIFY_CONTEXT - 1}, got {a.drafts}")
    probe = _core.ReadProbe(PROBE_BYTES)
    bandwidths: list[float] = []
    out: dict[str, Any] = {
        "host": describe_host(),
        "model": str(a.model),
        "acceptance": a.acceptance,
        "precisions": {},
    }
    for precision in [p for p in a.precision.split(",") if p]:
        model = load_model(
            a.model,
            cache=CacheOptions(enabled=False),
            precision=precision,
            batch=BatchOptions(max_running=max(counts, default=1)),
        )
        streamed = streamed_bytes(model)
        step_costs(model, 1, 2)  # warm-up: weights and pools in
        # Decode against the floor: each step right after a bandwidth probe, their ratio
        # per pair (on a shared host the bandwidth drifts by a third from minute to minute).
        before = len(bandwidths)
        decode = step_costs(model, 1, a.steps, lambda: bandwidths.append(probe.measure()))
        floors = [streamed / bw * 1e3 for bw in bandwidths[before:]]
        curve = {n: statistics.median(step_costs(model, n, a.steps)) for n in counts}
        one = curve.get(1) or statistics.median(decode)
        verify = verify_costs(model, drafts, a.steps) if drafts else {}
        out["streamed_bytes"] = streamed
        out["precisions"][precision] = {
            "decode_ms_per_token": statistics.median(decode),
            "floor_ms": statistics.median(floors),
            "of_floor": statistics.median(f / d for f, d in zip(floors, decode, strict=True)),
            "rows_ms": curve,
            "rows_over_one": {n: ms / one for n, ms in curve.items()},
            "verify_ms": verify,
            "verify_over_plain": {k: ms / verify[0] for k, ms in verify.items() if k},
            "verify_speedup": {
                k: (1 + a.acceptance * k) * verify[0] / ms for k, ms in verify.items() if k
            },
        }
        del model
    out["read_bandwidth_gb_s"] = statistics.median(bandwidths) / 1e9
    out["floor_ms"] = out["streamed_bytes"] / statistics.median(bandwidths) * 1e3
    return out


def main(a: argparse.Namespace) -> int:
    r = measure(a)
    print(r["host"])
    print(
        f"{r['model']}: a decode step streams {r['streamed_bytes'] / 1e6:,.1f} MB of weights; "
        f"read bandwidth (median) {r['read_bandwidth_gb_s']:.1f} GB/s (the runtime's "
        f"workers) → floor {r['floor_ms']:.1f} ms/token. Each timed decode step follows a "
        "probe of the bandwidth; floor ÷ decode is the median of those pairs' ratios."
    )
    counts = sorted(next(iter(r["precisions"].values()))["rows_ms"])
    print()
    _table(
        ["precision", "decode ms/token", "floor ms", "floor ÷ decode"],
        [f"{n} rows ms (×1)" for n in counts],
        {
            precision: [
                f"{p['decode_ms_per_token']:.1f}",
                f"{p['floor_ms']:.1f}",
                f"{p['of_floor']:.0%}",
                *(f"{p['rows_ms'][n]:.1f} ({p['rows_over_one'][n]:.2f})" for n in counts),
            ]
            for precision, p in r["precisions"].items()
        },
    )
    ks = sorted(k for k in next(iter(r["precisions"].values()))["verify_ms"] if k)
    if ks:
        print()
        print(
            f"Verify steps: one sequence, k drafted tokens = k + 1 rows with logits each, "
            f"after {VERIFY_CONTEXT} tokens; speed-up at acceptance {r['acceptance']:.0%} = "
            "(1 + acceptance × k) × plain ÷ verify"
        )
        print()
        _table(
            ["precision", "plain ms"],
            [f"k={k} ms (×plain, speed-up)" for k in ks],
            {
                precision: [
                    f"{p['verify_ms'][0]:.1f}",
                    *(
                        f"{p['verify_ms'][k]:.1f} ({p['verify_over_plain'][k]:.2f}, "
                        f"{p['verify_speedup'][k]:.2f}×)"
                        for k in ks
                    ),
                ]
                for precision, p in r["precisions"].items()
            },
        )
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0


def _table(head: list[str], columns: list[str], rows: dict[str, list[str]]) -> None:
    """A Markdown table: ``head`` and ``columns`` as its header, a row per key of ``rows``."""
    names = head + columns
    print("| " + " | ".join(names) + " |")
    print("|" + "---|" * len(names))
    for key, cells in rows.items():
        print("| " + " | ".join([key, *cells]) + " |")
