//! Gr(2,4): Plücker coordinates of a 2×4 integer matrix, total positivity, the boundary
//! profile, and the three-term Plücker relation (Lean `Gnosis.AmplituhedronFalsifiability`).

use super::OracleError;

/// A 2×4 integer matrix, given by its two rows; its row span is a point of Gr(2,4).
pub type Mat2x4 = [[i64; 4]; 2];

/// Column pairs (0-based) in lexicographic order: 12, 13, 14, 23, 24, 34 in 1-based names.
pub const PLUCKER_PAIRS: [(usize, usize); 6] = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)];

/// The 2×2 minor of `m` on columns `i`, `j`.
fn minor2(m: &Mat2x4, i: usize, j: usize) -> i128 {
    // Each product is at most 2^126 in magnitude, and their difference cannot reach 2^127
    // (that would need i64::MIN² − (−i64::MIN²), but i64::MIN · x ≥ −2^126 + 2^63 for x ≤ MAX).
    i128::from(m[0][i]) * i128::from(m[1][j]) - i128::from(m[0][j]) * i128::from(m[1][i])
}

/// Plücker coordinates `[p12, p13, p14, p23, p24, p34]`, `p_ij = det m[:, {i, j}]`.
pub fn plucker_coordinates(m: &Mat2x4) -> [i128; 6] {
    PLUCKER_PAIRS.map(|(i, j)| minor2(m, i, j))
}

/// All Plücker coordinates are > 0: the row span is in Gr_{>0}(2,4).
pub fn totally_positive(m: &Mat2x4) -> bool {
    plucker_coordinates(m).iter().all(|&p| p > 0)
}

/// All Plücker coordinates are ≥ 0: the row span is in Gr_{≥0}(2,4).
pub fn totally_nonnegative(m: &Mat2x4) -> bool {
    plucker_coordinates(m).iter().all(|&p| p >= 0)
}

/// How many Plücker coordinates vanish.
pub fn zero_minor_count(m: &Mat2x4) -> usize {
    plucker_coordinates(m).iter().filter(|&&p| p == 0).count()
}

/// Where a point of Gr(2,4) sits relative to the positive part (Lean `boundaryProfile`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoundaryProfile {
    /// In Gr_{>0}(2,4).
    pub totally_positive: bool,
    /// In Gr_{≥0}(2,4).
    pub totally_nonnegative: bool,
    /// Number of vanishing Plücker coordinates.
    pub zero_minors: usize,
}

impl BoundaryProfile {
    /// On the boundary Gr_{≥0} \ Gr_{>0}.
    pub fn on_boundary(&self) -> bool {
        self.totally_nonnegative && !self.totally_positive
    }
}

/// The boundary profile `(totally positive, totally nonnegative, zero minors)` of `m`.
pub fn boundary_profile(m: &Mat2x4) -> BoundaryProfile {
    BoundaryProfile {
        totally_positive: totally_positive(m),
        totally_nonnegative: totally_nonnegative(m),
        zero_minors: zero_minor_count(m),
    }
}

/// Residual `p13·p24 − p12·p34 − p14·p23` of the three-term Plücker relation; 0 for every
/// 2×4 matrix (it is an identity of 2×2 minors), so a non-zero value means broken arithmetic.
pub fn plucker_residual(m: &Mat2x4) -> Result<i128, OracleError> {
    let [p12, p13, p14, p23, p24, p34] = plucker_coordinates(m);
    let overflow = || OracleError::Overflow {
        quantity: "the Plücker relation residual",
    };
    let a = p13.checked_mul(p24).ok_or_else(overflow)?;
    let b = p12.checked_mul(p34).ok_or_else(overflow)?;
    let c = p14.checked_mul(p23).ok_or_else(overflow)?;
    a.checked_sub(b)
        .and_then(|x| x.checked_sub(c))
        .ok_or_else(overflow)
}

#[cfg(test)]
mod tests;
