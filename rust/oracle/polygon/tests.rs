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
