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
# isort: split
from amplituhedron_rs._core import (
    ORACLE_CLINAMEN_SWERVE,
    oracle_admits_volume,
    oracle_boundary_profile,
    oracle_bracket,
    oracle_canonical_form,
    oracle_encode_memo_key,
    oracle_encode_volume_key,
    oracle_execution_volume,
    oracle_fan_form,
    oracle_fib,
    oracle_fib_u128,
    oracle_grassmannian_volume,
    oracle_key_tags,
    oracle_maximal_minors,
    oracle_moment_curve,
    oracle_plucker_coordinates,
    oracle_plucker_residual,
    oracle_topological_erasure,
    oracle_totally_nonnegative,
    oracle_totally_positive,
    oracle_trim_trailing,
    oracle_vertex_count,
    oracle_well_formed_prefix,
    oracle_y_of,
    oracle_zero_minor_count,
)
from amplituhedron_rs.oracles import LeanOracle, OracleResult, oracle_parity

# --- ring buffer and attention ---
# isort: split
from amplituhedron_rs._core import RingBuffer, SemanticSpan, SpanType, attend

# --- model runtime ---
# --- quantized kernels ---
# isort: split
from amplituhedron_rs._core import quant_dequantize, quant_embed, quant_kernels, quant_matmul

__all__ = [
    "ORACLE_CLINAMEN_SWERVE",
    "AmplituhedronCache",
    "AmplituhedronVolume",
    "LeanOracle",
    "MatVecMemo",
    "OracleResult",
    "RingBuffer",
    "SemanticSpan",
    "SpanType",
    "__version__",
    "attend",
    "oracle_admits_volume",
    "oracle_boundary_profile",
    "oracle_bracket",
    "oracle_canonical_form",
    "oracle_encode_memo_key",
    "oracle_encode_volume_key",
    "oracle_execution_volume",
    "oracle_fan_form",
    "oracle_fib",
    "oracle_fib_u128",
    "oracle_grassmannian_volume",
    "oracle_key_tags",
    "oracle_maximal_minors",
    "oracle_moment_curve",
    "oracle_parity",
    "oracle_plucker_coordinates",
    "oracle_plucker_residual",
    "oracle_topological_erasure",
    "oracle_totally_nonnegative",
    "oracle_totally_positive",
    "oracle_trim_trailing",
    "oracle_vertex_count",
    "oracle_well_formed_prefix",
    "oracle_y_of",
    "oracle_zero_minor_count",
    "prefix_hash",
    "quant_dequantize",
    "quant_embed",
    "quant_kernels",
    "quant_matmul",
]
