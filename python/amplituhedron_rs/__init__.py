"""amplituhedron-rs: a prefix-cached, pipeline-parallel LLM inference runtime.

The Rust core lives in :mod:`amplituhedron_rs._core`; this package re-exports it and
adds the model loader, tokenizer, station service, coordinator, mesh launcher and bench.
"""

from amplituhedron_rs._core import __version__

# --- volume cache, eviction, memo ---
# --- oracle kernel ---
# --- ring buffer and attention ---
# --- model runtime ---
# --- quantized kernels ---
# isort: split
from amplituhedron_rs._core import quant_dequantize, quant_embed, quant_kernels, quant_matmul

__all__ = [
    "__version__",
    "quant_dequantize",
    "quant_embed",
    "quant_kernels",
    "quant_matmul",
]
