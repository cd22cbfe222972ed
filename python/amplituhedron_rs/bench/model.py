"""``amplituhedron bench-model``: the single-process runtime against llama.cpp, same GGUF.

Measures, in one run and on the same 256-token prompt of real text: prefill time, decode
ms/token, capture and replay time of the prompt's volume — and, when ``llama-cpp-python``
is installed (the optional ``peers`` extra), llama.cpp with 2 threads: prefill, decode, and
``llama_state_seq_get_data`` / ``set_data`` for the same prompt. Prints ratios (> 1 means
this runtime is faster); ``--json`` writes every raw timing.

``--long-stream`` adds the RoPE strategy's quality check (SPEC §3): the mean next-token loss
of a long text stream through a small ring (the window wraps many times) against a
full-context run of the same stream.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from amplituhedron_rs.bench.report import write_json
from amplituhedron_rs.bench.textsource import text_of_tokens
from amplituhedron_rs.runtime import Model, SessionOptions, load_model


@dataclass
class Timing:
    """Repeated measurements of one quantity, in milliseconds."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    @property
    def best(self) -> float:
        return min(self.samples) if self.samples else float("nan")


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def measure_runtime(
    model: Model, prompt: list[int], *, runs: int, decode_tokens: int
) -> dict[str, Timing]:
    """Prefill, decode, capture and replay of ``prompt`` on this runtime."""
    out = {
        k: Timing()
        for k in ("prefill", "decode_per_token", "capture", "replay", "replay_fresh_pages")
    }
    n_layers = model.n_layers
    # Replay target: a reused (reset) session, as the runtime and the stations use — its ring
    # pages are resident, like llama.cpp's preallocated KV. A never-touched ring pays page
    # faults on first write; that is measured separately.
    reused = model.new_session(0, n_layers)
    reused.forward_tokens(prompt)
    for _ in range(runs):
        s = model.new_session(0, n_layers)
        t0 = time.perf_counter()
        hidden, logits = s.forward_tokens(prompt)
        out["prefill"].samples.append(_ms(t0))
        assert logits is not None
        model.clear_cache()
        t0 = time.perf_counter()
        nbytes = model.pipeline.amplituhedron_capture(s, prompt, hidden[-1], logits[-1])
        out["capture"].samples.append(_ms(t0))
        assert nbytes > 0, "the volume was not captured"
        reused.reset()
        t0 = time.perf_counter()
        replay = model.pipeline.amplituhedron_replay(reused, prompt)
        out["replay"].samples.append(_ms(t0))
        assert replay is not None and replay.status == "hit"
        fresh = model.new_session(0, n_layers)
        t0 = time.perf_counter()
        model.pipeline.amplituhedron_replay(fresh, prompt)
        out["replay_fresh_pages"].samples.append(_ms(t0))
        g = model.generate(prompt, decode_tokens, use_cache=False, stop_at_eos=False)
        out["decode_per_token"].samples.append(g.decode_ms / max(1, decode_tokens - 1))
    return out


def measure_llamacpp(
    model_path: str, prompt: list[int], *, runs: int, decode_tokens: int, threads: int
) -> dict[str, Any] | None:
    """The same measurements on llama.cpp (llama-cpp-python), or None if not installed."""
    from amplituhedron_rs.bench.peers import LlamaCpp

    peer = LlamaCpp.load(model_path, threads=threads)
    if isinstance(peer, str):
        return None
    out = {k: Timing() for k in ("prefill", "decode_per_token", "state_get", "state_set")}
    state_bytes = 0
    for _ in range(runs):
        peer.fresh()
        t0 = time.perf_counter()
        logits = peer.prefill(prompt)
        out["prefill"].samples.append(_ms(t0))
        t0 = time.perf_counter()
        state = peer.save_state()
        out["state_get"].samples.append(_ms(t0))
        state_bytes = state[1]
        peer.fresh()
        t0 = time.perf_counter()
        peer.restore_state(state, prompt)
        out["state_set"].samples.append(_ms(t0))
        # Decode one token at a time after the prompt (greedy), like ours.
        t0 = time.perf_counter()
        peer.greedy(logits, decode_tokens)
        out["decode_per_token"].samples.append(_ms(t0) / max(1, decode_tokens - 1))
    result: dict[str, Any] = dict(out)
    result["state_bytes"] = state_bytes
    result["version"] = peer.version
    return result


def stream_loss(
    model: Model, stream: list[int], options: SessionOptions, *, skip: int, chunk: int = 256
) -> float:
    """Mean next-token negative log-likelihood of ``stream`` after position ``skip``."""
    s = model.new_session(0, model.n_layers, options)
    losses: list[float] = []
    for start in range(0, len(stream) - 1, chunk):
        piece = stream[start : start + chunk]
        _, logits = s.forward_tokens(piece, logits="all")
        assert logits is not None
        targets = stream[start + 1 : start + 1 + len(piece)]
        for i, target in enumerate(targets):
            if start + i + 1 <= skip:
                continue
            row = logits[i].astype(np.float64)
            m = row.max()
            losses.append(float(m + np.log(np.exp(row - m).sum()) - row[target]))
    return float(np.mean(losses))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    err = Console(stderr=True)
    report: dict[str, Any] = {"prompt_tokens": args.prompt_tokens, "runs": args.runs}
    with err.status("loading model…"):
        model = load_model(args.model, precision=args.precision, kv_dtype=args.kv_dtype)
    report["precision"] = args.precision
    report["kv_dtype"] = args.kv_dtype
    prompt = text_of_tokens(model.tokenize, args.prompt_tokens)
    with err.status(f"measuring this runtime ({args.runs} runs)…"):
        model.generate(prompt[:16], 4, use_cache=False)  # warm the pages and the pool
        ours = measure_runtime(model, prompt, runs=args.runs, decode_tokens=args.max_tokens)
    report["runtime"] = {k: asdict(v) | {"median": v.median} for k, v in ours.items()}
    with err.status("measuring llama.cpp (if installed)…"):
        peer = measure_llamacpp(
            str(model.file.path),
            prompt,
            runs=args.runs,
            decode_tokens=args.max_tokens,
            threads=args.llamacpp_threads,
        )
    table = Table(title=f"{args.prompt_tokens}-token prompt · medians of {args.runs} runs")
    table.add_column("measure")
    table.add_column("amplituhedron-rs", justify="right")
    table.add_column("llama.cpp", justify="right")
    table.add_column("ratio (llama.cpp / ours)", justify="right")
    ratios: dict[str, float] = {}

    def row(name: str, ours_ms: float, theirs_ms: float | None, key: str) -> None:
        if theirs_ms is None:
            table.add_row(name, f"{ours_ms:.2f} ms", "—", "—")
            return
        ratio = theirs_ms / ours_ms
        ratios[key] = ratio
        table.add_row(name, f"{ours_ms:.2f} ms", f"{theirs_ms:.2f} ms", f"{ratio:.2f}×")

    med = {k: v.median for k, v in ours.items()}
    if peer is not None:
        report["llamacpp"] = {
            k: (asdict(v) | {"median": v.median}) if isinstance(v, Timing) else v
            for k, v in peer.items()
        }
        pm = {k: v.median for k, v in peer.items() if isinstance(v, Timing)}
        row("prefill", med["prefill"], pm["prefill"], "prefill_speedup")
        row("decode / token", med["decode_per_token"], pm["decode_per_token"], "decode_speedup")
        row("replay vs state restore", med["replay"], pm["state_set"], "replay_vs_state_set")
        row("capture vs state save", med["capture"], pm["state_get"], "capture_vs_state_get")
    else:
        report["llamacpp"] = None
        for name, key in [
            ("prefill", "prefill"),
            ("decode / token", "decode_per_token"),
            ("replay", "replay"),
            ("capture", "capture"),
        ]:
            row(name, med[key], None, key)
    ratios["prefill_over_replay"] = med["prefill"] / med["replay"]
    report["ratios"] = ratios
    err.print(table)
    err.print(
        f"replay of the {args.prompt_tokens}-token volume takes {med['replay']:.2f} ms, "
        f"{ratios['prefill_over_replay']:.0f}× less than its prefill ({med['prefill']:.1f} ms); "
        f"into a never-touched ring (page faults) {med['replay_fresh_pages']:.2f} ms"
    )
    if peer is None:
        err.print("[dim]llama.cpp not installed: pip install 'amplituhedron-rs[peers]'[/dim]")
    if args.long_stream:
        stream = text_of_tokens(model.tokenize, args.long_stream, offset=args.prompt_tokens)
        window = SessionOptions(slots=args.stream_slots, recall=0)
        sinks = SessionOptions(slots=args.stream_slots, recall=0, n_sys=4)
        full = SessionOptions(slots=min(8192, args.long_stream + 64), recall=0)
        skip = args.stream_slots
        with err.status(f"long stream: {args.long_stream} tokens through three KV layouts…"):
            losses = {
                "full_context": stream_loss(model, stream, full, skip=skip),
                "ring": stream_loss(model, stream, window, skip=skip),
                "ring_with_4_anchor_sinks": stream_loss(model, stream, sinks, skip=skip),
            }
        report["long_stream"] = {
            "tokens": args.long_stream,
            "slots": args.stream_slots,
            "scored_after": skip,
            "mean_nll": losses,
        }
        t2 = Table(title=f"long stream ({args.long_stream} tokens, ring of {args.stream_slots})")
        t2.add_column("KV layout")
        t2.add_column("mean NLL (nats)", justify="right")
        t2.add_column("perplexity", justify="right")
        for k, v in losses.items():
            t2.add_row(k, f"{v:.4f}", f"{np.exp(v):.2f}")
        err.print(t2)
    return report


def main(args: argparse.Namespace) -> int:
    write_json(args.json, run(args))
    return 0
