"""From a GGUF header to the core's objects: the one tensor-table builder, the model index
that lets K station processes skip re-parsing the header, and the one constructor of
pipelines (a layer range + its volume cache) and sessions, used by the runtime and the
stations alike."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs.runtime.gguf_file import ModelFile
from amplituhedron_rs.runtime.options import (
    DEFAULT_KV_DTYPE,
    CacheOptions,
    KvDtype,
    Precision,
    SessionOptions,
)

TensorTable = list[tuple[str, int, list[int], int]]


def tensor_table(model_file: ModelFile) -> TensorTable:
    """``(name, ggml type, dims, absolute offset)`` of every tensor: what Rust maps."""
    return [(t.name, t.ggml_type, list(t.dims), t.offset) for t in model_file.tensors]


def load_weights(
    model_file: ModelFile,
    precision: Precision = "refined",
    kv_dtype: KvDtype = DEFAULT_KV_DTYPE,
) -> _core.ModelWeights:
    """Memory-maps the file's weights (validated by the core)."""
    return _core.ModelWeights(
        str(model_file.path),
        dict(model_file.config),
        tensor_table(model_file),
        precision,
        kv_dtype,
    )


def write_model_index(model_file: ModelFile, dest: Path) -> Path:
    """What :func:`load_indexed_weights` needs (path, config, tensor table), as JSON."""
    index = {
        "path": str(model_file.path),
        "config": model_file.config,
        "tensors": tensor_table(model_file),
    }
    dest.write_text(json.dumps(index))
    return dest


def load_indexed_weights(
    index: Path, precision: Precision = "refined", kv_dtype: KvDtype = DEFAULT_KV_DTYPE
) -> _core.ModelWeights:
    """Weights from a model index written by :func:`write_model_index`."""
    data: dict[str, Any] = json.loads(index.read_text())
    tensors = [
        (str(n), int(t), [int(d) for d in dims], int(o)) for n, t, dims, o in data["tensors"]
    ]
    return _core.ModelWeights(data["path"], data["config"], tensors, precision, kv_dtype)


def volume_dir(
    cache: CacheOptions, weights: _core.ModelWeights, layer_lo: int, layer_hi: int
) -> Path | None:
    """Where a layer range's volumes persist: ``cache_dir/<fingerprint>/layers-<lo>-<hi>``.
    Per fingerprint, so models (and precisions, KV types) never evict each other's files as
    mismatches; per range, because each cache locks its directory."""
    if cache.cache_dir is None:
        return None
    return Path(cache.cache_dir) / f"{weights.fingerprint:016x}" / f"layers-{layer_lo}-{layer_hi}"


def new_pipeline(
    weights: _core.ModelWeights, layer_lo: int, layer_hi: int, cache: CacheOptions
) -> _core.NativeLlamaPipeline:
    """A pipeline over ``[layer_lo, layer_hi)`` with its own volume cache."""
    pipeline = _core.NativeLlamaPipeline(
        weights,
        layer_lo,
        layer_hi,
        max_entries=cache.max_entries,
        max_prefix_len=cache.max_prefix_len,
        max_bytes=cache.max_bytes,
        policy=cache.policy,
        cache_dir=volume_dir(cache, weights, layer_lo, layer_hi),
        max_disk_bytes=cache.max_disk_bytes,
    )
    pipeline.amplituhedron_enable(cache.enabled)
    pipeline.amplituhedron_set_min_prefix_reuse(cache.min_prefix_reuse)
    return pipeline


def new_session(
    weights: _core.ModelWeights,
    layer_lo: int,
    layer_hi: int,
    options: SessionOptions,
    *,
    n_sys: int | None = None,
) -> _core.RangeSession:
    """A fresh session (ring buffer + work buffers) over ``[layer_lo, layer_hi)``;
    ``n_sys`` overrides the options' anchor count."""
    o = options if n_sys is None else replace(options, n_sys=n_sys)
    return _core.RangeSession(
        weights,
        layer_lo,
        layer_hi,
        slots=o.slots,
        recall=o.recall,
        n_sys=o.n_sys,
        max_chunk=o.max_chunk,
    )
