//! The oracle kernel: exact integer/rational counterparts of every value the Lean modules in
//! `lean/Gnosis/` pin down, so the parity suite can check Rust against Lean literal by literal.
//!
//! - [`grassmannian`]: Plücker coordinates of a 2×4 integer matrix, positivity and the
//!   boundary profile of Gr(2,4), the three-term Plücker relation.
//! - [`polygon`]: the amplituhedron A_{n,1,2} (a convex polygon in P²): brackets, maximal
//!   minors, vertex count, `Y = C·Z`, and the canonical-form amplitude ω as an exact
//!   [`Rational`] (only physical poles), plus the fan triangulations for comparison.
//! - [`sizing`]: the prefix-volume laws (swerve, Fibonacci execution volume, erasure,
//!   `volume = states × constraints`, well-formed prefixes).
//! - [`cache_key`]: the tagged key spaces of the matvec memo and the volume cache.
//!
//! Everything is integer arithmetic (`i128`/`u64`, checked): an intermediate value that does
//! not fit is an [`OracleError::Overflow`], never a wrapped or rounded result. No floats.

pub mod cache_key;
pub mod grassmannian;
pub mod polygon;
pub mod rational;
pub mod sizing;

use std::fmt;

pub use cache_key::LeanCacheKey;
pub use grassmannian::{
    boundary_profile, plucker_coordinates, plucker_residual, totally_nonnegative, totally_positive,
    zero_minor_count, BoundaryProfile, Mat2x4,
};
pub use polygon::{
    bracket, canonical_form, fan_form, maximal_minors, moment_curve, vertex_count, y_of,
    HomogeneousPoint, Point,
};
pub use rational::Rational;
pub use sizing::{
    admits_volume, compile_cfg_to_grassmannian, execution_volume, fib, fib_u128,
    topological_erasure, trim_trailing, well_formed_prefix, GrassmannianVolume, CLINAMEN_SWERVE,
};

/// Why an oracle computation has no exact value. Indices are 0-based row indices of `Z`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OracleError {
    /// An intermediate value does not fit the integer type (i128, or u64 for sizes).
    Overflow {
        /// What was being computed.
        quantity: &'static str,
    },
    /// A rational with denominator zero was requested.
    ZeroDenominator,
    /// Two inputs that must have the same length do not.
    LengthMismatch {
        /// What was being compared.
        what: &'static str,
        /// The length required.
        expected: usize,
        /// The length given.
        found: usize,
    },
    /// A polygon in P² needs at least three points.
    TooFewPoints {
        /// Number of rows of `Z` given.
        found: usize,
    },
    /// Row `point` of `Z` has first coordinate ≤ 0, so it is not in the affine chart Z_0 > 0
    /// the hull criterion works in.
    PointNotInChart {
        /// The offending row.
        point: usize,
    },
    /// `Y` has `Y_0 = 0`: it is on the line at infinity of the chart Y_0 = 1.
    YNotInChart,
    /// `Y` is the zero vector, which is no point of P².
    ZeroPoint,
    /// Three rows of `Z` are collinear (a zero bracket): not in general position.
    Collinear {
        /// The three rows.
        triple: [usize; 3],
    },
    /// A maximal minor of `Z` is not positive, so `Z` is not positive data.
    NotPositive {
        /// The rows of the minor.
        triple: [usize; 3],
        /// Its value.
        minor: i128,
    },
    /// `Y` lies on the boundary edge `Z[edge[0]]–Z[edge[1]]`: a physical pole of ω.
    OnBoundary {
        /// The edge.
        edge: [usize; 2],
    },
    /// `Y` is outside the polygon: `⟨Y Z[i] Z[i+1]⟩` has the wrong sign for this edge.
    Outside {
        /// The edge that separates `Y` from the polygon.
        edge: [usize; 2],
        /// The bracket `⟨Y Z[edge[0]] Z[edge[1]]⟩`.
        bracket: i128,
    },
    /// `Y` lies on the diagonal `Z[diagonal[0]]–Z[diagonal[1]]` of this fan triangulation: a
    /// spurious pole of the fan (ω itself is finite there; use [`canonical_form`]).
    SpuriousPole {
        /// The fan's apex.
        vertex: usize,
        /// The diagonal through `Y`.
        diagonal: [usize; 2],
    },
    /// The fan apex is not a row of `Z`.
    VertexOutOfRange {
        /// The apex requested.
        vertex: usize,
        /// Number of rows of `Z`.
        points: usize,
    },
}

impl fmt::Display for OracleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Overflow { quantity } => {
                write!(
                    f,
                    "integer overflow computing {quantity} (exact arithmetic only)"
                )
            }
            Self::ZeroDenominator => write!(f, "rational with denominator 0"),
            Self::LengthMismatch {
                what,
                expected,
                found,
            } => {
                write!(f, "{what}: expected length {expected}, got {found}")
            }
            Self::TooFewPoints { found } => {
                write!(
                    f,
                    "a polygon in P² needs at least 3 points (rows of Z), got {found}"
                )
            }
            Self::PointNotInChart { point } => write!(
                f,
                "Z[{point}] has first coordinate ≤ 0; the hull criterion needs every Z_i^0 > 0"
            ),
            Self::YNotInChart => write!(
                f,
                "Y has Y_0 = 0: it is on the line at infinity of the affine chart Y_0 = 1"
            ),
            Self::ZeroPoint => write!(f, "Y = (0, 0, 0) is not a point of P²"),
            Self::Collinear { triple: [i, j, k] } => write!(
                f,
                "Z[{i}], Z[{j}], Z[{k}] are collinear (bracket 0): points not in general position"
            ),
            Self::NotPositive {
                triple: [i, j, k],
                minor,
            } => write!(
                f,
                "Z is not positive: the maximal minor ⟨Z[{i}] Z[{j}] Z[{k}]⟩ = {minor} is not > 0"
            ),
            Self::OnBoundary { edge: [i, j] } => write!(
                f,
                "Y is on the boundary edge Z[{i}]–Z[{j}] (⟨Y Z[{i}] Z[{j}]⟩ = 0): \
                 a physical pole of the canonical form"
            ),
            Self::Outside {
                edge: [i, j],
                bracket,
            } => write!(
                f,
                "Y is outside the amplituhedron: ⟨Y Z[{i}] Z[{j}]⟩ = {bracket} has the wrong sign"
            ),
            Self::SpuriousPole {
                vertex,
                diagonal: [i, j],
            } => write!(
                f,
                "Y is on the diagonal Z[{i}]–Z[{j}] of the fan from Z[{vertex}]: a spurious pole \
                 of this triangulation (the canonical form itself is finite there)"
            ),
            Self::VertexOutOfRange { vertex, points } => {
                write!(
                    f,
                    "fan apex {vertex} is not a row of Z (Z has {points} rows)"
                )
            }
        }
    }
}

impl std::error::Error for OracleError {}
