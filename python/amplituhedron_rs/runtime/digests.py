"""The per-tensor digests of a model file, hashed once and cached.

The model fingerprint is made of one BLAKE3 digest per tensor (see the core's
``weights/digest.rs``), so a station loading one layer range hashes only its own tensors
and takes the others' digests from here, checking its own against them as it copies them.
Hashing a 4.8 GB file takes seconds on two cores, once; 28 stations doing it each would take
minutes and (through a mapping) leave the whole file resident in every one of them. The
digests are read with plain ``read`` (nothing mapped) by ``_core.tensor_digests`` and cached
under ``$XDG_CACHE_HOME/amplituhedron-rs/digests`` (``~/.cache`` by default), keyed by the
file's identity (path, device, inode, size, modification and change times, in nanoseconds)
and its tensor table. Any write to the file changes its change time, so a cached entry never
outlives the bytes it describes; and the stations check every tensor they hold against it,
so a stale entry is caught (then dropped and recomputed) rather than trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from amplituhedron_rs import _core

TensorTable = list[tuple[str, int, list[int], int]]

#: Part of the message of the core's refusal when a tensor differs from its recorded digest.
DIGEST_MISMATCH = "do not match the digest recorded"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "amplituhedron-rs" / "digests"


def _identity(path: Path, table: TensorTable) -> dict[str, Any]:
    st = os.stat(path)
    return {
        "path": str(path.resolve()),
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "table": hashlib.sha256(json.dumps(table).encode()).hexdigest(),
    }


def _entry(identity: dict[str, Any]) -> Path:
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / f"{key}.json"


def model_digests(path: str | Path, table: TensorTable) -> list[bytes]:
    """The digest of every tensor of ``table`` in the file at ``path`` (table order): from the
    cache when the file is the one hashed before, else hashed now and cached (best effort: an
    unwritable cache directory only costs the next caller the hashing)."""
    path = Path(path)
    identity = _identity(path, table)
    entry = _entry(identity)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        data = json.loads(entry.read_text())
        digests = [bytes.fromhex(d) for d in data["digests"]]
        if data["identity"] == identity and len(digests) == len(table):
            return digests
    digests = [bytes(d) for d in _core.tensor_digests(str(path), table)]
    with contextlib.suppress(OSError):
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".digests-")
        with os.fdopen(fd, "w") as f:
            json.dump({"identity": identity, "digests": [d.hex() for d in digests]}, f)
        os.replace(tmp, entry)
    return digests


def forget_digests(path: str | Path, table: TensorTable) -> None:
    """Drops the cached digests of a file (a station found one of them wrong)."""
    with contextlib.suppress(OSError):
        _entry(_identity(Path(path), table)).unlink()
