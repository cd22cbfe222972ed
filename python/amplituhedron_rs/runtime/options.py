"""What a session's ring and a volume cache are sized with. Every default is the core's own
(``_core.DEFAULTS``), so the runtime, the stations and the CLI cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from amplituhedron_rs._core import DEFAULTS

Policy = Literal["pisot", "lru", "gdsf"]
Precision = Literal["refined", "fast"]
#: How sessions store K and V: f16 (half the memory and attention traffic) or f32.
KvDtype = Literal["f16", "f32"]
DEFAULT_KV_DTYPE: KvDtype = DEFAULTS.kv_dtype


@dataclass(frozen=True)
class SessionOptions:
    """Ring-buffer geometry of each session (SPEC §3)."""

    slots: int = DEFAULTS.slots
    recall: int = DEFAULTS.recall
    n_sys: int = DEFAULTS.n_sys
    max_chunk: int = DEFAULTS.max_chunk


@dataclass(frozen=True)
class BatchOptions:
    """Continuous batching: sequences running at once, requests waiting, rows per step."""

    max_running: int = 8
    max_queue: int = 64
    #: Rows per step: decode rows first, then prompt chunks with the rest. Larger is faster
    #: for one long prompt; smaller bounds the other streams' inter-token latency.
    step_tokens: int = 256


@dataclass(frozen=True)
class CacheOptions:
    """Volume-cache bounds (SPEC §2)."""

    enabled: bool = True
    max_entries: int = DEFAULTS.max_entries
    max_prefix_len: int = DEFAULTS.max_prefix_len
    max_bytes: int | None = DEFAULTS.max_bytes
    policy: Policy = DEFAULTS.policy
    #: After an exact miss, reuse the longest cached prefix of at least this many tokens
    #: (0: exact-prompt replay only).
    min_prefix_reuse: int = DEFAULTS.min_prefix_reuse
    #: Persist every captured volume under this directory (None: memory only). Each model
    #: fingerprint and layer range gets its own subdirectory, so one directory serves every
    #: station of a host and several models; a restart serves hits from it at once.
    cache_dir: str | Path | None = None
    #: Disk budget of the persisted volumes, evicted by the same policy (None: unbounded).
    max_disk_bytes: int | None = None
