"""The exact kernel of the Lean oracles, and the parity check against the Lean modules.

Kernel functions compute, in exact integer/rational arithmetic, the quantities the Lean
oracles (``lean/Gnosis``) state: Plücker coordinates and positivity of Gr(2,4) points, the
vertex count and canonical-form amplitude of A(4,1,2), Fibonacci sizing, erasure, volume
sizes and cache-key encodings. Matrices are sequences of rows; points of P² are integer
triples; rationals are reduced ``(num, den)`` with ``den > 0``. Semantic errors raise
``InputError`` (a ``ValueError``); non-integers ``TypeError``; integers outside the
kernel's range ``OverflowError``.

>>> import amplituhedron_rs as ar
>>> ar.oracle.fib(10)
55
>>> all(r.ok for r in ar.oracle.parity())
True
"""

from amplituhedron_rs._core import ORACLE_CLINAMEN_SWERVE as CLINAMEN_SWERVE
from amplituhedron_rs._core import (
    oracle_admits_volume as admits_volume,
)
from amplituhedron_rs._core import (
    oracle_boundary_profile as boundary_profile,
)
from amplituhedron_rs._core import (
    oracle_bracket as bracket,
)
from amplituhedron_rs._core import (
    oracle_canonical_form as canonical_form,
)
from amplituhedron_rs._core import (
    oracle_encode_memo_key as encode_memo_key,
)
from amplituhedron_rs._core import (
    oracle_encode_volume_key as encode_volume_key,
)
from amplituhedron_rs._core import (
    oracle_execution_volume as execution_volume,
)
from amplituhedron_rs._core import (
    oracle_fan_form as fan_form,
)
from amplituhedron_rs._core import (
    oracle_fib as fib,
)
from amplituhedron_rs._core import (
    oracle_fib_u128 as fib_u128,
)
from amplituhedron_rs._core import (
    oracle_grassmannian_volume as grassmannian_volume,
)
from amplituhedron_rs._core import (
    oracle_key_tags as key_tags,
)
from amplituhedron_rs._core import (
    oracle_maximal_minors as maximal_minors,
)
from amplituhedron_rs._core import (
    oracle_moment_curve as moment_curve,
)
from amplituhedron_rs._core import (
    oracle_plucker_coordinates as plucker_coordinates,
)
from amplituhedron_rs._core import (
    oracle_plucker_residual as plucker_residual,
)
from amplituhedron_rs._core import (
    oracle_topological_erasure as topological_erasure,
)
from amplituhedron_rs._core import (
    oracle_totally_nonnegative as totally_nonnegative,
)
from amplituhedron_rs._core import (
    oracle_totally_positive as totally_positive,
)
from amplituhedron_rs._core import (
    oracle_trim_trailing as trim_trailing,
)
from amplituhedron_rs._core import (
    oracle_vertex_count as vertex_count,
)
from amplituhedron_rs._core import (
    oracle_well_formed_prefix as well_formed_prefix,
)
from amplituhedron_rs._core import (
    oracle_y_of as y_of,
)
from amplituhedron_rs._core import (
    oracle_zero_minor_count as zero_minor_count,
)
from amplituhedron_rs.oracle.lean import LeanOracle, OracleResult, parity

__all__ = [
    "CLINAMEN_SWERVE",
    "LeanOracle",
    "OracleResult",
    "admits_volume",
    "boundary_profile",
    "bracket",
    "canonical_form",
    "encode_memo_key",
    "encode_volume_key",
    "execution_volume",
    "fan_form",
    "fib",
    "fib_u128",
    "grassmannian_volume",
    "key_tags",
    "maximal_minors",
    "moment_curve",
    "parity",
    "plucker_coordinates",
    "plucker_residual",
    "topological_erasure",
    "totally_nonnegative",
    "totally_positive",
    "trim_trailing",
    "vertex_count",
    "well_formed_prefix",
    "y_of",
    "zero_minor_count",
]
