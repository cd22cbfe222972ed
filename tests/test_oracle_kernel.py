"""The oracle kernel from Python, against independent exact computations (fractions/int)."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from itertools import combinations
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import amplituhedron_rs as ar

Point = tuple[int, int, int]
Num = TypeVar("Num", int, Fraction)
Z_MOMENT: list[Point] = [(1, t, t * t) for t in (1, 2, 3, 4)]

# --- independent reference implementations ----------------------------------------------


def det3(a: Sequence[Num], b: Sequence[Num], c: Sequence[Num]) -> Num:
    return (
        a[0] * (b[1] * c[2] - b[2] * c[1])
        - a[1] * (b[0] * c[2] - b[2] * c[0])
        + a[2] * (b[0] * c[1] - b[1] * c[0])
    )


def pluckers(m: Sequence[Sequence[int]]) -> list[int]:
    return [m[0][i] * m[1][j] - m[0][j] * m[1][i] for i, j in combinations(range(4), 2)]


def affine(y: Sequence[int]) -> tuple[Fraction, Fraction, Fraction]:
    return (Fraction(1), Fraction(y[1], y[0]), Fraction(y[2], y[0]))


def exact(p: Point) -> tuple[Fraction, Fraction, Fraction]:
    return (Fraction(p[0]), Fraction(p[1]), Fraction(p[2]))


def fan_sum(z: Sequence[Point], apex: int, y: Sequence[int]) -> Fraction | None:
    """ω in the affine chart by the fan from ``apex``; None at a spurious pole."""
    ya = affine(y)
    n = len(z)
    total = Fraction(0)
    for i in range(n - 2):
        a, b, c = (exact(z[(apex + k) % n]) for k in (0, i + 1, i + 2))
        den = det3(ya, a, b) * det3(ya, b, c) * det3(ya, c, a)
        if den == 0:
            return None
        total += det3(a, b, c) ** 2 / den
    return total


def dual_area(z: Sequence[Point], y: Sequence[int]) -> Fraction:
    """2 × area of the polar dual of (polygon − Y), built geometrically (dual vertices solve
    w·p_i = 1 = w·p_{i+1}) — a different computation from the kernel's closed vertex sum."""
    yx, yy = Fraction(y[1], y[0]), Fraction(y[2], y[0])
    p = [(Fraction(q[1], q[0]) - yx, Fraction(q[2], q[0]) - yy) for q in z]
    n = len(p)
    w = []
    for i in range(n):
        a, b = p[i], p[(i + 1) % n]
        d = a[0] * b[1] - a[1] * b[0]
        w.append(((b[1] - a[1]) / d, (a[0] - b[0]) / d))
    twice_area = sum(
        (w[i][0] * w[(i + 1) % n][1] - w[(i + 1) % n][0] * w[i][1] for i in range(n)), Fraction(0)
    )
    return abs(twice_area)


def hull_vertex_count(z: Sequence[Point]) -> int:
    """Andrew's monotone chain on the affine points (exact)."""
    pts = sorted({(Fraction(q[1], q[0]), Fraction(q[2], q[0])) for q in z})

    def cross(
        o: tuple[Fraction, Fraction], a: tuple[Fraction, Fraction], b: tuple[Fraction, Fraction]
    ) -> Fraction:
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    def chain(seq: list[tuple[Fraction, Fraction]]) -> list[tuple[Fraction, Fraction]]:
        hull: list[tuple[Fraction, Fraction]] = []
        for q in seq:
            while len(hull) >= 2 and cross(hull[-2], hull[-1], q) <= 0:
                hull.pop()
            hull.append(q)
        return hull[:-1]

    return len(chain(pts) + chain(pts[::-1]))


def as_pair(x: Fraction) -> tuple[int, int]:
    return (x.numerator, x.denominator)


# --- strategies -----------------------------------------------------------------------------

small = st.integers(min_value=-50, max_value=50)
matrices_2x4 = st.lists(
    st.lists(st.integers(min_value=-(10**9), max_value=10**9), min_size=4, max_size=4),
    min_size=2,
    max_size=2,
)


@st.composite
def positive_polygons(draw: st.DrawFn) -> list[Point]:
    """Positive data: the moment curve on increasing nodes, rows rescaled by positive factors."""
    n = draw(st.integers(min_value=3, max_value=7))
    start = draw(st.integers(min_value=-5, max_value=5))
    steps = draw(st.lists(st.integers(min_value=1, max_value=4), min_size=n, max_size=n))
    nodes = [start + sum(steps[: i + 1]) for i in range(n)]
    scales = draw(st.lists(st.integers(min_value=1, max_value=3), min_size=n, max_size=n))
    return [(s, s * t, s * t * t) for s, t in zip(scales, nodes, strict=True)]


# --- Gr(2,4) --------------------------------------------------------------------------------


@given(matrices_2x4)
def test_plucker_relation_residual_vanishes(m: list[list[int]]) -> None:
    assert ar.oracle.plucker_residual(m) == 0
    assert ar.oracle.plucker_coordinates(m) == pluckers(m)


@given(st.lists(st.lists(small, min_size=4, max_size=4), min_size=2, max_size=2))
def test_boundary_profile_agrees_with_the_coordinates(m: list[list[int]]) -> None:
    p = pluckers(m)
    profile = (all(x > 0 for x in p), all(x >= 0 for x in p), p.count(0))
    assert ar.oracle.boundary_profile(m) == profile
    assert ar.oracle.totally_positive(m) is profile[0]
    assert ar.oracle.totally_nonnegative(m) is profile[1]
    assert ar.oracle.zero_minor_count(m) == profile[2]


def test_matrix_shape_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="length 4"):
        ar.oracle.plucker_coordinates([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="length 2"):
        ar.oracle.plucker_coordinates([[1, 2, 3, 4]])
    with pytest.raises(OverflowError):
        ar.oracle.plucker_coordinates([[2**63, 0, 0, 0], [0, 1, 0, 0]])
    with pytest.raises(ValueError, match="overflow"):
        big = 2**63 - 1
        ar.oracle.plucker_residual([[-big, big, -big, 1], [big, -big, 1, -big]])


# --- A_{n,1,2} ------------------------------------------------------------------------------


@settings(max_examples=200)
@given(positive_polygons(), st.data())
def test_canonical_form_equals_fan_sums_and_dual_area(z: list[Point], data: st.DataObject) -> None:
    n = len(z)
    c = data.draw(st.lists(st.integers(min_value=1, max_value=9), min_size=n, max_size=n))
    y = ar.oracle.y_of(c, z)
    assert y == tuple(sum(ci * zi[a] for ci, zi in zip(c, z, strict=True)) for a in range(3))
    omega = ar.oracle.canonical_form(z, y)
    assert omega == as_pair(dual_area(z, y))
    for apex in range(n):
        expected = fan_sum(z, apex, y)
        if expected is None:
            with pytest.raises(ValueError, match="spurious pole"):
                ar.oracle.fan_form(z, apex, y)
        else:
            assert omega == as_pair(expected)
            assert ar.oracle.fan_form(z, apex, y) == omega


@settings(max_examples=200)
@given(positive_polygons(), st.tuples(small, small, small))
def test_points_are_classified_like_the_bracket_signs_say(
    z: list[Point], y: tuple[int, int, int]
) -> None:
    n = len(z)
    physical = [det3(y, z[i], z[(i + 1) % n]) for i in range(n)]
    if y == (0, 0, 0):
        with pytest.raises(ValueError, match="not a point"):
            ar.oracle.canonical_form(z, y)
    elif y[0] == 0:
        with pytest.raises(ValueError, match="Y_0 = 0"):
            ar.oracle.canonical_form(z, y)
    elif all(b > 0 for b in physical) or all(b < 0 for b in physical):
        assert ar.oracle.canonical_form(z, y) == as_pair(dual_area(z, y))
    elif any(b > 0 for b in physical) and any(b < 0 for b in physical):
        with pytest.raises(ValueError, match="outside"):
            ar.oracle.canonical_form(z, y)
    else:
        with pytest.raises(ValueError, match="boundary"):
            ar.oracle.canonical_form(z, y)


@given(
    st.lists(st.tuples(st.integers(min_value=1, max_value=3), small, small), min_size=3, max_size=8)
)
def test_vertex_count_matches_an_independent_hull(z: list[Point]) -> None:
    collinear = any(det3(a, b, c) == 0 for a, b, c in combinations(z, 3))
    if collinear:
        with pytest.raises(ValueError, match="collinear"):
            ar.oracle.vertex_count(z)
    else:
        assert ar.oracle.vertex_count(z) == hull_vertex_count(z)


def test_maximal_minors_are_the_lexicographic_brackets() -> None:
    z = [(1, 0, 0), (1, 3, 1), (2, 1, 7), (1, -2, 5), (3, 3, 3)]
    expected = [det3(a, b, c) for a, b, c in combinations(z, 3)]
    assert ar.oracle.maximal_minors(z) == expected
    assert ar.oracle.maximal_minors(z[:2]) == []
    assert ar.oracle.bracket(z[0], z[1], z[2]) == expected[0]


def test_spurious_pole_point_has_a_finite_amplitude() -> None:
    y = ar.oracle.y_of([1, 2, 3, 4], Z_MOMENT)
    assert y == (10, 30, 100)
    assert ar.oracle.bracket(y, Z_MOMENT[1], Z_MOMENT[3]) == 0
    assert ar.oracle.canonical_form(Z_MOMENT, y) == (16, 3)
    assert ar.oracle.fan_form(Z_MOMENT, 0, y) == (16, 3)
    with pytest.raises(ValueError, match=r"diagonal Z\[1\]–Z\[3\].*spurious pole"):
        ar.oracle.fan_form(Z_MOMENT, 1, y)


def test_polygon_input_errors() -> None:
    with pytest.raises(ValueError, match="boundary edge"):
        ar.oracle.canonical_form(Z_MOMENT, ar.oracle.y_of([1, 1, 0, 0], Z_MOMENT))
    with pytest.raises(ValueError, match="outside"):
        ar.oracle.canonical_form(Z_MOMENT, (1, 3, 8))
    z_interior = [Z_MOMENT[0], Z_MOMENT[1], (2, 5, 16), Z_MOMENT[3]]
    with pytest.raises(ValueError, match="not positive"):
        ar.oracle.canonical_form(z_interior, (5, 12, 37))
    with pytest.raises(ValueError, match="at least 3 points"):
        ar.oracle.canonical_form(Z_MOMENT[:2], (1, 1, 1))
    with pytest.raises(ValueError, match="not a row of Z"):
        ar.oracle.fan_form(Z_MOMENT, 4, (4, 10, 30))
    with pytest.raises(ValueError, match="one entry per row"):
        ar.oracle.y_of([1, 1], Z_MOMENT)
    with pytest.raises(ValueError, match="length 3"):
        ar.oracle.vertex_count([(1, 2), (3, 4), (5, 6)])
    with pytest.raises(ValueError, match="first coordinate"):
        ar.oracle.vertex_count([(1, 0, 0), (-1, 1, 0), (1, 0, 1)])
    with pytest.raises(ValueError, match="overflow"):
        ar.oracle.moment_curve([2**62])
    with pytest.raises(TypeError):
        ar.oracle.canonical_form(Z_MOMENT, "abc")  # type: ignore[arg-type]


# --- sizing laws and keys ------------------------------------------------------------------


def fib_reference(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


@pytest.mark.parametrize("n", [0, 1, 2, 10, 90, 92, 93])
def test_fib_fits_u64_through_93(n: int) -> None:
    assert ar.oracle.fib(n) == fib_reference(n)
    assert ar.oracle.execution_volume(n) == fib_reference(n)


def test_fib_overflows_u64_at_94_and_u128_at_187() -> None:
    assert fib_reference(93) < 2**64 <= fib_reference(94)
    assert ar.oracle.fib(94) is None
    assert ar.oracle.execution_volume(94) is None
    assert ar.oracle.fib_u128(94) == fib_reference(94)
    assert ar.oracle.fib_u128(186) == fib_reference(186) < 2**128
    assert ar.oracle.fib_u128(187) is None
    assert ar.oracle.fib(10**12) is None  # stops at the overflow, does not loop 10^12 times


def test_swerve_erasure_trim_volume_and_soundness() -> None:
    assert ar.oracle.CLINAMEN_SWERVE == 1
    assert [ar.oracle.admits_volume(n) for n in (0, 1, 2)] == [False, True, True]
    assert [ar.oracle.topological_erasure(v) for v in (0, 1, 64, 2**64 - 1)] == [
        0,
        0,
        63,
        2**64 - 2,
    ]
    assert ar.oracle.trim_trailing((5, 9, 2, 7)) == [5, 9, 2]
    assert ar.oracle.trim_trailing([]) == []
    assert ar.oracle.grassmannian_volume(4096, 80) == 327680
    assert ar.oracle.well_formed_prefix(1, 1)
    assert not ar.oracle.well_formed_prefix(0, 1)
    assert not ar.oracle.well_formed_prefix(1, 0)
    with pytest.raises(ValueError, match="overflow"):
        ar.oracle.grassmannian_volume(2**63, 2)
    with pytest.raises(OverflowError):
        ar.oracle.topological_erasure(-1)


@given(st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=20))
def test_trim_matches_erasure_of_the_length(xs: list[int]) -> None:
    trimmed = ar.oracle.trim_trailing(xs)
    assert trimmed == xs[:-1]
    assert len(trimmed) == ar.oracle.topological_erasure(len(xs))


def test_key_tags_and_encodings() -> None:
    assert ar.oracle.key_tags() == (1, 2)
    assert ar.oracle.encode_memo_key(42) == [1, 42]
    assert ar.oracle.encode_volume_key(7, 42, 0, 32) == [2, 7, 42, 0, 32]
    assert ar.oracle.encode_memo_key(2**64 - 1)[0] != ar.oracle.encode_volume_key(0, 0, 0, 0)[0]
    with pytest.raises(OverflowError):
        ar.oracle.encode_volume_key(0, 0, 0, 2**16)
