"""Makes tests/refdata/synthetic_reference.json: reference logits on shallow synthetic
checkpoints (run once, not in CI; the files are deterministic, so CI regenerates them and
needs neither llama.cpp nor this script).

For every case (preset × quant at a shallow depth) it writes the synthetic file
(``amplituhedron_rs.runtime.synthetic``), records its BLAKE3, and runs a reference engine on
a few fixed token sequences:

- ``--engine llamacpp`` (llama-cpp-python, when it is importable): llama.cpp itself, the
  prompt in one batch with 2 threads; the tolerance basis is llama.cpp's distance to itself
  (1 vs 2 threads; the prompt one token at a time, so every matmul is a matrix-vector
  product);
- ``--engine numpy`` (``numpy_reference.py``: ggml-org's dequantizers and llama.cpp's graph
  in float64, no code shared with the runtime): exact logits; the tolerance basis is the
  distance between exact and the same graph with llama.cpp's roundings (8-bit activations
  into every quantized matmul, f16 Q/KV/softmax weights): how far llama.cpp's arithmetic
  sits from exact.

Stored per sequence: the top ``TOP`` logits plus ``SAMPLE`` logits at fixed ids spread over
the vocabulary (the file stays small; max |Δ| over these ids is what the test measures), the
mean and standard deviation over the whole vocabulary, and a greedy continuation of
``GREEDY`` tokens with the top-2 margin at each step. Per case: ``tolerance`` =
``TOLERANCE_FACTOR`` × the basis (the runtime and llama.cpp are each about one basis from
exact, so from each other within two).

    python scripts/make_synthetic_refdata.py --out tests/refdata
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from amplituhedron_rs.runtime.synthetic import Spec, write_synthetic

#: (preset, quant, layers) of the committed references: one layer of each architecture's
#: smallest preset, so CI writes each file in seconds; between them every tensor type the
#: writer makes (Q4_0, Q8_0, Q4_K, Q6_K), Qwen2's biases and halves-RoPE, Llama 3's
#: ``rope_freqs`` and adjacent-pair RoPE. ``synthetic_parity.py`` covers the rest.
CASES = [
    ("llama3-1b", "Q4_K_M", 1),
    ("llama3-1b", "Q4_0", 1),
    ("qwen2-1.5b", "Q8_0", 1),
    ("qwen2-1.5b", "Q4_0", 1),
]
#: The tolerance, in units of the engine's basis (see the module's docstring).
TOLERANCE_FACTOR = 2.0
#: Token sequences (ids of the bundled SmolLM2 tokenizer, which every synthetic file has):
#: a sentence, code, the chat template's opening, and a longer mixed one (past 64 positions,
#: where Llama 3's slow RoPE pairs have turned).
SEQUENCES = {
    "sentence": "Water boils at one hundred degrees Celsius at sea level, but at high altitude",
    "code": "fn fibonacci(n: u64) -> u64 {\n    match n {\n        0 => 0,\n        1 => 1,\n",
    "chat": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a planet."
    "<|im_end|>\n<|im_start|>assistant\n",
    "long": "The history of the printing press begins with movable type in East Asia and "
    "reaches Europe in the fifteenth century, where Johannes Gutenberg combined a screw "
    "press, oil-based ink and a hand mould for casting type. Within fifty years presses ran "
    "in more than two hundred cities, and the price of books fell by two thirds.",
}
TOP = 32
SAMPLE = 512
GREEDY = 8


def sample_ids(vocab: int) -> list[int]:
    """``SAMPLE`` ids spread evenly over the vocabulary (the same for every file)."""
    return [int(i) for i in np.linspace(0, vocab - 1, SAMPLE).round()]


class LlamaCpp:
    """One llama.cpp context over a file."""

    def __init__(self, path: Path, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=512,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.vocab = int(self.llm.n_vocab())

    def fresh(self) -> None:
        self.llm.reset()
        lib, ctx = self.lib, self.llm.ctx
        if hasattr(lib, "llama_get_memory"):
            lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        else:
            lib.llama_kv_self_clear(ctx)

    def last(self) -> np.ndarray[Any, Any]:
        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,)).astype(np.float32)

    def prefill(self, ids: list[int], *, one_by_one: bool = False) -> np.ndarray[Any, Any]:
        self.fresh()
        if one_by_one:
            for t in ids:
                self.llm.eval([t])
        else:
            self.llm.eval(ids)
        return self.last()

    def greedy(self, logits: np.ndarray[Any, Any], n: int) -> tuple[list[int], list[float]]:
        ids, margins = [], []
        for _ in range(n):
            top2 = np.sort(logits)[-2:]
            margins.append(float(top2[1] - top2[0]))
            ids.append(int(np.argmax(logits)))
            self.llm.eval([ids[-1]])
            logits = self.last()
        return ids, margins

    def close(self) -> None:
        self.llm.close()


def tokenize(texts: dict[str, str]) -> dict[str, list[int]]:
    from amplituhedron_rs.runtime.gguf_file import read_model_file
    from amplituhedron_rs.runtime.tokenizer import Tokenizer

    tok = Tokenizer(read_model_file(None))
    return {name: tok.encode(text) for name, text in texts.items()}


def llamacpp_case(path: Path, sequences: dict[str, list[int]]) -> tuple[dict[str, Any], float]:
    """llama.cpp's logits and greedy continuations, and its distance to itself."""
    ref, one_thread = LlamaCpp(path, 2), LlamaCpp(path, 1)
    out, basis = {}, 0.0
    for name, ids in sequences.items():
        a = ref.prefill(ids)
        b = one_thread.prefill(ids)
        c = ref.prefill(ids, one_by_one=True)
        basis = max(basis, float(max(np.abs(a - b).max(), np.abs(a - c).max())))
        ref.prefill(ids)
        greedy, margins = ref.greedy(a, GREEDY)
        out[name] = (a, greedy, margins)
    ref.close()
    one_thread.close()
    return out, basis


def numpy_case(path: Path, sequences: dict[str, list[int]]) -> tuple[dict[str, Any], float]:
    """Exact logits and greedy continuations, and llama.cpp's roundings' distance to them."""
    from numpy_reference import Reference

    ref = Reference(path)
    out, basis = {}, 0.0
    for name, ids in sequences.items():
        a, greedy, margins = ref.greedy(ids, GREEDY)
        emulated = ref.prompt_logits(ids, "llamacpp")
        basis = max(basis, float(np.abs(a - emulated).max()))
        out[name] = (a, greedy, margins)
    return out, basis


def run_case(
    spec: Spec, workdir: Path, sequences: dict[str, list[int]], engine: str
) -> dict[str, Any]:
    path = workdir / spec.file_name
    w = write_synthetic(spec, path)
    print(f"{spec.name}: {w.size:,} bytes in {w.seconds:.1f} s, BLAKE3 {w.blake3}", flush=True)
    results, basis = (llamacpp_case if engine == "llamacpp" else numpy_case)(path, sequences)
    out: dict[str, Any] = {
        "name": spec.name,
        "preset": spec.preset,
        "quant": spec.quant,
        "layers": spec.layers,
        "seed": spec.seed,
        "size": w.size,
        "blake3": w.blake3,
        "engine": engine,
        "tolerance_basis": basis,
        "tolerance": float(f"{TOLERANCE_FACTOR * basis:.2g}"),
        "sequences": {},
    }
    for name, ids in sequences.items():
        a, greedy, margins = results[name]
        if not np.isfinite(a).all():
            raise SystemExit(f"{spec.name} {name}: the reference gives non-finite logits")
        top = np.argsort(-a, kind="stable")[:TOP]
        out["sequences"][name] = {
            "ids": ids,
            "top_ids": [int(i) for i in top],
            "top_logits": [float(a[i]) for i in top],
            "sample_logits": [float(a[i]) for i in sample_ids(len(a))],
            "mean": float(a.mean()),
            "std": float(a.std()),
            "greedy_ids": greedy,
            "greedy_margins": margins,
        }
        print(f"  {name}: {len(ids)} ids, greedy {greedy}", flush=True)
    print(f"  tolerance basis {basis:.2e}", flush=True)
    path.unlink()
    return out


def versions(engine: str) -> dict[str, str]:

    if engine == "llamacpp":
        import llama_cpp

        return {"llama_cpp_python": str(llama_cpp.__version__)}
    return {"gguf": importlib.metadata.version("gguf")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("tests/refdata"))
    p.add_argument("--workdir", type=Path, help="where the files are written (default: a temp dir)")
    p.add_argument("--only", help="only cases whose name contains this")
    p.add_argument(
        "--engine",
        choices=("llamacpp", "numpy"),
        default="llamacpp" if importlib.util.find_spec("llama_cpp") else "numpy",
        help="the reference (default: llama.cpp when llama-cpp-python is importable)",
    )
    a = p.parse_args()

    sequences = tokenize(SEQUENCES)
    cases = [Spec(preset, quant, layers) for preset, quant, layers in CASES]
    if a.only:
        cases = [c for c in cases if a.only in c.name]
    target = a.out / "synthetic_reference.json"
    previous = json.loads(target.read_text()) if target.is_file() and a.only else {"cases": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        done = [run_case(spec, Path(tmp), sequences, a.engine) for spec in cases]
    names = {c["name"] for c in done}
    kept = [c for c in previous["cases"] if c["name"] not in names]
    report = {
        "made_by": "scripts/make_synthetic_refdata.py",
        "engine": a.engine,
        "versions": versions(a.engine),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "tolerance_factor": TOLERANCE_FACTOR,
        "top": TOP,
        "sample": SAMPLE,
        "greedy": GREEDY,
        "cases": sorted(kept + done, key=lambda c: str(c["name"])),
    }
    target.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"wrote {target} ({target.stat().st_size:,} bytes) in {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
