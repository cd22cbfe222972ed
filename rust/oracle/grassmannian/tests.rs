use super::*;

/// The Vandermonde witness, nodes t = (1, 2, 3, 4) (Lean `vandermonde24`).
const VANDERMONDE: Mat2x4 = [[1, 1, 1, 1], [1, 2, 3, 4]];
/// span(e1, e2) (Lean `coordPlane24`).
const COORD_PLANE: Mat2x4 = [[1, 0, 0, 0], [0, 1, 0, 0]];

#[test]
fn vandermonde_pluckers_are_node_differences_and_positive() {
    assert_eq!(plucker_coordinates(&VANDERMONDE), [1, 2, 3, 1, 2, 1]);
    assert!(totally_positive(&VANDERMONDE));
    let profile = boundary_profile(&VANDERMONDE);
    assert_eq!(
        profile,
        BoundaryProfile {
            totally_positive: true,
            totally_nonnegative: true,
            zero_minors: 0
        }
    );
    assert!(!profile.on_boundary());
    assert_eq!(plucker_residual(&VANDERMONDE), Ok(0));
}

#[test]
fn coordinate_plane_is_on_the_boundary_with_five_zeros() {
    assert_eq!(plucker_coordinates(&COORD_PLANE), [1, 0, 0, 0, 0, 0]);
    let profile = boundary_profile(&COORD_PLANE);
    assert_eq!(
        profile,
        BoundaryProfile {
            totally_positive: false,
            totally_nonnegative: true,
            zero_minors: 5
        }
    );
    assert!(profile.on_boundary());
}

#[test]
fn a_negative_minor_is_neither_positive_nor_nonnegative() {
    // Swapping two columns of the Vandermonde matrix flips the sign of p12.
    let m = [[1, 1, 1, 1], [2, 1, 3, 4]];
    assert_eq!(plucker_coordinates(&m)[0], -1);
    assert!(!totally_positive(&m) && !totally_nonnegative(&m));
}

#[test]
fn extreme_entries_do_not_overflow_the_minors_and_the_residual_reports_overflow() {
    let m = [
        [i64::MIN, i64::MAX, i64::MIN, 1],
        [i64::MAX, i64::MIN, 1, i64::MIN],
    ];
    let p = plucker_coordinates(&m);
    let exact = |i: usize, j: usize| {
        i128::from(m[0][i]) * i128::from(m[1][j]) - i128::from(m[0][j]) * i128::from(m[1][i])
    };
    assert_eq!(p[0], exact(0, 1));
    assert!(matches!(
        plucker_residual(&m),
        Err(OracleError::Overflow { .. })
    ));
}

#[test]
fn plucker_relation_holds_on_a_grid_of_small_matrices() {
    let vals = [-3i64, -1, 0, 2, 5];
    for a in vals {
        for b in vals {
            for c in vals {
                let m = [[a, b, c, 1], [c, 7, a, b]];
                assert_eq!(plucker_residual(&m), Ok(0), "{m:?}");
            }
        }
    }
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The three-term relation is an identity of 2×2 minors.
        #[test]
        fn plucker_residual_vanishes(m in prop::array::uniform2(prop::array::uniform4(-1_000_000_000i64..1_000_000_000))) {
            prop_assert_eq!(plucker_residual(&m), Ok(0));
        }
    }
}
