"""Parity on synthetic checkpoints at any depth, every preset × quant (a bench, not CI).

For each file it writes (or reuses, from the cache) the synthetic checkpoint, runs the
reference (llama.cpp through llama-cpp-python when it is importable, else the float64
``numpy_reference.py``; ``--engine`` picks) on the fixed sequences of
``make_synthetic_refdata.py``, frees it, then runs the runtime on the same ids, and prints
one row per file:

- max |Δlogit| between the runtime and the reference over the whole vocabulary (last
  position, largest over the sequences), for ``--precision refined`` and ``fast``;
- the tolerance basis: llama.cpp's distance to itself (llamacpp), or the distance of
  llama.cpp's roundings from exact (numpy), and the ratio of the runtime's distance to it;
- greedy agreement: tokens equal before the first difference, and where the reference's
  first near-tie (top-2 margin below twice the basis) is.

The numpy reference holds the dequantized weights in float32: 2 layers of qwen2-7b take
≈ 6 GB; full depth needs llama.cpp. Run it under the shared lock::

    flock /work/wt/heavy.lock python scripts/synthetic_parity.py --layers 2 --json parity.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from make_synthetic_refdata import (
    GREEDY,
    SEQUENCES,
    LlamaCpp,
    tokenize,
)

from amplituhedron_rs.runtime.synthetic import PRESETS, QUANTS, Spec, write_synthetic


def llamacpp_side(path: Path, sequences: dict[str, list[int]]) -> dict[str, Any]:
    ref, one = LlamaCpp(path, 2), LlamaCpp(path, 1)
    out: dict[str, Any] = {}
    for name, ids in sequences.items():
        a = ref.prefill(ids)
        b = one.prefill(ids)
        c = ref.prefill(ids, one_by_one=True)
        ref.prefill(ids)
        greedy, margins = ref.greedy(a, GREEDY)
        basis = max(np.abs(a - b).max(), np.abs(a - c).max())
        out[name] = {"logits": a, "basis": float(basis), "greedy": greedy, "margins": margins}
    ref.close()
    one.close()
    return out


def numpy_side(path: Path, sequences: dict[str, list[int]]) -> dict[str, Any]:
    from numpy_reference import Reference

    ref = Reference(path)
    out: dict[str, Any] = {}
    for name, ids in sequences.items():
        a, greedy, margins = ref.greedy(ids, GREEDY)
        basis = np.abs(a - ref.prompt_logits(ids, "llamacpp")).max()
        out[name] = {"logits": a, "basis": float(basis), "greedy": greedy, "margins": margins}
    del ref
    return out


def ours_side(path: Path, sequences: dict[str, list[int]], precision: str) -> dict[str, Any]:
    import amplituhedron_rs as ar

    model = ar.load_model(path, precision=precision)  # type: ignore[arg-type]
    out = {}
    for name, ids in sequences.items():
        g = model.generate(ids, GREEDY, use_cache=False, stop_at_eos=False)
        out[name] = {"logits": model.logits(ids), "greedy": g.output_ids}
    del model
    gc.collect()
    return out


def compare(ref: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    worst, basis, agree, tie = 0.0, 0.0, GREEDY, GREEDY
    for name, r in ref.items():
        worst = max(worst, float(np.abs(ours[name]["logits"] - r["logits"]).max()))
        basis = max(basis, r["basis"])
    for name, r in ref.items():
        same = next(
            (
                i
                for i, (x, y) in enumerate(zip(ours[name]["greedy"], r["greedy"], strict=True))
                if x != y
            ),
            GREEDY,
        )
        near = next((i for i, m in enumerate(r["margins"]) if m < 2 * basis), GREEDY)
        agree, tie = min(agree, same), min(tie, near)
    return {"max_abs": worst, "basis": basis, "greedy_agree": agree, "first_near_tie": tie}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--quants", default=",".join(QUANTS))
    p.add_argument("--layers", type=int, help="a shallower depth (default: each preset's)")
    p.add_argument("--json", type=Path, help="write the table (and the environment) here")
    p.add_argument(
        "--engine",
        choices=("llamacpp", "numpy"),
        default="llamacpp" if importlib.util.find_spec("llama_cpp") else "numpy",
        help="the reference (default: llama.cpp when llama-cpp-python is importable)",
    )
    a = p.parse_args()
    sequences = tokenize(SEQUENCES)
    rows = []
    for preset in a.presets.split(","):
        for quant in a.quants.upper().split(","):
            if quant not in QUANTS:
                raise SystemExit(f"unknown quant {quant}")
            spec = Spec(preset, quant, a.layers)
            t0 = time.perf_counter()
            w = write_synthetic(spec)
            write_s = time.perf_counter() - t0
            ref = (llamacpp_side if a.engine == "llamacpp" else numpy_side)(w.path, sequences)
            gc.collect()
            refined = compare(ref, ours_side(w.path, sequences, "refined"))
            fast = compare(ref, ours_side(w.path, sequences, "fast"))
            row = {
                "name": spec.name,
                "size": w.size,
                "blake3": w.blake3,
                "write_s": write_s if not w.reused else None,
                "refined": refined,
                "fast": fast,
            }
            rows.append(row)
            print(
                f"{spec.name:<34} max|Δ| refined {refined['max_abs']:.4f} fast "
                f"{fast['max_abs']:.4f}  basis {refined['basis']:.4f}  greedy "
                f"{refined['greedy_agree']}/{GREEDY} (fast {fast['greedy_agree']}), first "
                f"near-tie {refined['first_near_tie']}",
                flush=True,
            )
    if a.json:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        env = {
            "engine": a.engine,
            "layers": a.layers,
            "machine": platform.machine(),
            "lscpu": [line for line in cpu.splitlines() if line.startswith(("Model name", "L3"))],
        }
        a.json.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
