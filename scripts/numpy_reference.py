"""An independent reference forward pass for the synthetic checkpoints: numpy, float64, with
ggml-org's own dequantizers (``gguf.quants``) and llama.cpp's graph for ``llama`` and
``qwen2`` (RMSNorm, Q/K/V with Qwen2's biases, RoPE with llama.cpp's pair layout per
architecture and the Llama 3 ``rope_freqs`` divisors, grouped-query causal attention,
SwiGLU, tied or untied head). It shares no code with the runtime.

Two numerics of the same graph:

- ``exact``: every activation float64, weights exactly as dequantized;
- ``llamacpp``: llama.cpp's CPU roundings emulated: the activations entering each quantized
  matmul rounded to ``Q8_0`` blocks of 32 (for Q4_0/Q8_0 weights) or ``Q8_K`` blocks of 256
  (for Q4_K/Q6_K weights), as ggml's ``vec_dot_type`` does, and Q, the f16 KV cache and the
  softmax weights rounded to f16 as its attention does.

The distance between the two is how far llama.cpp's own arithmetic sits from exact: the
tolerance basis when llama.cpp itself is not at hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

Numerics = Literal["exact", "llamacpp"]
F64 = np.ndarray[Any, np.dtype[np.float64]]

_Q8_0_TYPES = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0}
_Q8_K_TYPES = {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K}


def _q8_0(x: F64) -> F64:
    """ggml's ``quantize_row_q8_0``: blocks of 32, d = amax/127 stored as f16."""
    b = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = np.abs(b).max(axis=-1, keepdims=True) / 127
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
    q = np.round(b * inv)
    out: F64 = (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape).astype(np.float64)
    return out


def _q8_k(x: F64) -> F64:
    """ggml's ``quantize_row_q8_K``: blocks of 256, scale from the largest-magnitude value
    (signed), codes clamped to 127, d = 1/iscale in f32."""
    b = x.reshape(*x.shape[:-1], -1, 256).astype(np.float32)
    idx = np.abs(b).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(b, idx, axis=-1)
    safe = np.where(mx != 0, mx, np.float32(1))
    iscale = np.float32(-127) / safe
    q = np.minimum(np.rint(iscale * b), 127)
    d = np.where(mx != 0, np.float32(1) / iscale, 0).astype(np.float32)
    return (q * d).reshape(x.shape).astype(np.float64)


def _f16(x: F64) -> F64:
    return x.astype(np.float16).astype(np.float64)


class Matrix:
    """A weight matrix (out, in), dequantized to float32 once."""

    def __init__(self, tensor: Any, rows_per_step: int = 4096) -> None:
        self.type = GGMLQuantizationType(tensor.tensor_type)
        cols, rows = int(tensor.shape[0]), int(tensor.shape[1])
        data = np.asarray(tensor.data).reshape(rows, -1)
        self.w = np.empty((rows, cols), dtype=np.float32)
        for lo in range(0, rows, rows_per_step):  # bounded temporaries for a 152064-row head
            part = dequantize(data[lo : lo + rows_per_step], self.type)
            self.w[lo : lo + rows_per_step] = part.reshape(-1, cols)

    def act(self, x: F64, numerics: Numerics) -> F64:
        """x as llama.cpp hands it to this matrix's dot products."""
        if numerics == "exact":
            return x
        if self.type in _Q8_0_TYPES:
            return _q8_0(x)
        if self.type in _Q8_K_TYPES:
            return _q8_k(x)
        return x

    def __call__(self, x: F64, numerics: Numerics, chunk: int = 16384) -> F64:
        xa = self.act(x, numerics)
        out = np.empty((x.shape[0], self.w.shape[0]))
        for lo in range(0, self.w.shape[0], chunk):
            out[:, lo : lo + chunk] = xa @ self.w[lo : lo + chunk].astype(np.float64).T
        return out


class Reference:
    """One GGUF file's weights and hyper-parameters, read with ggml-org's reader."""

    def __init__(self, path: Path) -> None:
        r = GGUFReader(str(path))

        def field(key: str) -> Any:
            return r.fields[key].contents()

        arch = str(field("general.architecture"))
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"no reference for architecture {arch}")
        self.arch = arch
        self.n_layers = int(field(f"{arch}.block_count"))
        self.hidden = int(field(f"{arch}.embedding_length"))
        self.n_heads = int(field(f"{arch}.attention.head_count"))
        self.n_kv = int(field(f"{arch}.attention.head_count_kv"))
        self.head_dim = self.hidden // self.n_heads
        self.eps = float(field(f"{arch}.attention.layer_norm_rms_epsilon"))
        self.base = float(field(f"{arch}.rope.freq_base"))
        t = {x.name: x for x in r.tensors}
        self.embd = Matrix(t["token_embd.weight"])
        self.head = Matrix(t["output.weight"]) if "output.weight" in t else self.embd
        self.out_norm = np.asarray(t["output_norm.weight"].data, dtype=np.float64)
        ff = t.get("rope_freqs.weight")
        self.freq_factors = (
            np.asarray(ff.data, dtype=np.float64) if ff is not None else np.ones(self.head_dim // 2)
        )
        self.layers: list[dict[str, Any]] = []
        for i in range(self.n_layers):
            p = f"blk.{i}."
            layer: dict[str, Any] = {
                k: Matrix(t[p + k + ".weight"])
                for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")
            }
            layer["ffn_down"] = Matrix(t[p + "ffn_down.weight"])
            for k in ("attn_norm", "ffn_norm"):
                layer[k] = np.asarray(t[p + k + ".weight"].data, dtype=np.float64)
            for k in ("attn_q", "attn_k", "attn_v"):
                bias = t.get(p + k + ".bias")
                layer[k + ".bias"] = None if bias is None else np.asarray(bias.data, np.float64)
            self.layers.append(layer)
        self.vocab = self.head.w.shape[0]

    def _norm(self, x: F64, w: F64) -> F64:
        out: F64 = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps) * w
        return out

    def _rope(self, x: F64, positions: F64) -> F64:
        """x: (n, heads, head_dim). llama: adjacent pairs (ggml's NORM mode, on the
        converter's permuted Q/K); qwen2: the two halves (NEOX)."""
        hd = self.head_dim
        inv = self.base ** (-np.arange(0, hd, 2) / hd) / self.freq_factors
        ang = positions[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = np.empty_like(x)
        if self.arch == "llama":
            a, b = x[..., 0::2], x[..., 1::2]
            out[..., 0::2] = a * cos - b * sin
            out[..., 1::2] = a * sin + b * cos
        else:
            a, b = x[..., : hd // 2], x[..., hd // 2 :]
            out[..., : hd // 2] = a * cos - b * sin
            out[..., hd // 2 :] = a * sin + b * cos
        return out

    def new_cache(self) -> list[tuple[list[F64], list[F64]]]:
        return [([], []) for _ in self.layers]

    def forward(
        self,
        ids: list[int],
        cache: list[tuple[list[F64], list[F64]]],
        numerics: Numerics,
    ) -> F64:
        """Last-position logits (float64) after appending ``ids`` to ``cache``."""
        start = sum(k.shape[0] for k in cache[0][0])
        n = len(ids)
        pos = np.arange(start, start + n, dtype=np.float64)
        x = self.embd.w[np.asarray(ids)].astype(np.float64)
        hd, group = self.head_dim, self.n_heads // self.n_kv
        f16 = _f16 if numerics == "llamacpp" else (lambda v: v)
        for layer, (ks, vs) in zip(self.layers, cache, strict=True):
            h = self._norm(x, layer["attn_norm"])
            qkv = []
            for k in ("attn_q", "attn_k", "attn_v"):
                y = layer[k](h, numerics)
                if layer[k + ".bias"] is not None:
                    y = y + layer[k + ".bias"]
                qkv.append(y)
            q = self._rope(qkv[0].reshape(n, self.n_heads, hd), pos)
            ks.append(f16(self._rope(qkv[1].reshape(n, self.n_kv, hd), pos)))
            vs.append(f16(qkv[2].reshape(n, self.n_kv, hd)))
            kk, vv = np.concatenate(ks), np.concatenate(vs)
            total = kk.shape[0]
            mask = np.arange(total)[None, :] > (start + np.arange(n))[:, None]
            att = np.empty((n, self.n_heads, hd))
            for head in range(self.n_heads):
                kv = head // group
                s = f16(q[:, head]) @ kk[:, kv].T / np.sqrt(hd)
                s[mask] = -np.inf
                p = np.exp(s - s.max(axis=-1, keepdims=True))
                p /= p.sum(axis=-1, keepdims=True)
                att[:, head] = f16(p) @ vv[:, kv]
            x = x + layer["attn_output"](att.reshape(n, -1), numerics)
            h = self._norm(x, layer["ffn_norm"])
            g = layer["ffn_gate"](h, numerics)
            u = layer["ffn_up"](h, numerics)
            x = x + layer["ffn_down"](g / (1 + np.exp(-g)) * u, numerics)
        last = self._norm(x[-1:], self.out_norm)
        logits: F64 = self.head(last, numerics)[0]
        return logits

    def prompt_logits(self, ids: list[int], numerics: Numerics) -> F64:
        return self.forward(ids, self.new_cache(), numerics)

    def greedy(self, ids: list[int], n: int) -> tuple[F64, list[int], list[float]]:
        """Exact last-position logits of ``ids``, then ``n`` greedy tokens with the top-2
        margin at each step."""
        cache = self.new_cache()
        logits = first = self.forward(ids, cache, "exact")
        out, margins = [], []
        for _ in range(n):
            top2 = np.sort(logits)[-2:]
            margins.append(float(top2[1] - top2[0]))
            out.append(int(np.argmax(logits)))
            logits = self.forward([out[-1]], cache, "exact")
        return first, out, margins
