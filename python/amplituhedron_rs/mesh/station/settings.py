"""What a station is started with (the CLI's flags, as one dataclass)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from amplituhedron_rs import _core
from amplituhedron_rs.runtime.gguf_file import read_model_file
from amplituhedron_rs.runtime.options import CacheOptions, Precision, SessionOptions
from amplituhedron_rs.runtime.weights import load_indexed_weights, load_weights


@dataclass
class StationSettings:
    """Everything a station is started with."""

    layer_lo: int
    layer_hi: int
    model_path: str | None = None
    #: A model index written by the mesh launcher (the header parsed once for K stations).
    model_index: str | None = None
    #: The mesh token every endpoint but /healthz requires; None only for an explicitly
    #: ``--insecure`` station (loopback only, enforced by :func:`~.app.serve`).
    token: str | None = None
    #: Serve /metrics without the token (a scraper on another host holds no mesh token).
    open_metrics: bool = False
    max_sessions: int = 8
    #: A client that vanished between requests leaves its session at most this long.
    session_idle_s: float = 30.0
    #: Octet bodies (forward, decode); JSON bodies get ``max_json_bytes``.
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_bytes: int = 1024 * 1024
    #: Rows one forward may carry (None: the session's ``max_chunk``).
    max_forward_rows: int | None = None
    #: Rows of ``logits=all`` one forward may ask for (each row is vocab × 4 bytes).
    max_logits_rows: int = 64
    #: Bytes of KV rings the station may hold (None: a quarter of physical memory).
    memory_budget: int | None = None
    #: How long a worker waits for a busy session before answering 409.
    busy_wait_s: float = 10.0
    cache: CacheOptions = field(default_factory=CacheOptions)
    session: SessionOptions = field(default_factory=SessionOptions)
    fault_injection: bool = False
    precision: Precision = "refined"

    def load_weights(self) -> _core.ModelWeights:
        if self.model_index is not None:
            return load_indexed_weights(Path(self.model_index), self.precision)
        return load_weights(read_model_file(self.model_path), self.precision)


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
