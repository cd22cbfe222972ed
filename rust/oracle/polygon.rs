//! The amplituhedron A_{n,1,2}: for positive data `Z` (n × 3, all ordered maximal minors > 0)
//! it is the convex polygon with vertices `Z_1..Z_n` in P², and `Y = C·Z` with `C ≥ 0`.
//!
//! Its canonical form is `Ω = ω(Y)·⟨Y d²Y⟩/2`. [`canonical_form`] evaluates ω exactly in the
//! affine chart `Y_0 = 1` (ω is homogeneous of degree −3, so an integer representative is
//! rescaled by `Y_0³`) with a formula that divides only by the physical brackets
//! `⟨Y i i+1⟩`: 2 × the area of the polar dual of the polygon seen from `Y`, written as a sum
//! over the vertices,
//!
//! ```text
//! ω_aff(Y) = Y_0² · Σ_i ⟨i−1 i i+1⟩ · Z_i^0 / (⟨Y i−1 i⟩ ⟨Y i i+1⟩).
//! ```
//!
//! (Dual vertex `W_i` is the edge line `Z_i × Z_{i+1}` scaled to the chart; the cross product
//! of consecutive dual vertices is `⟨i−1 i i+1⟩ Z_i / (⟨Y i−1 i⟩⟨Y i i+1⟩)` by
//! `(A×B)×(B×C) = ⟨A B C⟩ B`.) A fan triangulation ([`fan_form`]) gives the same value but has
//! spurious poles where `Y` lies on one of its diagonals, e.g. `C = (1,2,3,4)` on the moment
//! curve puts `Y` on the diagonal 2–4.

use super::{OracleError, Rational};

/// A row of `Z`: homogeneous coordinates of a point of P².
pub type Point = [i64; 3];

/// A point `Y` of P² (wide, since `Y = C·Z` sums products of `i64`s).
pub type HomogeneousPoint = [i128; 3];

fn overflow(quantity: &'static str) -> impl Fn() -> OracleError {
    move || OracleError::Overflow { quantity }
}

fn widen(p: &Point) -> HomogeneousPoint {
    p.map(i128::from)
}

/// The bracket `⟨a b c⟩ = det[a; b; c]`.
pub fn bracket(
    a: &HomogeneousPoint,
    b: &HomogeneousPoint,
    c: &HomogeneousPoint,
) -> Result<i128, OracleError> {
    let of = overflow("a 3×3 bracket");
    let minor = |i: usize, j: usize| -> Result<i128, OracleError> {
        let x = b[i].checked_mul(c[j]).ok_or_else(&of)?;
        let y = b[j].checked_mul(c[i]).ok_or_else(&of)?;
        x.checked_sub(y).ok_or_else(&of)
    };
    let t0 = a[0].checked_mul(minor(1, 2)?).ok_or_else(&of)?;
    let t1 = a[1].checked_mul(minor(0, 2)?).ok_or_else(&of)?;
    let t2 = a[2].checked_mul(minor(0, 1)?).ok_or_else(&of)?;
    t0.checked_sub(t1)
        .and_then(|x| x.checked_add(t2))
        .ok_or_else(&of)
}

fn bracket_z(z: &[HomogeneousPoint], i: usize, j: usize, k: usize) -> Result<i128, OracleError> {
    bracket(&z[i], &z[j], &z[k])
}

/// Points `(1, t, t²)` of the moment curve, one per node (positive data when the nodes
/// increase).
pub fn moment_curve(nodes: &[i64]) -> Result<Vec<Point>, OracleError> {
    nodes
        .iter()
        .map(|&t| {
            let t2 = t
                .checked_mul(t)
                .ok_or_else(overflow("a moment-curve point"))?;
            Ok([1, t, t2])
        })
        .collect()
}

/// Index triples `i < j < k` of `0..n` in lexicographic order.
fn triples(n: usize) -> impl Iterator<Item = [usize; 3]> {
    (0..n).flat_map(move |i| (i + 1..n).flat_map(move |j| (j + 1..n).map(move |k| [i, j, k])))
}

/// All maximal minors `⟨i j k⟩`, `i < j < k`, in lexicographic order (for n = 4: 123, 124,
/// 134, 234). `Z` is positive data iff all are > 0.
pub fn maximal_minors(z: &[Point]) -> Result<Vec<i128>, OracleError> {
    let z: Vec<HomogeneousPoint> = z.iter().map(widen).collect();
    triples(z.len())
        .map(|[i, j, k]| bracket_z(&z, i, j, k))
        .collect()
}

/// Number of vertices of the convex hull of the rows of `Z` in P².
///
/// The criterion is the Lean one: `i` is a vertex iff some directed segment `i → j` has
/// every other point strictly to its left (`⟨Z_i Z_j Z_k⟩ > 0`). It is valid only for points
/// in general position inside the chart `Z_0 > 0`, so both are checked first: a row with
/// `Z_i^0 ≤ 0` or three collinear rows is an error, not a silently wrong count.
pub fn vertex_count(z: &[Point]) -> Result<usize, OracleError> {
    let n = z.len();
    if n < 3 {
        return Err(OracleError::TooFewPoints { found: n });
    }
    if let Some(point) = z.iter().position(|p| p[0] <= 0) {
        return Err(OracleError::PointNotInChart { point });
    }
    let z: Vec<HomogeneousPoint> = z.iter().map(widen).collect();
    for [i, j, k] in triples(n) {
        if bracket_z(&z, i, j, k)? == 0 {
            return Err(OracleError::Collinear { triple: [i, j, k] });
        }
    }
    let mut count = 0;
    for i in 0..n {
        let mut is_vertex = false;
        for j in (0..n).filter(|&j| j != i) {
            let mut is_edge = true;
            for k in (0..n).filter(|&k| k != i && k != j) {
                if bracket_z(&z, i, j, k)? <= 0 {
                    is_edge = false;
                    break;
                }
            }
            if is_edge {
                is_vertex = true;
                break;
            }
        }
        count += usize::from(is_vertex);
    }
    Ok(count)
}

/// `Y = C·Z` for a row `C` of length n.
pub fn y_of(c: &[i64], z: &[Point]) -> Result<HomogeneousPoint, OracleError> {
    if c.len() != z.len() {
        return Err(OracleError::LengthMismatch {
            what: "C must have one entry per row of Z",
            expected: z.len(),
            found: c.len(),
        });
    }
    let of = overflow("Y = C·Z");
    let mut y = [0i128; 3];
    for (&ci, zi) in c.iter().zip(z) {
        for (ya, &za) in y.iter_mut().zip(zi) {
            // i64 × i64 always fits in i128; only the running sum can overflow.
            *ya = ya
                .checked_add(i128::from(ci) * i128::from(za))
                .ok_or_else(&of)?;
        }
    }
    Ok(y)
}

/// Checks that `Z` is positive data and `Y` a point strictly inside the polygon, in the chart
/// `Y_0 ≠ 0`. Returns `Z` widened and the physical brackets `⟨Y Z_i Z_{i+1}⟩` (cyclic).
fn validate_interior(
    z: &[Point],
    y: &HomogeneousPoint,
) -> Result<(Vec<HomogeneousPoint>, Vec<i128>), OracleError> {
    let n = z.len();
    if n < 3 {
        return Err(OracleError::TooFewPoints { found: n });
    }
    let zw: Vec<HomogeneousPoint> = z.iter().map(widen).collect();
    for [i, j, k] in triples(n) {
        let minor = bracket_z(&zw, i, j, k)?;
        if minor <= 0 {
            return Err(OracleError::NotPositive {
                triple: [i, j, k],
                minor,
            });
        }
    }
    if *y == [0, 0, 0] {
        return Err(OracleError::ZeroPoint);
    }
    if y[0] == 0 {
        return Err(OracleError::YNotInChart);
    }
    let physical: Vec<i128> = (0..n)
        .map(|i| bracket(y, &zw[i], &zw[(i + 1) % n]))
        .collect::<Result<_, _>>()?;
    // Y and −Y are the same point of P²: orient by the sign the brackets share inside.
    let orientation: i128 = if physical.iter().any(|&b| b > 0) {
        1
    } else {
        -1
    };
    if let Some(i) = physical.iter().position(|&b| b * orientation < 0) {
        return Err(OracleError::Outside {
            edge: [i, (i + 1) % n],
            bracket: physical[i],
        });
    }
    if let Some(i) = physical.iter().position(|&b| b == 0) {
        return Err(OracleError::OnBoundary {
            edge: [i, (i + 1) % n],
        });
    }
    Ok((zw, physical))
}

/// `Y_0^power` as a rational, for the affine rescaling.
fn chart_factor(y: &HomogeneousPoint, power: u32) -> Result<Rational, OracleError> {
    let value = y[0]
        .checked_pow(power)
        .ok_or_else(overflow("the chart factor Y_0^k"))?;
    Ok(Rational::from_integer(value))
}

/// The canonical-form amplitude ω of A_{n,1,2} at `Y`, exact, in the affine chart `Y_0 = 1`.
///
/// Uses the dual-area vertex sum (module docs), which divides only by the physical
/// brackets, so it is finite everywhere inside, including on the diagonals where a fan
/// triangulation breaks down. Errors: `Z` not positive, `Y` on the boundary (a physical
/// pole), outside, at `Y_0 = 0`, or an intermediate overflow.
pub fn canonical_form(z: &[Point], y: &HomogeneousPoint) -> Result<Rational, OracleError> {
    let (zw, physical) = validate_interior(z, y)?;
    let n = zw.len();
    let of = overflow("the canonical form");
    let mut sum = Rational::ZERO;
    for i in 0..n {
        let prev = (i + n - 1) % n;
        let next = (i + 1) % n;
        let num = bracket_z(&zw, prev, i, next)?
            .checked_mul(zw[i][0])
            .ok_or_else(&of)?;
        let den = physical[prev].checked_mul(physical[i]).ok_or_else(&of)?;
        sum = sum.checked_add(Rational::new(num, den)?)?;
    }
    sum.checked_mul(chart_factor(y, 2)?)
}

/// The same ω as the fan triangulation from vertex `vertex` (0-based): triangles
/// `(r, r+i+1, r+i+2)` mod n, each contributing `⟨a b c⟩² / (⟨Y a b⟩⟨Y b c⟩⟨Y c a⟩)`,
/// rescaled by `Y_0³` (Lean `fanForm` + `affine`).
///
/// Kept as an independent cross-check of [`canonical_form`]; besides the errors of that
/// function it fails with [`OracleError::SpuriousPole`] when `Y` lies on one of the fan's
/// diagonals.
pub fn fan_form(z: &[Point], vertex: usize, y: &HomogeneousPoint) -> Result<Rational, OracleError> {
    if vertex >= z.len() {
        return Err(OracleError::VertexOutOfRange {
            vertex,
            points: z.len(),
        });
    }
    let (zw, _) = validate_interior(z, y)?;
    let n = zw.len();
    let of = overflow("a fan triangulation");
    let mut sum = Rational::ZERO;
    for i in 0..n - 2 {
        let (a, b, c) = (vertex, (vertex + i + 1) % n, (vertex + i + 2) % n);
        // Y is strictly inside, so only a diagonal (an edge through the apex that is not a
        // polygon edge) can give a zero bracket.
        let ab = bracket(y, &zw[a], &zw[b])?;
        let bc = bracket(y, &zw[b], &zw[c])?;
        let ca = bracket(y, &zw[c], &zw[a])?;
        for (value, diagonal) in [(ab, [a, b]), (ca, [a, c])] {
            if value == 0 {
                return Err(OracleError::SpuriousPole { vertex, diagonal });
            }
        }
        let abc = bracket_z(&zw, a, b, c)?;
        let num = abc.checked_mul(abc).ok_or_else(&of)?;
        let den = ab
            .checked_mul(bc)
            .and_then(|x| x.checked_mul(ca))
            .ok_or_else(&of)?;
        sum = sum.checked_add(Rational::new(num, den)?)?;
    }
    sum.checked_mul(chart_factor(y, 3)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn z_moment() -> Vec<Point> {
        moment_curve(&[1, 2, 3, 4]).unwrap()
    }

    /// The falsifier: Z_3 replaced by the interior point (2 : 5 : 16) ~ (5/2, 8).
    fn z_interior() -> Vec<Point> {
        let mut z = z_moment();
        z[2] = [2, 5, 16];
        z
    }

    fn q(num: i128, den: i128) -> Rational {
        Rational::new(num, den).unwrap()
    }

    fn amplitude(c: &[i64]) -> Result<Rational, OracleError> {
        let z = z_moment();
        canonical_form(&z, &y_of(c, &z)?)
    }

    /// Independent vertex count: Andrew's monotone chain on the affine points, comparing
    /// cross products of rationals exactly by cross-multiplying.
    fn hull_vertex_count(z: &[Point]) -> usize {
        // Affine point (x1/x0, x2/x0) kept as (x1, x2, x0) with x0 > 0.
        let mut pts: Vec<(i128, i128, i128)> = z
            .iter()
            .map(|p| (i128::from(p[1]), i128::from(p[2]), i128::from(p[0])))
            .collect();
        let key = |p: &(i128, i128, i128), q: &(i128, i128, i128)| {
            (p.0 * q.2)
                .cmp(&(q.0 * p.2))
                .then((p.1 * q.2).cmp(&(q.1 * p.2)))
        };
        pts.sort_by(key);
        // cross(o, a, b) scaled by o2² a2 b2 > 0, so its sign is the true sign.
        let cross = |o: &(i128, i128, i128), a: &(i128, i128, i128), b: &(i128, i128, i128)| {
            let (ax, ay) = (a.0 * o.2 - o.0 * a.2, a.1 * o.2 - o.1 * a.2); // × o2·a2
            let (bx, by) = (b.0 * o.2 - o.0 * b.2, b.1 * o.2 - o.1 * b.2); // × o2·b2
            ax * by - ay * bx
        };
        let chain = |iter: &mut dyn Iterator<Item = &(i128, i128, i128)>| {
            let mut h: Vec<(i128, i128, i128)> = Vec::new();
            for p in iter {
                while h.len() >= 2 && cross(&h[h.len() - 2], &h[h.len() - 1], p) <= 0 {
                    h.pop();
                }
                h.push(*p);
            }
            h.pop();
            h.len()
        };
        chain(&mut pts.iter()) + chain(&mut pts.iter().rev())
    }

    #[test]
    fn moment_curve_minors_and_vertices() {
        let z = z_moment();
        assert_eq!(z, vec![[1, 1, 1], [1, 2, 4], [1, 3, 9], [1, 4, 16]]);
        assert_eq!(maximal_minors(&z).unwrap(), vec![2, 6, 6, 2]);
        assert_eq!(vertex_count(&z), Ok(4));
        assert_eq!(hull_vertex_count(&z), 4);
    }

    #[test]
    fn falsifier_z_interior_has_a_negative_minor_and_three_vertices() {
        let z = z_interior();
        assert_eq!(maximal_minors(&z).unwrap(), vec![5, 6, 3, -4]);
        assert_eq!(vertex_count(&z), Ok(3));
        assert_eq!(hull_vertex_count(&z), 3);
        // Not positive data, so it has no canonical form.
        let y = y_of(&[1, 1, 1, 1], &z).unwrap();
        assert!(matches!(
            canonical_form(&z, &y),
            Err(OracleError::NotPositive {
                triple: [1, 2, 3],
                minor: -4
            })
        ));
    }

    #[test]
    fn vertex_count_matches_an_independent_hull_on_many_point_sets() {
        // Deterministic pseudo-random points (LCG), general position enforced by skipping
        // sets with a collinear triple (the criterion's precondition).
        let mut state: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            ((state >> 33) % 21) as i64 - 10
        };
        let mut checked = 0;
        while checked < 300 {
            let n = 3 + (next().unsigned_abs() as usize % 5);
            let z: Vec<Point> = (0..n)
                .map(|_| [1 + next().abs() % 3, next(), next()])
                .collect();
            match vertex_count(&z) {
                Ok(count) => {
                    assert_eq!(count, hull_vertex_count(&z), "{z:?}");
                    checked += 1;
                }
                Err(OracleError::Collinear { .. }) => {}
                Err(e) => panic!("unexpected {e}"),
            }
        }
    }

    #[test]
    fn vertex_count_refuses_degenerate_input() {
        assert_eq!(
            vertex_count(&[[1, 0, 0], [1, 1, 0]]),
            Err(OracleError::TooFewPoints { found: 2 })
        );
        assert_eq!(
            vertex_count(&[[1, 0, 0], [1, 1, 0], [1, 2, 0], [1, 0, 5]]),
            Err(OracleError::Collinear { triple: [0, 1, 2] })
        );
        assert_eq!(
            vertex_count(&[[1, 0, 0], [0, 1, 0], [1, 0, 1]]),
            Err(OracleError::PointNotInChart { point: 1 })
        );
    }

    #[test]
    fn y_of_ones_and_length_check() {
        let z = z_moment();
        assert_eq!(y_of(&[1, 1, 1, 1], &z), Ok([4, 10, 30]));
        assert_eq!(y_of(&[1, 2, 3, 4], &z), Ok([10, 30, 100]));
        assert!(matches!(
            y_of(&[1, 1], &z),
            Err(OracleError::LengthMismatch { .. })
        ));
    }

    #[test]
    fn amplitude_at_the_oracle_points() {
        assert_eq!(amplitude(&[1, 1, 1, 1]), Ok(q(4, 1)));
        assert_eq!(amplitude(&[1, 2, 1, 1]), Ok(q(75, 16)));
        let z = z_moment();
        for c in [[1, 1, 1, 1], [1, 2, 1, 1]] {
            let y = y_of(&c, &z).unwrap();
            let omega = canonical_form(&z, &y).unwrap();
            for r in 0..4 {
                assert_eq!(fan_form(&z, r, &y), Ok(omega), "fan {r} at {c:?}");
            }
        }
    }

    #[test]
    fn amplitude_matches_the_closed_form() {
        // ω(1,x,y) = 8(y−5x+7) / ((y−3x+2)(y−5x+6)(y−7x+12)(5x−y−4)) for these Z (NOTES §3),
        // evaluated with x = Y1/Y0, y = Y2/Y0 and the Y0 powers cleared.
        let z = z_moment();
        for c in [
            [1, 1, 1, 1],
            [1, 2, 1, 1],
            [1, 2, 3, 4],
            [3, 1, 4, 1],
            [2, 7, 1, 8],
        ] {
            let [y0, y1, y2] = y_of(&c, &z).unwrap();
            let num = 8 * (y2 - 5 * y1 + 7 * y0) * y0 * y0 * y0;
            let den = (y2 - 3 * y1 + 2 * y0)
                * (y2 - 5 * y1 + 6 * y0)
                * (y2 - 7 * y1 + 12 * y0)
                * (5 * y1 - y2 - 4 * y0);
            assert_eq!(amplitude(&c), Ok(q(num, den)), "C = {c:?}");
        }
    }

    #[test]
    fn diagonal_point_is_finite_but_a_spurious_pole_of_fan_two() {
        let z = z_moment();
        let y = y_of(&[1, 2, 3, 4], &z).unwrap();
        assert_eq!(
            bracket(&y, &widen(&z[1]), &widen(&z[3])),
            Ok(0),
            "Y on diagonal 2–4"
        );
        assert_eq!(canonical_form(&z, &y), Ok(q(16, 3)));
        assert_eq!(fan_form(&z, 0, &y), Ok(q(16, 3)));
        assert_eq!(fan_form(&z, 2, &y), Ok(q(16, 3)));
        assert_eq!(
            fan_form(&z, 1, &y),
            Err(OracleError::SpuriousPole {
                vertex: 1,
                diagonal: [1, 3]
            })
        );
        assert_eq!(
            fan_form(&z, 3, &y),
            Err(OracleError::SpuriousPole {
                vertex: 3,
                diagonal: [3, 1]
            })
        );
    }

    #[test]
    fn boundary_and_outside_points_are_errors() {
        let z = z_moment();
        // C = (1,1,0,0) is on the edge Z0–Z1.
        let edge = y_of(&[1, 1, 0, 0], &z).unwrap();
        assert_eq!(
            canonical_form(&z, &edge),
            Err(OracleError::OnBoundary { edge: [0, 1] })
        );
        assert_eq!(
            fan_form(&z, 0, &edge),
            Err(OracleError::OnBoundary { edge: [0, 1] })
        );
        // A vertex lies on two edges; the first is reported.
        let vertex = y_of(&[0, 0, 1, 0], &z).unwrap();
        assert_eq!(
            canonical_form(&z, &vertex),
            Err(OracleError::OnBoundary { edge: [1, 2] })
        );
        // (3, 8) is below the parabola, beyond the edge Z1–Z2 (⟨Y Z1 Z2⟩ = −1).
        assert!(matches!(
            canonical_form(&z, &[1, 3, 8]),
            Err(OracleError::Outside { edge: [1, 2], bracket }) if bracket < 0
        ));
        // (3, 12) is above the chord Z0–Z3 (y = 5x − 4), beyond the closing edge Z3–Z0.
        assert!(matches!(
            canonical_form(&z, &[1, 3, 12]),
            Err(OracleError::Outside { edge: [3, 0], .. })
        ));
        // (3, 11) is exactly on that chord: boundary, not outside.
        assert_eq!(
            canonical_form(&z, &[1, 3, 11]),
            Err(OracleError::OnBoundary { edge: [3, 0] })
        );
        // The chart point (1, 0, 0) is outside the parabola's hull.
        assert!(matches!(
            canonical_form(&z, &[1, 0, 0]),
            Err(OracleError::Outside { .. })
        ));
        assert_eq!(canonical_form(&z, &[0, 0, 0]), Err(OracleError::ZeroPoint));
        assert_eq!(
            canonical_form(&z, &[0, 1, 5]),
            Err(OracleError::YNotInChart)
        );
    }

    #[test]
    fn negated_y_is_the_same_point() {
        let z = z_moment();
        assert_eq!(canonical_form(&z, &[-4, -10, -30]), Ok(q(4, 1)));
        assert_eq!(fan_form(&z, 1, &[-4, -10, -30]), Ok(q(4, 1)));
    }

    #[test]
    fn omega_is_invariant_under_rescaling_a_vertex_and_projective_in_y() {
        let mut z = z_moment();
        let y = y_of(&[1, 1, 1, 1], &z).unwrap();
        let omega = canonical_form(&z, &y).unwrap();
        assert_eq!(canonical_form(&z, &y.map(|v| 7 * v)), Ok(omega));
        z[2] = z[2].map(|v| 5 * v);
        assert_eq!(canonical_form(&z, &y), Ok(omega));
    }

    #[test]
    fn unit_simplex_has_the_standard_form() {
        // Triangle (0,0), (1,0), (0,1): ω(1,x,y) = 1 / (x y (1 − x − y)).
        let z = [[1, 0, 0], [1, 1, 0], [1, 0, 1]];
        let y = [7, 2, 3]; // (2/7, 3/7)
        let expected = q(7 * 7 * 7, 2 * 3 * (7 - 2 - 3));
        assert_eq!(canonical_form(&z, &y), Ok(expected));
        assert_eq!(fan_form(&z, 0, &y), Ok(expected));
    }

    #[test]
    fn bad_z_and_apex_are_errors() {
        let z = z_moment();
        let y = [4, 10, 30];
        assert_eq!(
            canonical_form(&z[..2], &y),
            Err(OracleError::TooFewPoints { found: 2 })
        );
        assert_eq!(
            fan_form(&z, 4, &y),
            Err(OracleError::VertexOutOfRange {
                vertex: 4,
                points: 4
            })
        );
        // Reversed order: every minor is negative.
        let reversed: Vec<Point> = z.iter().rev().copied().collect();
        assert!(matches!(
            canonical_form(&reversed, &y),
            Err(OracleError::NotPositive {
                triple: [0, 1, 2],
                ..
            })
        ));
    }

    #[test]
    fn overflow_is_reported_not_wrapped() {
        let big = i64::MAX;
        let z = [[1, 0, 0], [1, big, 0], [1, 0, big]];
        let y = y_of(&[1, 1, 1], &z).unwrap();
        assert!(matches!(
            canonical_form(&z, &y),
            Err(OracleError::Overflow { .. })
        ));
        assert!(matches!(
            moment_curve(&[big]),
            Err(OracleError::Overflow { .. })
        ));
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// On positive data (moment curve on increasing nodes, rows rescaled by positive
        /// factors) and interior points C > 0, the dual-area ω equals every fan that has no
        /// spurious pole there.
        #[test]
        fn canonical_form_equals_every_fan_without_a_spurious_pole(
            steps in prop::collection::vec(1i64..5, 3..7),
            scales in prop::collection::vec(1i64..4, 7),
            c in prop::collection::vec(1i64..6, 7),
            start in -4i64..4,
        ) {
            let nodes: Vec<i64> =
                steps.iter().scan(start, |t, s| { *t += s; Some(*t) }).collect();
            let z: Vec<Point> = moment_curve(&nodes).unwrap().iter().zip(&scales)
                .map(|(p, &s)| p.map(|v| v * s)).collect();
            let y = y_of(&c[..z.len()], &z).unwrap();
            let omega = canonical_form(&z, &y).unwrap();
            prop_assert!(omega.numerator() > 0, "ω > 0 inside: {omega}");
            for r in 0..z.len() {
                match fan_form(&z, r, &y) {
                    Ok(fan) => prop_assert_eq!(fan, omega, "fan {}", r),
                    Err(OracleError::SpuriousPole { .. }) => {}
                    Err(e) => prop_assert!(false, "fan {r}: {e}"),
                }
            }
        }
    }
}
