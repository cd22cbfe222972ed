"""Lean oracle parity: read the one-line oracles of the Lean modules and check the kernel.

An oracle is exactly one line ``theorem <name> : <expr> = <literal> := by decide`` whose
right-hand side is a literal: a Nat/Int (negatives allowed), ``true``/``false``, a list
``[…]``, a tuple ``(…)`` or an anonymous constructor ``⟨…⟩`` (read as a tuple), nested.
Multi-line theorems and theorems whose right-hand side is an expression are proofs, not
oracles.

Every oracle must have a counterpart in :data:`KERNEL`, a registry from theorem name to a
zero-argument callable that evaluates the same quantity with the Rust kernel (the inputs are
the Lean definitions, written out). A name missing from the registry is a failure, never a
skip, so a new Lean oracle cannot go unchecked. This module is the one parser: the pytest
parity suite and the bench's F5 check both use :func:`parity`.

Where the modules come from: the repository's ``lean/`` stays their source of truth, and the
build embeds every ``lean/**/*.lean`` into the extension (``build.rs``, ``include_str!``),
so an installed wheel checks the very text its kernel was built against, with no data files
to lose and no second copy in the repository. ``$AMPLITUHEDRON_LEAN_DIR`` or an explicit
directory reads ``.lean`` files from disk instead.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from amplituhedron_rs import _core

__all__ = [
    "KERNEL",
    "LEAN_DIR_ENV",
    "ORACLE_PATTERN",
    "PENTAD",
    "LeanOracle",
    "LeanSources",
    "LeanValue",
    "OracleResult",
    "check_oracle",
    "default_sources",
    "embedded_sources",
    "lean_equal",
    "lean_sources",
    "parity",
    "parse_lean_literal",
    "parse_oracle_line",
    "read_oracles",
]

#: The oracle convention (shared oracle notes §2), verbatim.
ORACLE_PATTERN = re.compile(r"^theorem\s+(\w+)\s*:\s*(.*\S)\s+=\s+(.+?)\s+:=\s+by\s+decide\s*$")

#: Environment variable naming a directory of ``.lean`` files to read instead of the
#: modules embedded in the extension.
LEAN_DIR_ENV = "AMPLITUHEDRON_LEAN_DIR"

#: The five ``*_runtime_oracle_*`` contracts the bench's F5 names (seed 001's "pentad").
PENTAD = (
    "vandermonde_runtime_oracle_plucker",
    "vandermonde_runtime_oracle_positive",
    "coordPlane_runtime_oracle_boundary",
    "vandermonde_runtime_oracle_vertex_count",
    "vandermonde_runtime_oracle_amplitude",
)

LeanValue: TypeAlias = "int | bool | list[LeanValue] | tuple[LeanValue, ...]"
#: Lean modules by path relative to the Lean root (``Gnosis/….lean``) → text.
LeanSources: TypeAlias = Mapping[str, str]

_BOOL_WORD = re.compile(r"\b(true|false)\b")


def _is_lean_value(value: object) -> bool:
    if isinstance(value, int):  # bool is an int subclass: both are literals
        return True
    if isinstance(value, list | tuple):
        return all(_is_lean_value(item) for item in value)
    return False


def parse_lean_literal(text: str) -> LeanValue | None:
    """The Python value of a Lean literal, or ``None`` when ``text`` is not one.

    ``true``/``false`` become booleans and ``⟨…⟩`` a tuple. Anything else that Python can
    read but Lean oracles do not use (strings, floats, ``None``, dicts) is not a literal.
    """
    python = _BOOL_WORD.sub(lambda m: m.group(1).capitalize(), text)
    python = python.replace("⟨", "(").replace("⟩", ")")
    try:
        value = ast.literal_eval(python)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return value if _is_lean_value(value) else None


def parse_oracle_line(line: str) -> tuple[str, str, LeanValue] | None:
    """``(name, lean_expression, expected)`` if ``line`` is an oracle, else ``None``."""
    match = ORACLE_PATTERN.match(line)
    if match is None:
        return None
    name, expression, rhs = match.groups()
    expected = parse_lean_literal(rhs)
    if expected is None:
        return None  # the right-hand side is an expression: a proof, not an oracle
    return name, expression, expected


@dataclass(frozen=True)
class LeanOracle:
    """One oracle line of a ``.lean`` file."""

    name: str
    file: str  #: path relative to the Lean directory
    line: int  #: 1-based line number
    expression: str  #: the Lean left-hand side
    expected: LeanValue


@dataclass(frozen=True)
class OracleResult:
    """The kernel's verdict on one oracle."""

    name: str
    file: str
    expected: LeanValue
    actual: object  #: the kernel's value, or ``None`` when it could not be computed
    ok: bool
    detail: str  #: why it failed ("" when ok)


def lean_sources(lean_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Every ``.lean`` file under ``lean_dir`` (hidden directories such as Lake's ``.lake/``
    skipped), by relative path. Raises ``FileNotFoundError`` if there is none."""
    root = Path(lean_dir)
    files = (
        sorted(
            path
            for path in root.rglob("*.lean")
            if not any(part.startswith(".") for part in path.relative_to(root).parts)
        )
        if root.is_dir()
        else []
    )
    if not files:
        raise FileNotFoundError(f"no .lean files under {root}")
    return {path.relative_to(root).as_posix(): path.read_text(encoding="utf-8") for path in files}


def embedded_sources() -> dict[str, str]:
    """The Lean modules built into the extension (``lean/`` as of the build)."""
    return dict(_core.lean_modules())


def default_sources() -> dict[str, str]:
    """The files under ``$AMPLITUHEDRON_LEAN_DIR`` when set, else :func:`embedded_sources`."""
    override = os.environ.get(LEAN_DIR_ENV)
    if not override:
        return embedded_sources()
    if not Path(override).is_dir():
        raise FileNotFoundError(f"{LEAN_DIR_ENV}={override} is not a directory")
    return lean_sources(override)


def read_oracles(source: str | os.PathLike[str] | LeanSources) -> list[LeanOracle]:
    """Every oracle of the Lean modules in ``source`` (a directory, or sources by path), in
    path and line order.

    Raises ``FileNotFoundError`` if there is no module, and ``ValueError`` if two oracles
    share a name (the registry could not tell them apart).
    """
    sources = source if isinstance(source, Mapping) else lean_sources(source)
    if not sources:
        raise FileNotFoundError("no Lean modules to read")
    oracles: list[LeanOracle] = []
    seen: dict[str, str] = {}
    for relative in sorted(sources):
        for number, line in enumerate(sources[relative].splitlines(), start=1):
            parsed = parse_oracle_line(line)
            if parsed is None:
                continue
            name, expression, expected = parsed
            if name in seen:
                raise ValueError(
                    f"duplicate oracle {name!r} in {relative}:{number} (first in {seen[name]})"
                )
            seen[name] = f"{relative}:{number}"
            oracles.append(LeanOracle(name, relative, number, expression, expected))
    return oracles


def lean_equal(expected: object, actual: object) -> bool:
    """Structural equality that keeps Lean's distinctions Python blurs: ``true`` is not
    ``1``, and a list is not a tuple."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(expected) is type(actual) and expected == actual
    if isinstance(expected, int):
        return isinstance(actual, int) and expected == actual
    if isinstance(expected, list | tuple):
        return (
            type(expected) is type(actual)
            and isinstance(actual, list | tuple)
            and len(expected) == len(actual)
            and all(lean_equal(e, a) for e, a in zip(expected, actual, strict=True))
        )
    return False


# ---------------------------------------------------------------------------------------
# The registry: the Lean inputs written out, evaluated by the Rust kernel.
# ---------------------------------------------------------------------------------------

#: Lean `vandermonde24`: nodes t = (1, 2, 3, 4).
VANDERMONDE_24 = ((1, 1, 1, 1), (1, 2, 3, 4))
#: Lean `coordPlane24`: span(e1, e2).
COORD_PLANE_24 = ((1, 0, 0, 0), (0, 1, 0, 0))
#: Lean `zMoment`: moment curve on the nodes 1..4.
Z_MOMENT = _core.oracle_moment_curve([1, 2, 3, 4])
#: Lean `zInterior`: Z_3 replaced by the interior point (2 : 5 : 16).
Z_INTERIOR = [Z_MOMENT[0], Z_MOMENT[1], (2, 5, 16), Z_MOMENT[3]]
#: Lean `cOnes` and `cDiagonal`, and the off-centre point.
C_ONES = (1, 1, 1, 1)
C_OFFCENTER = (1, 2, 1, 1)
C_DIAGONAL = (1, 2, 3, 4)


def _amplitude(c: Iterable[int]) -> tuple[int, int]:
    return _core.oracle_canonical_form(Z_MOMENT, _core.oracle_y_of(list(c), Z_MOMENT))


def _amplitude_fan(vertex: int, c: Iterable[int]) -> tuple[int, int]:
    return _core.oracle_fan_form(Z_MOMENT, vertex, _core.oracle_y_of(list(c), Z_MOMENT))


def _execution_volume(n: int) -> int | None:
    return _core.oracle_execution_volume(n)


def _execution_volume_beyond_u64(n: int) -> int | None:
    """F(n) for an n whose value exceeds u64: the u64 kernel must report the overflow, and the
    u128 kernel supplies the exact value the Lean (unbounded Nat) states."""
    if _core.oracle_execution_volume(n) is not None:
        raise ValueError(f"execution_volume({n}) fit in u64; the oracle says it must overflow")
    return _core.oracle_fib_u128(n)


def _soundness_bounded(bound: int) -> bool:
    return all(
        not _core.oracle_well_formed_prefix(p, layers)
        or _core.oracle_grassmannian_volume(p, layers) >= 1
        for p in range(bound)
        for layers in range(bound)
    )


KERNEL: Mapping[str, Callable[[], object]] = {
    # Gnosis.TopologicalAmplituhedron
    "origin_vertex_is_swerve": lambda: _core.ORACLE_CLINAMEN_SWERVE,
    "empty_prefix_has_no_volume": lambda: _core.oracle_admits_volume(0),
    "swerve_prefix_has_volume": lambda: _core.oracle_admits_volume(_core.ORACLE_CLINAMEN_SWERVE),
    "admits_volume_oracle": lambda: [_core.oracle_admits_volume(n) for n in (0, 1, 2, 4096)],
    "execution_volume_oracle_table": lambda: [_execution_volume(n) for n in range(16)],
    "execution_volume_oracle_90": lambda: _execution_volume(90),
    "execution_volume_oracle_u64_max": lambda: _execution_volume(93),
    "execution_volume_oracle_u64_overflow": lambda: _execution_volume_beyond_u64(94),
    "topological_erasure_oracle": lambda: [
        _core.oracle_topological_erasure(v) for v in (0, 1, 2, 7, 64)
    ],
    "trim_trailing_oracle": lambda: _core.oracle_trim_trailing([5, 9, 2, 7]),
    "trim_trailing_empty_oracle": lambda: _core.oracle_trim_trailing([]),
    # Gnosis.TopologicalGrassmannianCompiler
    "grassmannian_soundness_bounded": lambda: _soundness_bounded(9),
    "volume_equivalence_oracle": lambda: _core.oracle_grassmannian_volume(7, 32),
    "volume_equivalence_oracle_table": lambda: [
        _core.oracle_grassmannian_volume(p, layers)
        for p, layers in ((1, 1), (7, 32), (128, 28), (4096, 80), (0, 32))
    ],
    "soundness_oracle_empty": lambda: _core.oracle_well_formed_prefix(0, 32),
    "soundness_oracle_swerve": lambda: _core.oracle_well_formed_prefix(1, 1),
    "soundness_oracle_no_layers": lambda: _core.oracle_well_formed_prefix(7, 0),
    # Gnosis.AmplituhedronFalsifiability: Gr(2,4)
    "vandermonde_runtime_oracle_plucker": lambda: _core.oracle_plucker_coordinates(VANDERMONDE_24),
    "vandermonde_runtime_oracle_positive": lambda: _core.oracle_totally_positive(VANDERMONDE_24),
    "vandermonde_profile_oracle": lambda: _core.oracle_boundary_profile(VANDERMONDE_24),
    "vandermonde_plucker_relation_oracle": lambda: _core.oracle_plucker_residual(VANDERMONDE_24),
    "coordPlane_plucker_oracle": lambda: _core.oracle_plucker_coordinates(COORD_PLANE_24),
    "coordPlane_runtime_oracle_boundary": lambda: _core.oracle_boundary_profile(COORD_PLANE_24),
    # A_{4,1,2}
    "zMoment_minors_oracle": lambda: _core.oracle_maximal_minors(Z_MOMENT),
    "vandermonde_runtime_oracle_vertex_count": lambda: _core.oracle_vertex_count(Z_MOMENT),
    "zInterior_minors_oracle": lambda: _core.oracle_maximal_minors(Z_INTERIOR),
    "zInterior_vertex_count_oracle": lambda: _core.oracle_vertex_count(Z_INTERIOR),
    # The amplitude
    "amplitude_point_oracle": lambda: _core.oracle_y_of(list(C_ONES), Z_MOMENT),
    "vandermonde_runtime_oracle_amplitude": lambda: _amplitude(C_ONES),
    "amplitude_fan1_oracle": lambda: _amplitude_fan(0, C_ONES),
    "amplitude_fan2_oracle": lambda: _amplitude_fan(1, C_ONES),
    "amplitude_offcenter_oracle": lambda: _amplitude(C_OFFCENTER),
    "amplitude_offcenter_fan1_oracle": lambda: _amplitude_fan(0, C_OFFCENTER),
    "amplitude_offcenter_fan2_oracle": lambda: _amplitude_fan(1, C_OFFCENTER),
    "amplitude_diagonal_point_oracle": lambda: _core.oracle_y_of(list(C_DIAGONAL), Z_MOMENT),
    "amplitude_diagonal_on_24_oracle": lambda: _core.oracle_bracket(
        _core.oracle_y_of(list(C_DIAGONAL), Z_MOMENT), Z_MOMENT[1], Z_MOMENT[3]
    ),
    "amplitude_diagonal_oracle": lambda: _amplitude(C_DIAGONAL),
    "amplitude_diagonal_fan1_oracle": lambda: _amplitude_fan(0, C_DIAGONAL),
    # Cache key spaces
    "death_key_tags_oracle": _core.oracle_key_tags,
    "death1_encoding_oracle": lambda: _core.oracle_encode_memo_key(42),
    "death2_encoding_oracle": lambda: _core.oracle_encode_volume_key(7, 42, 0, 32),
}


def check_oracle(
    oracle: LeanOracle, kernel: Mapping[str, Callable[[], object]] = KERNEL
) -> OracleResult:
    """Evaluate ``oracle``'s kernel counterpart and compare it with the Lean literal.

    A missing counterpart or a kernel error is a failed result (``ok=False``) with the reason
    in ``detail``; nothing is skipped.
    """
    compute = kernel.get(oracle.name)
    if compute is None:
        return OracleResult(
            oracle.name,
            oracle.file,
            oracle.expected,
            None,
            False,
            f"no kernel counterpart registered for the Lean oracle {oracle.name!r} "
            f"({oracle.file}:{oracle.line}); add one to amplituhedron_rs.oracle.lean.KERNEL",
        )
    try:
        actual = compute()
    except Exception as exc:  # any kernel failure is a parity failure, reported, not raised
        return OracleResult(
            oracle.name,
            oracle.file,
            oracle.expected,
            None,
            False,
            f"the kernel raised {type(exc).__name__}: {exc}",
        )
    ok = lean_equal(oracle.expected, actual)
    detail = "" if ok else f"Lean says {oracle.expected!r}, the kernel gives {actual!r}"
    return OracleResult(oracle.name, oracle.file, oracle.expected, actual, ok, detail)


def parity(lean_dir: str | os.PathLike[str] | None = None) -> list[OracleResult]:
    """Checks every Lean oracle against the Rust kernel, one :class:`OracleResult` per
    oracle in path and line order: the modules of ``lean_dir`` if given, else
    :func:`default_sources` (the embedded modules unless ``$AMPLITUHEDRON_LEAN_DIR`` is set).
    """
    sources = default_sources() if lean_dir is None else lean_sources(lean_dir)
    return [check_oracle(oracle) for oracle in read_oracles(sources)]
