"""Random quantized blocks of a chosen spread, for synthetic checkpoints (:mod:`.synthetic`).

Not quantization of floats: the block bytes are drawn directly (codes uniform, per-block
scales uniform in [0.5, 1.5) of a base), so gigabytes are written at the speed of the random
generator. The base scale makes the dequantized values zero-mean with standard deviation
``sigma`` (``1/√fan_in`` for a weight matrix), computed from the codes' exact moments below.

Layouts are ggml's (``ggml-common.h``; ``rust/quant`` reads the same):

- ``Q4_0`` ``{d: f16, qs[16]}``: ``d·(q − 8)``; ``d``'s sign is random (llama.cpp's own
  quantizer gives either sign), which cancels the codes' −½ mean.
- ``Q8_0`` ``{d: f16, qs: i8[32]}``: ``d·q``, ``q`` in −127…127 (a drawn −128 becomes −127,
  as llama.cpp's quantizer never writes −128).
- ``Q4_K`` ``{d, dmin: f16, scales[12], qs[128]}``: ``d·s·q − dmin·m``; every group's min
  ``m`` equals its scale ``s`` and ``dmin = 7.5·d``, so each group is ``d·s·(q − 7.5)``.
- ``Q6_K`` ``{ql[128], qh[64], scales: i8[16], d: f16}``: ``d·s·(q − 32)``, ``s`` in
  −127…127 (random sign cancels the codes' −½ mean).

Determinism: every tensor has its own numpy ``PCG64DXSM`` stream seeded through
``SeedSequence`` (both specified, stable across numpy versions and platforms); its 64-bit
words are read as little-endian bytes, and the stream is consumed in chunks of a fixed
number of blocks, so the bytes never depend on the machine, thread count or chunking of
the caller's writes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np

#: Part of every tensor's seed: bump when the byte recipe changes (files then differ).
RECIPE_VERSION = 1
#: Blocks drawn per chunk (a multiple of 8, so a chunk is whole 64-bit words for any layout).
CHUNK_BLOCKS = 1 << 16

#: ggml type ids and layouts: (elements per block, bytes per block).
F32, Q4_0, Q8_0, Q4_K, Q6_K = 0, 2, 8, 12, 14
LAYOUT = {F32: (1, 4), Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}
TYPE_NAMES = {F32: "F32", Q4_0: "Q4_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}

Bytes = np.ndarray[Any, np.dtype[np.uint8]]

# E[f²] of the per-block factor f uniform in [0.5, 1.5).
_F2 = (1.5**3 - 0.5**3) / 3
# E[q²] of the centred codes: (q − 8) for q in 0..15; q in −127..127 with −127 drawn twice;
# 6-bit s in 0..63 times (q − 7.5) for q in 0..15; i8 s in −127..127 (−127 twice) times
# (q − 32) for q in 0..63.
_Q4_0_M2 = sum((q - 8) ** 2 for q in range(16)) / 16
_I8_M2 = (sum(q * q for q in range(-127, 128)) + 127 * 127) / 256
_Q4_K_M2 = sum(s * s for s in range(64)) / 64 * sum((q - 7.5) ** 2 for q in range(16)) / 16
_Q6_K_M2 = _I8_M2 * sum((q - 32) ** 2 for q in range(64)) / 64


def stream(seed: int, name: str) -> np.random.PCG64DXSM:
    """The random stream of tensor ``name`` in a checkpoint of seed ``seed``."""
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=16).digest(), "little")
    return np.random.PCG64DXSM(np.random.SeedSequence([RECIPE_VERSION, seed, key]))


def raw_bytes(bits: np.random.PCG64DXSM, n: int) -> Bytes:
    """``n`` bytes (a multiple of 8) of the stream, little-endian on every platform."""
    words = bits.random_raw(n // 8)
    return np.ascontiguousarray(words.astype("<u8", copy=False)).view(np.uint8)


def _factor(u16: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A per-block factor in [0.5, 1.5) from the low 15 bits of ``u16``."""
    return 0.5 + (u16 & 0x7FFF).astype(np.float64) / 32768.0


def _f16(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Little-endian binary16 bytes of ``values`` (through f32: IEEE round-to-nearest at
    each step, the same everywhere), one row of 2 bytes per value."""
    half = values.astype(np.float32).astype("<f2")
    return half.view(np.uint8).reshape(-1, 2)


def _u16(b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Two byte columns as little-endian u16, one per row."""
    return np.ascontiguousarray(b).view("<u2").ravel()


def _no_i8_min(b: np.ndarray[Any, Any]) -> None:
    """Replaces the int8 byte −128 (0x80) by −127 (0x81), in place."""
    signed = b.view(np.int8)
    np.maximum(signed, -127, out=signed)


def _pack_q4_k_scales(s: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """ggml's 12-byte packing of eight 6-bit scales and eight 6-bit mins, with min = scale
    (the inverse of ``get_scale_min_k4``)."""
    s = s.astype(np.uint8)
    lo, hi = s[:, :4], s[:, 4:]
    out = np.empty((s.shape[0], 12), np.uint8)
    out[:, 0:4] = lo | ((hi >> 4) << 6)
    out[:, 4:8] = lo | ((hi >> 4) << 6)
    out[:, 8:12] = (hi & 0xF) | ((hi & 0xF) << 4)
    return out


def quantized(ggml_type: int, bits: np.random.PCG64DXSM, n_blocks: int, sigma: float) -> Bytes:
    """``n_blocks`` random blocks of ``ggml_type`` whose values have spread ``sigma``."""
    _, nb = LAYOUT[ggml_type]
    b = raw_bytes(bits, -(-n_blocks * nb // 8) * 8)[: n_blocks * nb].reshape(n_blocks, nb)
    if ggml_type == Q4_0:
        u = _u16(b[:, 0:2])
        sign = np.where(u & 0x8000, -1.0, 1.0)
        b[:, 0:2] = _f16(sign * _factor(u) * (sigma / np.sqrt(_Q4_0_M2 * _F2)))
    elif ggml_type == Q8_0:
        _no_i8_min(b)  # the scale bytes too: they are overwritten next
        b[:, 0:2] = _f16(_factor(_u16(b[:, 0:2])) * (sigma / np.sqrt(_I8_M2 * _F2)))
    elif ggml_type == Q4_K:
        d = _f16(_factor(_u16(b[:, 0:2])) * (sigma / np.sqrt(_Q4_K_M2 * _F2)))
        b[:, 0:2] = d
        b[:, 2:4] = _f16(d.copy().view("<f2").astype(np.float32).ravel() * np.float32(7.5))
        b[:, 4:16] = _pack_q4_k_scales(b[:, 4:12] & 63)
    elif ggml_type == Q6_K:
        _no_i8_min(b[:, 192:208])
        b[:, 208:210] = _f16(_factor(_u16(b[:, 208:210])) * (sigma / np.sqrt(_Q6_K_M2 * _F2)))
    else:
        raise ValueError(f"no random blocks for ggml type {ggml_type}")
    return b.reshape(-1)


def quantized_chunks(
    ggml_type: int, seed: int, name: str, n_blocks: int, sigma: float
) -> Iterator[Bytes]:
    """The blocks of one tensor, :data:`CHUNK_BLOCKS` at a time (one fixed chunking, part of
    the recipe: the stream is consumed chunk by chunk)."""
    bits = stream(seed, name)
    for start in range(0, n_blocks, CHUNK_BLOCKS):
        yield quantized(ggml_type, bits, min(CHUNK_BLOCKS, n_blocks - start), sigma)


def uniform_f32(seed: int, name: str, n: int, std: float) -> Bytes:
    """``n`` little-endian f32 values uniform in ±√3·std (mean 0, deviation ``std``)."""
    u = raw_bytes(stream(seed, name), -(-n * 4 // 8) * 8)[: n * 4].view("<u4")
    half_width = std * np.sqrt(3.0)
    values = (u.astype(np.float64) / 2.0**32 * 2.0 - 1.0) * half_width
    out: Bytes = values.astype("<f4").view(np.uint8)
    return out


def constant_f32(n: int, value: float) -> Bytes:
    """``n`` little-endian f32 copies of ``value``."""
    out: Bytes = np.full(n, value, "<f4").view(np.uint8)
    return out
