"""Synthetic checkpoints (SPEC §15): the writer's format, statistics and determinism, the
cache, the ``synthetic:`` names, and parity with llama.cpp on shallow files of every preset
(references made once by ``scripts/make_synthetic_refdata.py``; CI regenerates the files,
checks their BLAKE3, and needs no llama.cpp)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

import amplituhedron_rs as ar
from amplituhedron_rs import _core
from amplituhedron_rs.runtime import gguf_writer as gw
from amplituhedron_rs.runtime import random_blocks as rb
from amplituhedron_rs.runtime import synthetic as syn
from amplituhedron_rs.runtime.gguf_file import read_gguf, read_model_file, resolve_model_path
from amplituhedron_rs.runtime.tokenizer import Tokenizer

REFERENCE: dict[str, Any] = json.loads(
    (Path(__file__).parent / "refdata" / "synthetic_reference.json").read_text()
)


SMALL = syn.Spec("llama3-1b", "Q4_K_M", 1)


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's cache directory (never the user's)."""
    d = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(d))
        yield d
    shutil.rmtree(d)


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache directory for one test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def small_file(cache_home: Path) -> syn.Written:
    """A 1-layer llama3-1b in the Q4_K_M mix, written to the cache: every tensor type the
    writer makes (Q4_K, Q6_K, F32) and the Llama 3 ``rope_freqs`` tensor, in ~230 MB."""
    return syn.write_synthetic(SMALL)


# --- names -----------------------------------------------------------------------------------


def test_names_parse_and_print_canonically() -> None:
    s = syn.parse_spec("synthetic:qwen2-7b")
    assert (s.preset, s.quant, s.layers, s.seed) == ("qwen2-7b", "Q4_0", None, 0)
    s = syn.parse_spec("synthetic:llama3-8b:layers=2:Q4_K_M:seed=3")
    assert (s.preset, s.quant, s.layers, s.seed) == ("llama3-8b", "Q4_K_M", 2, 3)
    assert s.name == "synthetic:llama3-8b:q4_k_m:layers=2:seed=3"
    assert syn.parse_spec(s.name) == s
    # The preset's own depth is the full file.
    full = syn.parse_spec("synthetic:qwen2-1.5b:q8_0:layers=28")
    assert full.name == "synthetic:qwen2-1.5b:q8_0"
    assert full.file_name == syn.Spec("qwen2-1.5b", "Q8_0").file_name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("synthetic:gpt5", "unknown synthetic preset 'gpt5'"),
        ("synthetic:qwen2-7b:q3_k", "cannot read 'q3_k'"),
        ("synthetic:qwen2-7b:layers=0", "1..28 layers, not 0"),
        ("synthetic:llama3-1b:layers=17", "1..16 layers, not 17"),
        ("synthetic:llama3-1b:layers=two", "cannot read 'layers=two'"),
        ("synthetic:llama3-1b:depth=2", "cannot read 'depth=2'"),
    ],
)
def test_bad_names_are_refused_before_anything_is_written(
    name: str, message: str, fresh_cache: Path
) -> None:
    with pytest.raises(syn.SyntheticError, match=message):
        resolve_model_path(name)
    assert not fresh_cache.exists()
    with pytest.raises(ValueError):  # SyntheticError is a ValueError too
        syn.parse_spec(name)


# --- the file --------------------------------------------------------------------------------


def test_the_writer_encodes_what_ggml_orgs_reader_reads(tmp_path: Path) -> None:
    import gguf

    meta = [
        gw.Meta("general.architecture", "str", "llama"),
        gw.Meta("a.u32", "u32", 7),
        gw.Meta("a.f32", "f32", 1e-6),
        gw.Meta("a.bool", "bool", True),
        gw.Meta("a.tokens", "str", ["Ġthe", "<|im_end|>", "[PAD3]"], array=True),
        gw.Meta("a.types", "i32", [1, 3, 5], array=True),
    ]
    vec = np.arange(8, dtype="<f4").view(np.uint8)
    blocks = np.arange(2 * 18, dtype=np.uint8)  # two Q4_0 blocks: 64 values
    plans = [
        gw.TensorPlan("v", 0, (8,), vec.size, lambda: iter([vec])),
        gw.TensorPlan("m", 2, (32, 2), 36, lambda: iter([blocks[:18], blocks[18:]])),
    ]
    path = tmp_path / "t.gguf"
    with path.open("wb") as f:
        written = gw.write(f, meta, plans)
    assert written == gw.file_size(meta, plans) == path.stat().st_size
    r = gguf.GGUFReader(str(path))
    t = gguf.GGUFValueType
    for m, kinds in zip(
        meta,
        [[t.STRING], [t.UINT32], [t.FLOAT32], [t.BOOL], [t.ARRAY, t.STRING], [t.ARRAY, t.INT32]],
        strict=True,
    ):
        assert r.fields[m.key].types == kinds, m.key
        got = r.fields[m.key].contents()
        assert got == (pytest.approx(m.value) if m.kind == "f32" else m.value), m.key
    v, mat = r.tensors
    assert (v.name, v.tensor_type.name, list(v.data)) == ("v", "F32", list(range(8)))
    assert (mat.name, mat.tensor_type.name, [int(d) for d in mat.shape]) == ("m", "Q4_0", [32, 2])
    assert bytes(np.asarray(mat.data).tobytes()) == blocks.tobytes()


def test_metadata_has_llamacpps_keys_and_types() -> None:
    kinds = {m.key: (m.kind, m.value) for m in syn.metadata(syn.Spec("qwen2-7b"))}
    assert kinds["general.architecture"] == ("str", "qwen2")
    for key, value in [
        ("block_count", 28),
        ("context_length", 32768),
        ("embedding_length", 3584),
        ("feed_forward_length", 18944),
        ("attention.head_count", 28),
        ("attention.head_count_kv", 4),
    ]:
        assert kinds[f"qwen2.{key}"] == ("u32", value), key
    assert kinds["qwen2.rope.freq_base"] == ("f32", 1e6)
    assert kinds["qwen2.attention.layer_norm_rms_epsilon"] == ("f32", 1e-6)
    assert kinds["general.file_type"] == ("u32", 2)
    assert kinds["tokenizer.ggml.token_type"][0] == "i32"
    assert len(kinds["tokenizer.ggml.tokens"][1]) == 152064
    llama = {m.key: m for m in syn.metadata(syn.Spec("llama3-8b", "Q8_0", 2))}
    assert llama["llama.rope.dimension_count"].value == 128
    assert llama["llama.vocab_size"].value == 128256
    assert llama["llama.block_count"].value == 2
    assert llama["general.file_type"].value == 7


def test_the_file_has_the_presets_shape_and_the_mixs_types(small_file: syn.Written) -> None:
    meta, tensors = read_gguf(small_file.path)
    assert small_file.size == small_file.path.stat().st_size == syn.planned_size(SMALL)
    assert meta["general.architecture"] == "llama"
    assert (meta["llama.block_count"], meta["llama.embedding_length"]) == (1, 2048)
    assert len(meta["tokenizer.ggml.tokens"]) == 128256
    types = {t.name: (rb.TYPE_NAMES[t.ggml_type], list(t.dims)) for t in tensors}
    assert types["token_embd.weight"] == ("Q6_K", [2048, 128256])  # tied: it is the head
    assert "output.weight" not in types
    assert types["blk.0.attn_q.weight"] == ("Q4_K", [2048, 2048])
    assert types["blk.0.attn_v.weight"] == ("Q6_K", [2048, 512])  # use_more_bits(0, 1)
    assert types["blk.0.ffn_down.weight"] == ("Q6_K", [8192, 2048])
    assert types["blk.0.ffn_up.weight"] == ("Q4_K", [2048, 8192])
    assert types["rope_freqs.weight"] == ("F32", [32])
    # llama.cpp's Q4_K_M rule over 28 layers: Q6_K at 0-2, 5, 8, …, 23, 24-27.
    deep = syn.Spec("qwen2-7b", "Q4_K_M")
    six = [i for i in range(28) if syn.tensor_type(deep, f"blk.{i}.ffn_down.weight") == rb.Q6_K]
    assert six == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert syn.tensor_type(deep, "token_embd.weight") == rb.Q4_K  # untied: not the head
    assert syn.tensor_type(deep, "output.weight") == rb.Q6_K


def test_llama3_rope_factors_follow_the_converters_rule(small_file: syn.Written) -> None:
    _, tensors = read_gguf(small_file.path)
    (t,) = [t for t in tensors if t.name == "rope_freqs.weight"]
    factors = np.fromfile(small_file.path, "<f4", count=32, offset=t.offset).astype(np.float64)
    # Llama 3.2 (factor 32, wavelengths 2048..8192 blended): fast pairs unscaled, slow pairs
    # divided by 32, monotone between.
    wavelen = 2 * math.pi * 500000.0 ** (np.arange(0, 64, 2) / 64)
    blend = factors[(wavelen > 2048) & (wavelen < 8192)]
    assert (factors[wavelen < 2048] == 1.0).all() and (factors[wavelen > 8192] == 32.0).all()
    assert np.all(np.diff(factors) >= 0) and blend.size > 0 and blend.min() > 1.0
    assert read_model_file(small_file.path).tensors == tuple(tensors)


def test_the_runtime_reads_the_shape_and_the_padded_tokenizer(small_file: syn.Written) -> None:
    mf = read_model_file(small_file.path)
    c = mf.config
    assert (c["arch"], c["n_layers"], c["hidden"], c["ffn"]) == ("llama", 1, 2048, 8192)
    assert (c["n_heads"], c["n_kv_heads"], c["head_dim"], c["vocab"]) == (32, 8, 64, 128256)
    bundled = read_model_file(None)
    tok = Tokenizer(mf)
    text = "Hello, synthetic world! 12345 <|im_start|>user"
    assert tok.encode(text) == Tokenizer(bundled).encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert mf.tokens[49152] == "[PAD49152]" and mf.token_types[49152] == 5
    assert mf.chat_template == bundled.chat_template


@pytest.mark.parametrize(("ggml_type", "cols"), [(2, 3584), (8, 1536), (12, 18944), (14, 4096)])
def test_random_blocks_have_the_planned_spread(ggml_type: int, cols: int) -> None:
    sigma = 1 / math.sqrt(cols)
    rows = 64
    per_block, _ = rb.LAYOUT[ggml_type]
    raw = np.concatenate(
        list(rb.quantized_chunks(ggml_type, 0, "w", rows * cols // per_block, sigma))
    )
    w = _core.quant_dequantize(ggml_type, raw, rows, cols).astype(np.float64)
    assert np.isfinite(w).all()
    assert abs(w.mean()) < 0.02 * sigma
    assert w.std() == pytest.approx(sigma, rel=0.02)
    # Every row has that spread (no degenerate rows), so y = Wx keeps x's scale.
    rows_std = w.std(axis=1)
    assert (rows_std > 0.6 * sigma).all() and (rows_std < 1.4 * sigma).all()
    if ggml_type == rb.Q8_0:  # llama.cpp's quantizer never writes −128
        codes = raw.reshape(-1, 34)[:, 2:].view(np.int8)
        assert codes.min() == -127 and codes.max() == 127


def test_bytes_depend_only_on_the_spec() -> None:
    def first_chunk(spec: syn.Spec, name: str) -> bytes:
        (plan,) = [p for p in syn.tensor_plans(spec) if p.name == name]
        return bytes(next(plan.chunks()))

    a = syn.Spec("qwen2-7b", "Q4_0", 2)
    # A shallow file's layers are the full file's first layers, byte for byte.
    assert first_chunk(a, "blk.1.ffn_up.weight") == first_chunk(
        syn.Spec("qwen2-7b", "Q4_0"), "blk.1.ffn_up.weight"
    )
    assert first_chunk(a, "blk.1.ffn_up.weight") != first_chunk(
        syn.Spec("qwen2-7b", "Q4_0", 2, seed=1), "blk.1.ffn_up.weight"
    )
    assert first_chunk(a, "blk.0.ffn_up.weight") != first_chunk(a, "blk.1.ffn_up.weight")


# --- the cache -------------------------------------------------------------------------------


def test_the_cache_writes_once_then_reuses(small_file: syn.Written) -> None:
    path = ar.synthetic_model("llama3-1b", layers=1, quant="q4_k_m")
    assert path == small_file.path and path.parent == syn.cache_dir()
    assert path.with_name(path.name + ".blake3").read_text().strip() == small_file.blake3
    mtime = path.stat().st_mtime_ns
    again = syn.write_synthetic(SMALL)
    assert again.reused and again.blake3 == small_file.blake3 and again.seconds == 0
    assert path.stat().st_mtime_ns == mtime
    # The name resolves to it wherever a model argument is taken.
    assert resolve_model_path("synthetic:llama3-1b:q4_k_m:layers=1") == path
    # A file of the wrong size (cut short by hand) is not taken: it is written again, with
    # progress, the same bytes.
    with path.open("r+b") as f:
        f.truncate(1000)
    seen: list[tuple[int, int]] = []
    rewritten = syn.write_synthetic(SMALL, progress=lambda done, total: seen.append((done, total)))
    assert not rewritten.reused and rewritten.blake3 == small_file.blake3
    assert seen[-1] == (small_file.size, small_file.size) and len(seen) > 10
    assert path.stat().st_size == small_file.size
    assert not list(path.parent.glob(".*.tmp"))


def test_no_room_on_disk_is_refused_before_writing(
    monkeypatch: pytest.MonkeyPatch, fresh_cache: Path
) -> None:
    real = shutil.disk_usage

    def tiny(path: Any) -> Any:
        return real(path)._replace(free=1 << 20)

    monkeypatch.setattr("shutil.disk_usage", tiny)
    size = syn.planned_size(syn.Spec("qwen2-7b"))
    with pytest.raises(syn.SyntheticError, match=rf"needs {size:,} bytes .* 1,048,576 bytes"):
        ar.synthetic_model("qwen2-7b")
    assert not [p for p in fresh_cache.iterdir() if p.suffix in (".gguf", ".tmp")]


def test_cli_prints_the_files_blake3(small_file: syn.Written, cache_home: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "amplituhedron_rs.cli", "synth", "llama3-1b", "--layers", "1",
         "--quant", "q4_k_m"],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "XDG_CACHE_HOME": str(cache_home)},
    )  # fmt: skip
    assert r.stdout.split() == [small_file.blake3, str(small_file.path)]
    assert "reused" in r.stderr


# --- parity with llama.cpp -------------------------------------------------------------------


def _parity_file(case: dict[str, Any]) -> syn.Written:
    spec = syn.Spec(case["preset"], case["quant"], case["layers"], case["seed"])
    return syn.write_synthetic(spec)  # the module's cache: the small file is reused


#: How far ``refined`` logits may sit from an exact float64 reference: "within a few
#: hundredths of an f32 implementation" (``load_model``); measured ≈ 0.002 on these files.
REFINED_BOUND = 0.02
Precision = Literal["refined", "fast"]


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: str(c["name"]))
def test_parity_with_the_reference(case: dict[str, Any], cache_home: Path) -> None:
    w = _parity_file(case)
    assert (w.size, w.blake3) == (case["size"], case["blake3"]), "the file is not deterministic"
    tol = case["tolerance"]
    # Against exact logits (the numpy engine) refined must be far closer than llama.cpp's
    # roundings; against llama.cpp itself both precisions get its tolerance.
    refined_tol = min(tol, REFINED_BOUND) if case["engine"] == "numpy" else tol
    precisions: list[tuple[Precision, float]] = [("refined", refined_tol), ("fast", tol)]
    for precision, bound in precisions:
        model = ar.load_model(w.path, precision=precision)
        sample = np.linspace(0, model.vocab_size - 1, REFERENCE["sample"]).round().astype(int)
        for name, seq in case["sequences"].items():
            what = f"{precision} {name}"
            ours = model.logits(seq["ids"]).astype(np.float64)
            # Finite and well-conditioned: the writer's scaling keeps the logits' spread near 1.
            assert np.isfinite(ours).all(), what
            assert 0.3 < ours.std() < 3, f"{what}: logits std {ours.std():.3f}"
            top = np.asarray(seq["top_ids"])
            diff = np.abs(
                np.concatenate([ours[top] - seq["top_logits"], ours[sample] - seq["sample_logits"]])
            )
            assert diff.max() <= bound, f"{what}: max |Δ| {diff.max():.4f} > {bound}"
            assert ours.mean() == pytest.approx(seq["mean"], abs=bound), what
            assert ours.std() == pytest.approx(seq["std"], abs=bound), what
            if precision == "fast":
                continue
            # Greedy agrees up to the reference's first near-tie (a top-2 margin within
            # 2·bound, where either engine may rightly pick either token).
            margins = seq["greedy_margins"]
            clear = next((i for i, m in enumerate(margins) if m < 2 * bound), len(margins))
            g = model.generate(seq["ids"], len(margins), use_cache=False, stop_at_eos=False)
            assert g.output_ids[:clear] == seq["greedy_ids"][:clear], what
        del model


def test_the_reference_covers_every_architecture_and_tensor_type() -> None:
    cases = REFERENCE["cases"]
    assert {syn.PRESETS[c["preset"]].arch for c in cases} == {"llama", "qwen2"}
    assert {c["quant"] for c in cases} >= {"Q4_0", "Q8_0", "Q4_K_M"}
    assert all(0 < c["tolerance"] <= 0.5 for c in cases), [c["tolerance"] for c in cases]
    # The greedy check compares tokens: random logits over ~150k ids have top-2 margins of a
    # few tenths, so at llama.cpp's tolerance most steps are near-ties; at refined's bound
    # most are clear.
    clear = [
        next((i for i, m in enumerate(seq["greedy_margins"]) if m < 2 * REFINED_BOUND), 8)
        for c in cases
        for seq in c["sequences"].values()
    ]
    assert sum(clear) >= len(clear) * 2, clear


def test_benches_take_synthetic_names(small_file: syn.Written) -> None:
    from amplituhedron_rs.cli import _resolve_synthetic, parse

    for command in ("bench-serve", "bench-spec"):
        a = parse([command, "--model", SMALL.name])
        _resolve_synthetic(a)
        assert a.model == str(small_file.path), command
    with pytest.raises(SystemExit):
        parse(["bench-serve", "--model", "synthetic:llama3-1b:layers=17"])


def test_the_default_cache_is_under_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert syn.cache_dir() == tmp_path / ".cache" / "amplituhedron" / "synthetic"


# --- bench-rows --------------------------------------------------------------------------------


def test_bench_rows_reports_the_floor_and_the_row_cost_curve(
    small_file: syn.Written, tmp_path: Path
) -> None:
    """A tiny ``bench-rows`` run on the 1-layer file: the bytes a decode step streams are the
    file's tensors but the embedding (unless the head is tied to it, then read whole), the
    floor is those bytes over the measured bandwidth, and every row count has its cost."""
    import gguf

    report = tmp_path / "rows.json"
    argv = [sys.executable, "-m", "amplituhedron_rs.cli", "bench-rows", "-m", str(small_file.path)]
    argv += ["--rows", "1,2", "--steps", "2", "--precision", "fast", "--json", str(report)]
    argv += ["--drafts", "1,3", "--acceptance", "0.5"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    r = json.loads(report.read_text())
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(small_file.path).tensors}
    untied = "output.weight" in sizes
    assert r["streamed_bytes"] == sum(sizes.values()) - untied * sizes["token_embd.weight"]
    assert r["read_bandwidth_gb_s"] > 0
    assert math.isclose(r["floor_ms"], r["streamed_bytes"] / (r["read_bandwidth_gb_s"] * 1e9) * 1e3)
    fast = r["precisions"]["fast"]
    assert fast["floor_ms"] > 0 and fast["of_floor"] > 0
    assert set(fast["rows_ms"]) == {"1", "2"} and all(v > 0 for v in fast["rows_ms"].values())
    assert fast["rows_over_one"]["1"] == 1.0
    # Verify steps: k = 0 is the plain step the others are measured against, and the
    # speed-up is (1 + acceptance × k) × plain ÷ verify.
    verify = fast["verify_ms"]
    assert set(verify) == {"0", "1", "3"} and all(v > 0 for v in verify.values())
    for k in (1, 3):
        over = verify[str(k)] / verify["0"]
        assert math.isclose(fast["verify_over_plain"][str(k)], over)
        assert math.isclose(fast["verify_speedup"][str(k)], (1 + 0.5 * k) / over)
    assert "| fast |" in out.stdout and "floor" in out.stdout and "k=3 ms" in out.stdout
    bad = subprocess.run([*argv, "--acceptance", "1.5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "must be in [0, 1]" in bad.stderr
    bad = subprocess.run([*argv, "--drafts", "0,64"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--drafts: each k is in 1..63" in bad.stderr
