"""Synthetic checkpoints of real shapes (SPEC §15): GGUF files with a real model's
architecture metadata and random quantized weights, for measuring speed, memory and parity
at scales no downloadable model here has.

>>> import amplituhedron_rs as ar
>>> path = ar.synthetic_model("qwen2-7b", layers=2)  # written once, then reused
>>> m = ar.load_model(path)  # the same as ar.load_model("synthetic:qwen2-7b:layers=2")

A file is a pure function of (preset, quant, layers, seed): the same bytes on every machine
(its BLAKE3 is recorded beside it). Weights are random blocks scaled to std ≈ 1/√fan_in
(norms 1, biases small), so activations stay finite through every layer; the tokenizer is
the bundled SmolLM2 BPE padded with unused ``[PAD{i}]`` tokens to the preset's vocabulary
(as llama.cpp's converter pads Qwen's), so llama.cpp loads the same file.

Model names: ``synthetic:PRESET[:QUANT][:layers=N][:seed=S]`` (``synthetic:qwen2-7b``,
``synthetic:llama3-1b:q4_k_m:layers=2``) resolve to the cached file wherever a model
argument is accepted; see :func:`parse_spec`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from amplituhedron_rs.runtime import gguf_writer as gw
from amplituhedron_rs.runtime.gguf_file import SYNTHETIC_PREFIX
from amplituhedron_rs.runtime.synthetic_layout import (
    PRESETS,
    QUANTS,
    Preset,
    Spec,
    SyntheticError,
    metadata,
    planned_size,
    tensor_plans,
    tensor_type,
)

__all__ = [
    "PRESETS",
    "QUANTS",
    "Preset",
    "Spec",
    "SyntheticError",
    "Written",
    "cache_dir",
    "is_spec",
    "metadata",
    "parse_spec",
    "planned_size",
    "resolve",
    "synthetic_model",
    "tensor_plans",
    "tensor_type",
    "write_synthetic",
]

PREFIX = SYNTHETIC_PREFIX
#: Free bytes kept beyond the file's size when checking the disk.
DISK_MARGIN = 64 << 20

Progress = Callable[[int, int], None]


def is_spec(model: object) -> bool:
    """Whether a model argument names a synthetic model."""
    return isinstance(model, str) and model.startswith(PREFIX)


def parse_spec(text: str) -> Spec:
    """``synthetic:PRESET[:QUANT][:layers=N][:seed=S]``, fields after the preset in any order,
    case-insensitive quant (``q4_0``, ``q8_0``, ``q4_k_m``; default Q4_0)."""
    if not is_spec(text):
        raise SyntheticError(f"{text!r} is not a synthetic model name ({PREFIX}PRESET…)")
    preset, *fields = text[len(PREFIX) :].split(":")
    quant, layers, seed = "Q4_0", None, 0
    for f in fields:
        key, eq, value = f.partition("=")
        try:
            if eq and key == "layers":
                layers = int(value)
            elif eq and key == "seed":
                seed = int(value)
            elif not eq and f.upper() in QUANTS:
                quant = f.upper()
            else:
                raise ValueError(f)
        except ValueError:
            raise SyntheticError(
                f"{text!r}: cannot read {f!r} (expected a quant {'/'.join(QUANTS)}, "
                "layers=N or seed=S)"
            ) from None
    return Spec(preset, quant, layers, seed)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/amplituhedron/synthetic`` (``~/.cache/…`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "amplituhedron" / "synthetic"


# ----- writing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Written:
    """A synthetic file on disk."""

    path: Path
    spec: Spec
    size: int
    #: Hex BLAKE3 of the file (as recorded when it was written, for a reused file).
    blake3: str
    #: Seconds the write took (0 when an existing file was reused).
    seconds: float
    reused: bool


def _check_room(dest: Path, size: int) -> None:
    free = shutil.disk_usage(dest.parent).free
    if free < size + DISK_MARGIN:
        raise SyntheticError(
            f"not enough disk for {dest.name}: it needs {size:,} bytes ({size / 1e9:.2f} GB) "
            f"plus a {DISK_MARGIN >> 20} MiB margin, and {dest.parent} has {free:,} bytes "
            f"({free / 1e9:.2f} GB) free"
        )


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """Holds an exclusive lock beside ``dest``, so processes resolving the same name at once
    (the stations of a mesh) write it once and the others wait, then reuse it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no cross-process lock
        yield
        return
    with open(dest.with_name(dest.name + ".lock"), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _hash_file(path: Path) -> str:
    import blake3

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(path)
    return str(h.hexdigest())


def write_synthetic(
    spec: Spec, dest: str | Path | None = None, *, progress: Progress | None = None
) -> Written:
    """Writes ``spec``'s file to ``dest`` (default: the cache, where an existing file is
    reused), through a temporary file renamed into place, so a half-written file is never
    taken for a complete one. Refused before writing when the disk lacks room."""
    import blake3

    reuse = dest is None
    path = Path(dest) if dest is not None else cache_dir() / spec.file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    meta, plans = metadata(spec), tensor_plans(spec)
    size = gw.file_size(meta, plans)
    digest_file = path.with_name(path.name + ".blake3")
    with _locked(path):
        if reuse and path.is_file() and path.stat().st_size == size:
            recorded = digest_file.read_text().strip() if digest_file.is_file() else ""
            return Written(path, spec, size, recorded or _hash_file(path), 0.0, True)
        _check_room(path, size)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        start = time.perf_counter()
        try:
            with open(tmp, "wb") as f:
                report = (lambda n: progress(n, size)) if progress is not None else None
                gw.write(f, meta, plans, sink=hasher.update, progress=report)
            digest = str(hasher.hexdigest())
            digest_file.write_text(digest + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return Written(path, spec, size, digest, time.perf_counter() - start, False)


def synthetic_model(
    preset: str,
    layers: int | None = None,
    quant: str = "Q4_0",
    seed: int = 0,
    *,
    progress: Progress | None = None,
) -> Path:
    """The path of a synthetic checkpoint of ``preset``'s shape (``qwen2-7b``,
    ``qwen2-1.5b``, ``llama3-1b``, ``llama3-8b``), written to the cache on first use.

    ``layers`` makes a shallow variant (its layers are the full file's first ones, byte for
    byte); ``quant`` is ``Q4_0`` (Q8_0 embeddings and head), ``Q8_0`` or ``Q4_K_M``;
    ``seed`` picks other random weights.
    """
    spec = Spec(preset, quant.upper(), layers, seed)
    return write_synthetic(spec, progress=progress).path


def resolve(text: str) -> Path:
    """A ``synthetic:…`` model name as a path, writing the file on first use with a
    progress line on stderr."""
    spec = parse_spec(text)
    cached = cache_dir() / spec.file_name
    if cached.is_file():
        return write_synthetic(spec).path  # checks the size; waits for a writer's lock
    size = planned_size(spec)
    print(f"writing {spec.name} ({size / 1e9:.2f} GB) to {cached}", file=sys.stderr)
    w = write_synthetic(spec, progress=_stderr_progress())
    print(f"wrote {w.path} in {w.seconds:.1f} s, BLAKE3 {w.blake3}", file=sys.stderr)
    return w.path


def _stderr_progress() -> Progress:
    """Prints every 10 % (a line each; a TTY gets one line rewritten)."""
    tty = sys.stderr.isatty()
    shown = [-1]

    def report(done: int, total: int) -> None:
        step = done * 10 // max(total, 1)
        if step != shown[0]:
            shown[0] = step
            end = "\r" if tty and done < total else "\n"
            print(f"  {done / 1e9:6.2f} / {total / 1e9:.2f} GB", end=end, file=sys.stderr)

    return report
