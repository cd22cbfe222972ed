"""Writing a GGUF file (version 3): typed metadata, a tensor table, and tensor data streamed
in chunks, so a multi-GB file is never held in memory.

Only what the synthetic checkpoints need (:mod:`.synthetic`): scalar and array values of the
types llama.cpp reads for model metadata, and tensors given as their exact bytes. Every value
carries its GGUF type because llama.cpp checks it (``block_count`` must be a UINT32…), and the
byte stream is a pure function of the inputs (no timestamps, no dict ordering surprises).
"""

from __future__ import annotations

import contextlib
import queue
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import numpy as np

from amplituhedron_rs.runtime.gguf_file import ModelFileError

VERSION = 3
ALIGNMENT = 32

#: GGUF value types by name (gguf.h ``enum gguf_type``).
Kind = Literal["u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str", "u64", "i64", "f64"]
_TYPE_IDS: dict[str, int] = {
    "u8": 0,
    "i8": 1,
    "u16": 2,
    "i16": 3,
    "u32": 4,
    "i32": 5,
    "f32": 6,
    "bool": 7,
    "str": 8,
    "u64": 10,
    "i64": 11,
    "f64": 12,
}
_ARRAY = 9
_STRUCT = {
    "u8": "<B",
    "i8": "<b",
    "u16": "<H",
    "i16": "<h",
    "u32": "<I",
    "i32": "<i",
    "f32": "<f",
    "bool": "<?",
    "u64": "<Q",
    "i64": "<q",
    "f64": "<d",
}
_NUMPY = {k: v.replace("<?", "?") for k, v in _STRUCT.items()}


@dataclass(frozen=True)
class Meta:
    """One metadata entry: ``value`` of GGUF type ``kind`` (a sequence when ``array``)."""

    key: str
    kind: Kind
    value: Any
    array: bool = False


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: its name, ggml type, GGUF dims (fastest-varying first), byte
    size, and a producer of exactly ``nbytes`` bytes in chunks."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    nbytes: int
    chunks: Callable[[], Iterator[np.ndarray[Any, np.dtype[np.uint8]]]]


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: str, v: Any) -> bytes:
    if kind == "str":
        return _string(str(v))
    return struct.pack(_STRUCT[kind], v)


def encode_meta(m: Meta) -> bytes:
    """The bytes of one key/value pair."""
    head = _string(m.key)
    if not m.array:
        return head + struct.pack("<I", _TYPE_IDS[m.kind]) + _value(m.kind, m.value)
    values: Sequence[Any] = m.value
    out = head + struct.pack("<IIQ", _ARRAY, _TYPE_IDS[m.kind], len(values))
    if m.kind == "str":
        return out + b"".join(_string(str(s)) for s in values)
    return out + np.asarray(values, dtype=_NUMPY[m.kind]).tobytes()


def _pad(n: int) -> int:
    return -n % ALIGNMENT


def header_bytes(meta: Sequence[Meta], tensors: Sequence[TensorPlan]) -> bytes:
    """Everything before the tensor data (padded to the alignment)."""
    parts = [b"GGUF", struct.pack("<IQQ", VERSION, len(tensors), len(meta))]
    parts += [encode_meta(m) for m in meta]
    offset = 0
    for t in tensors:
        parts.append(_string(t.name))
        parts.append(struct.pack("<I", len(t.dims)))
        parts.append(struct.pack(f"<{len(t.dims)}Q", *t.dims))
        parts.append(struct.pack("<IQ", t.ggml_type, offset))
        offset += t.nbytes + _pad(t.nbytes)
    head = b"".join(parts)
    return head + bytes(_pad(len(head)))


def file_size(meta: Sequence[Meta], tensors: Sequence[TensorPlan]) -> int:
    """The size of the file :func:`write` produces."""
    return len(header_bytes(meta, tensors)) + sum(t.nbytes + _pad(t.nbytes) for t in tensors)


def write(
    f: BinaryIO,
    meta: Sequence[Meta],
    tensors: Sequence[TensorPlan],
    *,
    sink: Callable[[memoryview], object] | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Writes the file to ``f``; every written piece also goes to ``sink`` (a hash), and
    ``progress`` gets the bytes written so far after each chunk. Returns the size."""

    def emit(data: memoryview) -> None:
        f.write(data)
        if sink is not None:
            sink(data)

    written = 0
    for piece in _prefetched(_pieces(meta, tensors)):
        emit(piece)
        written += len(piece)
        if progress is not None:
            progress(written)
    return written


def _prefetched(pieces: Iterable[memoryview], depth: int = 2) -> Iterator[memoryview]:
    """``pieces`` in order, produced by a helper thread ``depth`` ahead, so making the next
    chunk (numpy, without the GIL) overlaps writing and hashing this one."""
    done = object()
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for piece in pieces:
                if stop.is_set():
                    return
                q.put(piece)
            q.put(done)
        except BaseException as exc:  # handed to the consumer, raised there
            q.put(exc)

    worker = threading.Thread(target=produce, name="gguf-writer", daemon=True)
    worker.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # unblock a producer waiting on a full queue
            with contextlib.suppress(queue.Empty):
                q.get(timeout=0.05)
        worker.join()


def _pieces(meta: Sequence[Meta], tensors: Sequence[TensorPlan]) -> Iterable[memoryview]:
    yield memoryview(header_bytes(meta, tensors))
    for t in tensors:
        n = 0
        for chunk in t.chunks():
            view = np.ascontiguousarray(chunk, np.uint8).reshape(-1).data
            n += len(view)
            yield view
        if n != t.nbytes:
            raise ModelFileError(f"tensor {t.name}: produced {n} bytes, planned {t.nbytes}")
        if _pad(n):
            yield memoryview(bytes(_pad(n)))
