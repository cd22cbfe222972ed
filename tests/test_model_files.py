"""Model files: the GGUF header reader against ggml-org's reference reader, refusals that name
what is unsupported, and ``amplituhedron models``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from amplituhedron_rs.runtime.gguf_file import (
    SUPPORTED_ARCHITECTURES,
    ModelFileError,
    read_gguf,
    read_model_file,
)


def test_header_reader_equals_the_reference_reader(model_path: Path) -> None:
    import gguf

    meta, tensors = read_gguf(model_path)
    reference = gguf.GGUFReader(str(model_path))
    assert [(t.name, t.ggml_type, t.dims, t.offset) for t in tensors] == [
        (t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset))
        for t in reference.tensors
    ]
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's own bookkeeping, not metadata
        ours, theirs = meta[key], field.contents()
        if isinstance(ours, np.ndarray):
            np.testing.assert_array_equal(ours, np.asarray(theirs), err_msg=key)
        elif isinstance(theirs, float):
            assert ours == pytest.approx(theirs, rel=1e-7), key
        else:
            assert ours == theirs, key


def _write_gguf(path: Path, arch: str) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    _write_gguf(path, "mamba")
    with pytest.raises(ModelFileError, match=r"architecture 'mamba' is not supported") as err:
        read_model_file(path)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


def test_a_truncated_file_is_refused(tmp_path: Path, model_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model_path.read_bytes()[:5000])
    with pytest.raises(ModelFileError, match="header ends early"):
        read_model_file(cut)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        read_model_file(not_gguf)


def test_models_lists_support_and_installed_files(model_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "amplituhedron_rs.cli", "models", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(r.stdout)
    assert report["architectures"] == list(SUPPORTED_ARCHITECTURES)
    assert {"F32", "Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"} <= set(report["tensor_types"])
    by_name = {m["name"]: m for m in report["models"]}
    assert set(by_name) == {"smollm2-135m", "gemma3-270m"}
    smollm = by_name["smollm2-135m"]
    assert smollm["installed"] and Path(smollm["path"]) == model_path
