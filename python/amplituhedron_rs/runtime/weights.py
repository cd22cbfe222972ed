"""From a GGUF header to the core's objects: the one tensor-table builder, the loader of the
whole model or of one station's layer range, the model index that lets K station processes
skip re-parsing the header (and re-hashing the file), and the one constructor of pipelines (a
layer range + its volume cache) and sessions, used by the runtime and the stations alike."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs.runtime.digests import (
    DIGEST_MISMATCH,
    TensorTable,
    forget_digests,
    model_digests,
)
from amplituhedron_rs.runtime.gguf_file import ModelFile
from amplituhedron_rs.runtime.options import (
    DEFAULT_KV_DTYPE,
    CacheOptions,
    KvDtype,
    Precision,
    SessionOptions,
)

LayerSpan = tuple[int, int]


def tensor_table(model_file: ModelFile) -> TensorTable:
    """``(name, ggml type, dims, absolute offset)`` of every tensor: what Rust maps."""
    return [(t.name, t.ggml_type, list(t.dims), t.offset) for t in model_file.tensors]


def load_weights(
    model_file: ModelFile,
    precision: Precision = "refined",
    kv_dtype: KvDtype = DEFAULT_KV_DTYPE,
    *,
    layers: LayerSpan | None = None,
) -> _core.ModelWeights:
    """Memory-maps the file's weights (validated by the core): every layer, or with
    ``layers=(lo, hi)`` only that range's (a station's; see :func:`load_range`)."""
    table = tensor_table(model_file)
    if layers is None:
        return _core.ModelWeights(
            str(model_file.path), dict(model_file.config), table, precision, kv_dtype
        )
    return load_range(model_file.path, dict(model_file.config), table, layers, precision, kv_dtype)


def load_range(
    path: str | Path,
    config: dict[str, Any],
    table: TensorTable,
    layers: LayerSpan,
    precision: Precision = "refined",
    kv_dtype: KvDtype = DEFAULT_KV_DTYPE,
    digests: list[bytes] | None = None,
) -> _core.ModelWeights:
    """The weights of one layer range: only its tensors are copied or touched (plus the
    embedding at the entry, the final norm and head at the exit), after the core checked
    they fit in ``MemAvailable``. The other tensors' digests (the fingerprint covers the whole
    model) are ``digests`` (the mesh launcher's), else the cached ones of
    :func:`~.digests.model_digests`; a cached set that disagrees with the file is dropped and
    hashed again."""
    cached = digests is None
    given = model_digests(path, table) if digests is None else digests

    def load(d: list[bytes]) -> _core.ModelWeights:
        return _core.ModelWeights(
            str(path), config, table, precision, kv_dtype, layers=layers, digests=d
        )

    try:
        return load(given)
    except _core.ModelError as exc:
        if not cached or DIGEST_MISMATCH not in str(exc):
            raise
    forget_digests(path, table)
    return load(model_digests(path, table))


def write_model_index(model_file: ModelFile, dest: Path) -> Path:
    """What :func:`load_indexed_weights` needs (path, config, tensor table, and every
    tensor's digest, hashed once here for all the stations), as JSON."""
    table = tensor_table(model_file)
    index = {
        "path": str(model_file.path),
        "config": model_file.config,
        "tensors": table,
        "digests": [d.hex() for d in model_digests(model_file.path, table)],
    }
    dest.write_text(json.dumps(index))
    return dest


def load_indexed_weights(
    index: Path,
    precision: Precision = "refined",
    kv_dtype: KvDtype = DEFAULT_KV_DTYPE,
    *,
    layers: LayerSpan | None = None,
) -> _core.ModelWeights:
    """Weights from a model index written by :func:`write_model_index` (all layers, or one
    range's)."""
    data: dict[str, Any] = json.loads(index.read_text())
    tensors = [
        (str(n), int(t), [int(d) for d in dims], int(o)) for n, t, dims, o in data["tensors"]
    ]
    if layers is None:
        return _core.ModelWeights(data["path"], data["config"], tensors, precision, kv_dtype)
    digests = [bytes.fromhex(d) for d in data["digests"]]
    return load_range(data["path"], data["config"], tensors, layers, precision, kv_dtype, digests)


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
