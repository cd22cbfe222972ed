"""amplituhedron-rs: a prefix-cached, pipeline-parallel LLM inference runtime.

The Rust core lives in :mod:`amplituhedron_rs._core`; this package re-exports it and
adds the model loader, tokenizer, station service, coordinator, mesh launcher and bench.
"""

from amplituhedron_rs._core import __version__

# --- volume cache, eviction, memo ---
# isort: split
from amplituhedron_rs._core import (
    AmplituhedronCache,
    AmplituhedronVolume,
    MatVecMemo,
    prefix_hash,
)

# --- oracle kernel ---
# --- ring buffer and attention ---
# --- model runtime ---

__all__ = [
    "AmplituhedronCache",
    "AmplituhedronVolume",
    "MatVecMemo",
    "__version__",
    "prefix_hash",
]
