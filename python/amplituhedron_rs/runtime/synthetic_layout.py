"""What a synthetic checkpoint contains (SPEC §15): the presets (real models' shapes), the
quant mixes, and every tensor and metadata key of the file a :class:`Spec` names. Writing,
naming and caching the file are :mod:`.synthetic`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from amplituhedron_rs.runtime import gguf_writer as gw
from amplituhedron_rs.runtime import random_blocks as rb
from amplituhedron_rs.runtime.gguf_file import (
    SYNTHETIC_PREFIX,
    ModelFileError,
    bundled_model_path,
    read_gguf,
)

QUANTS = ("Q4_0", "Q8_0", "Q4_K_M")
#: llama.cpp's ``general.file_type`` of each mix (``llama_ftype``).
_FILE_TYPE = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}
_UNUSED_TOKEN = 5  # ggml token type UNUSED (what llama.cpp's converter gives padding)
_BIAS_STD = 0.02


class SyntheticError(ModelFileError):
    """A synthetic model cannot be named or written (bad preset, quant, layer count; no room
    on disk). Also a ``ValueError``."""


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1/3.2 RoPE frequency scaling (HF ``rope_scaling`` with ``rope_type: llama3``),
    which llama.cpp's converter turns into the ``rope_freqs.weight`` tensor."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def factors(self, head_dim: int, base: float) -> np.ndarray[Any, np.dtype[np.float32]]:
        """Per-pair divisors of the rotation frequencies (convert_hf_to_gguf's rule: 1 for
        short wavelengths, ``factor`` for long ones, a smooth blend between)."""
        out = []
        low_wavelen = self.original_context / self.low_freq_factor
        high_wavelen = self.original_context / self.high_freq_factor
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi * base ** (i / head_dim)
            if wavelen < high_wavelen:
                out.append(1.0)
            elif wavelen > low_wavelen:
                out.append(self.factor)
            else:
                smooth = (self.original_context / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor
                )
                out.append(1.0 / ((1 - smooth) / self.factor + smooth))
        return np.asarray(out, dtype="<f4")


@dataclass(frozen=True)
class Preset:
    """A real model's shape, as its HF ``config.json`` gives it."""

    name: str
    arch: str
    source: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    rope_base: float
    rms_eps: float
    context_len: int
    tied: bool
    rope_scaling: Llama3RopeScaling | None = None

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "qwen2-7b", "qwen2", "Qwen2.5-Coder-7B (the seeds' qwen-coder-7b)",
            28, 3584, 18944, 28, 4, 128, 152064, 1e6, 1e-6, 32768, tied=False,
        ),
        Preset(
            "qwen2-1.5b", "qwen2", "Qwen2-1.5B",
            28, 1536, 8960, 12, 2, 128, 151936, 1e6, 1e-6, 131072, tied=True,
        ),
        Preset(
            "llama3-1b", "llama", "Llama 3.2 1B",
            16, 2048, 8192, 32, 8, 64, 128256, 500000.0, 1e-5, 131072, tied=True,
            rope_scaling=Llama3RopeScaling(32.0),
        ),
        Preset(
            "llama3-8b", "llama", "Llama 3.1 8B",
            32, 4096, 14336, 32, 8, 128, 128256, 500000.0, 1e-5, 131072, tied=False,
            rope_scaling=Llama3RopeScaling(8.0),
        ),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """What a synthetic file is a function of."""

    preset: str
    quant: str = "Q4_0"
    layers: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise SyntheticError(
                f"unknown synthetic preset {self.preset!r} (presets: {', '.join(PRESETS)})"
            )
        if self.quant not in QUANTS:
            raise SyntheticError(
                f"unknown synthetic quant {self.quant!r} (quants: {', '.join(QUANTS)})"
            )
        full = PRESETS[self.preset].n_layers
        if self.layers is not None and not 1 <= self.layers <= full:
            raise SyntheticError(f"{self.preset} has 1..{full} layers, not {self.layers}")
        if not 0 <= self.seed < 2**63:
            raise SyntheticError(f"the seed must be in 0..2**63, not {self.seed}")

    @property
    def n_layers(self) -> int:
        return self.layers if self.layers is not None else PRESETS[self.preset].n_layers

    def canonical(self) -> Spec:
        """The same file, with ``layers`` None when it is the preset's depth."""
        full = self.layers == PRESETS[self.preset].n_layers
        return replace(self, layers=None) if full else self

    @property
    def name(self) -> str:
        """``synthetic:qwen2-7b:q4_0:layers=2:seed=0`` (the canonical model name)."""
        s = self.canonical()
        parts = [f"{SYNTHETIC_PREFIX}{s.preset}", s.quant.lower()]
        if s.layers is not None:
            parts.append(f"layers={s.layers}")
        if s.seed:
            parts.append(f"seed={s.seed}")
        return ":".join(parts)

    @property
    def file_name(self) -> str:
        s = self.canonical()
        depth = f"-{s.layers}l" if s.layers is not None else ""
        return f"{s.preset}-{s.quant.lower()}{depth}-seed{s.seed}-r{rb.RECIPE_VERSION}.gguf"


# ----- the tensors of a file -----------------------------------------------------------------


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's layer rule for the Q6_K tensors of Q4_K_M (first and last eighth, and
    every third layer between)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(spec: Spec, name: str) -> int:
    """The ggml type of a matrix in this mix.

    - Q4_0: every layer matrix Q4_0; the embeddings and the head Q8_0.
    - Q8_0: everything Q8_0.
    - Q4_K_M (llama.cpp's rules for a dense model): Q4_K, except the head (and a tied
      embedding, which is the head) Q6_K, and ``attn_v``/``ffn_down`` Q6_K in the layers
      ``use_more_bits`` picks; an untied ``token_embd`` stays Q4_K.
    """
    p = PRESETS[spec.preset]
    head = name == "output.weight" or (p.tied and name == "token_embd.weight")
    if spec.quant == "Q8_0":
        return rb.Q8_0
    if spec.quant == "Q4_0":
        return rb.Q8_0 if name in ("token_embd.weight", "output.weight") else rb.Q4_0
    if head:
        return rb.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        return rb.Q6_K if _use_more_bits(layer, spec.n_layers) else rb.Q4_K
    return rb.Q4_K


def _matrix(spec: Spec, name: str, rows: int, cols: int, fan_in: int) -> gw.TensorPlan:
    ggml_type = tensor_type(spec, name)
    per_block, block_bytes = rb.LAYOUT[ggml_type]
    n_blocks = rows * cols // per_block
    sigma = 1.0 / math.sqrt(fan_in)
    return gw.TensorPlan(
        name,
        ggml_type,
        (cols, rows),
        n_blocks * block_bytes,
        lambda: rb.quantized_chunks(ggml_type, spec.seed, name, n_blocks, sigma),
    )


def _vector(name: str, data: np.ndarray[Any, Any]) -> gw.TensorPlan:
    return gw.TensorPlan(name, rb.F32, (data.size // 4,), data.size, lambda: iter([data]))


def tensor_plans(spec: Spec) -> list[gw.TensorPlan]:
    """Every tensor, layer by layer (so a station's layers are contiguous in the file)."""
    p = PRESETS[spec.preset]
    q_dim, kv_dim = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
    plans: list[gw.TensorPlan] = []
    if p.rope_scaling is not None:
        plans.append(
            _vector(
                "rope_freqs.weight", p.rope_scaling.factors(p.head_dim, p.rope_base).view(np.uint8)
            )
        )
    plans.append(_matrix(spec, "token_embd.weight", p.vocab, p.hidden, p.hidden))
    ones = rb.constant_f32(p.hidden, 1.0)
    for i in range(spec.n_layers):
        n = f"blk.{i}."
        plans.append(_vector(n + "attn_norm.weight", ones))
        for proj, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            plans.append(_matrix(spec, f"{n}{proj}.weight", rows, p.hidden, p.hidden))
            if p.qkv_bias:
                bias = rb.uniform_f32(spec.seed, f"{n}{proj}.bias", rows, _BIAS_STD)
                plans.append(_vector(f"{n}{proj}.bias", bias))
        plans.append(_matrix(spec, n + "attn_output.weight", p.hidden, q_dim, q_dim))
        plans.append(_vector(n + "ffn_norm.weight", ones))
        plans.append(_matrix(spec, n + "ffn_gate.weight", p.ffn, p.hidden, p.hidden))
        plans.append(_matrix(spec, n + "ffn_up.weight", p.ffn, p.hidden, p.hidden))
        plans.append(_matrix(spec, n + "ffn_down.weight", p.hidden, p.ffn, p.ffn))
    plans.append(_vector("output_norm.weight", ones))
    if not p.tied:
        plans.append(_matrix(spec, "output.weight", p.vocab, p.hidden, p.hidden))
    return plans


# ----- the metadata --------------------------------------------------------------------------


def _tokenizer_meta(vocab: int) -> list[gw.Meta]:
    """The bundled SmolLM2 tokenizer, padded to ``vocab`` tokens."""
    meta, _ = read_gguf(bundled_model_path())
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    if vocab < len(tokens):
        raise SyntheticError(f"a vocabulary of {vocab} is smaller than the tokenizer's")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [_UNUSED_TOKEN] * (vocab - len(types))
    out = [
        gw.Meta("tokenizer.ggml.model", "str", meta["tokenizer.ggml.model"]),
        gw.Meta("tokenizer.ggml.pre", "str", meta["tokenizer.ggml.pre"]),
        gw.Meta("tokenizer.ggml.tokens", "str", tokens, array=True),
        gw.Meta("tokenizer.ggml.token_type", "i32", types, array=True),
        gw.Meta("tokenizer.ggml.merges", "str", list(meta["tokenizer.ggml.merges"]), array=True),
    ]
    for key in ("bos", "eos", "unknown", "padding"):
        k = f"tokenizer.ggml.{key}_token_id"
        if k in meta:
            out.append(gw.Meta(k, "u32", int(meta[k])))
    for k in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix"):
        if k in meta:
            out.append(gw.Meta(k, "bool", bool(meta[k])))
    if "tokenizer.chat_template" in meta:
        out.append(gw.Meta("tokenizer.chat_template", "str", meta["tokenizer.chat_template"]))
    return out


def metadata(spec: Spec) -> list[gw.Meta]:
    """The keys llama.cpp's converter writes for this architecture, then the tokenizer."""
    p = PRESETS[spec.preset]
    a = p.arch
    meta = [
        gw.Meta("general.architecture", "str", a),
        gw.Meta("general.type", "str", "model"),
        gw.Meta("general.name", "str", f"{spec.name} ({p.source} shape, random weights)"),
        gw.Meta(f"{a}.block_count", "u32", spec.n_layers),
        gw.Meta(f"{a}.context_length", "u32", p.context_len),
        gw.Meta(f"{a}.embedding_length", "u32", p.hidden),
        gw.Meta(f"{a}.feed_forward_length", "u32", p.ffn),
        gw.Meta(f"{a}.attention.head_count", "u32", p.n_heads),
        gw.Meta(f"{a}.attention.head_count_kv", "u32", p.n_kv_heads),
        gw.Meta(f"{a}.rope.freq_base", "f32", p.rope_base),
        gw.Meta(f"{a}.attention.layer_norm_rms_epsilon", "f32", p.rms_eps),
        gw.Meta("general.file_type", "u32", _FILE_TYPE[spec.quant]),
    ]
    if a == "llama":
        meta += [
            gw.Meta(f"{a}.vocab_size", "u32", p.vocab),
            gw.Meta(f"{a}.rope.dimension_count", "u32", p.head_dim),
        ]
    if p.head_dim != p.hidden // p.n_heads:
        meta += [
            gw.Meta(f"{a}.attention.key_length", "u32", p.head_dim),
            gw.Meta(f"{a}.attention.value_length", "u32", p.head_dim),
        ]
    meta += _tokenizer_meta(p.vocab)
    meta.append(gw.Meta("general.quantization_version", "u32", 2))
    return meta


def planned_size(spec: Spec) -> int:
    """The file's size in bytes, before writing it."""
    return gw.file_size(metadata(spec), tensor_plans(spec))
