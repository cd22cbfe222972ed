"""``amplituhedron synth``: write a synthetic checkpoint of a real model's shape."""

from __future__ import annotations

import argparse

HELP = "write a synthetic GGUF of a real model's shape (random weights; see docs/synthetic.md)"
DESCRIPTION = (
    "Writes a deterministic GGUF with a real model's architecture metadata, random quantized "
    "weights (std ~ 1/sqrt(fan_in)) and the bundled SmolLM2 tokenizer padded to the "
    "vocabulary. Without -o it goes to the cache (~/.cache/amplituhedron/synthetic), where "
    "--model synthetic:PRESET[:QUANT][:layers=N][:seed=S] finds it."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from amplituhedron_rs.runtime.synthetic import PRESETS, QUANTS

    p.add_argument("preset", choices=list(PRESETS), help="the shape")
    p.add_argument("-o", "--output", metavar="FILE", help="where to write (default: the cache)")
    p.add_argument("--layers", type=int, metavar="N", help="a shallow variant: the first N layers")
    p.add_argument(
        "--quant",
        type=str.upper,
        choices=list(QUANTS),
        default="Q4_0",
        help="Q4_0 (Q8_0 embeddings and head), Q8_0, or Q4_K_M (llama.cpp's mix: Q4_K, Q6_K "
        "head and some attn_v/ffn_down)",
    )
    p.add_argument(
        "--seed", type=int, default=0, metavar="S", help="the random weights' seed (default: 0)"
    )


def run(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from amplituhedron_rs.runtime.synthetic import Spec, planned_size, write_synthetic

    spec = Spec(a.preset, a.quant, a.layers, a.seed)
    out = Console(stderr=True)
    size = planned_size(spec)
    with Progress(
        "{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=out
    ) as bar:
        task = bar.add_task(spec.name, total=size)
        w = write_synthetic(
            spec, a.output, progress=lambda done, total: bar.update(task, completed=done)
        )
        bar.update(task, completed=size)
    how = "reused" if w.reused else f"written in {w.seconds:.1f} s"
    out.print(f"{w.path}  {w.size:,} bytes, {how}", highlight=False)
    print(f"{w.blake3}  {w.path}")
    return 0
