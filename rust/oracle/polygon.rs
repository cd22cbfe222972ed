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
mod tests;
