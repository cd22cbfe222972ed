use super::*;

#[test]
fn swerve_is_one_and_gates_volumes() {
    assert_eq!(CLINAMEN_SWERVE, 1);
    assert!(!admits_volume(0));
    assert!(admits_volume(CLINAMEN_SWERVE));
    assert_eq!(
        [0, 1, 2, 4096].map(admits_volume),
        [false, true, true, true]
    );
}

#[test]
fn fib_table_and_u64_boundary() {
    let table: Vec<u64> = (0..16).map(|n| fib(n).unwrap()).collect();
    assert_eq!(
        table,
        [0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610]
    );
    assert_eq!(fib(90), Some(2_880_067_194_370_816_120));
    assert_eq!(fib(93), Some(12_200_160_415_121_876_738));
    assert_eq!(fib(94), None, "F(94) > u64::MAX must overflow");
    assert_eq!(fib(10_000), None);
    assert_eq!(execution_volume(93), fib(93));
}

#[test]
fn fib_u128_matches_and_extends_fib() {
    for n in 0..=93 {
        assert_eq!(fib_u128(n), fib(n).map(u128::from));
    }
    assert_eq!(fib_u128(94), Some(19_740_274_219_868_223_167));
    // The recurrence holds exactly up to the largest representable value.
    for n in 0..=184 {
        let (a, b, c) = (
            fib_u128(n).unwrap(),
            fib_u128(n + 1).unwrap(),
            fib_u128(n + 2),
        );
        assert_eq!(c, Some(a + b));
    }
    assert!(fib_u128(186).is_some());
    assert_eq!(fib_u128(187), None);
}

#[test]
fn erasure_saturates_and_trim_drops_the_last() {
    assert_eq!([0, 1, 2, 7, 64].map(topological_erasure), [0, 0, 1, 6, 63]);
    assert_eq!(topological_erasure(u64::MAX), u64::MAX - 1);
    assert_eq!(trim_trailing(&[5u64, 9, 2, 7]), &[5, 9, 2]);
    assert_eq!(trim_trailing::<u64>(&[]), &[] as &[u64]);
    for len in 0..5u64 {
        let xs: Vec<u64> = (0..len).collect();
        assert_eq!(trim_trailing(&xs).len() as u64, topological_erasure(len));
    }
}

#[test]
fn volume_is_states_times_constraints() {
    let table: Vec<u64> = [(1, 1), (7, 32), (128, 28), (4096, 80), (0, 32)]
        .map(|(p, l)| compile_cfg_to_grassmannian(p, l).volume().unwrap())
        .to_vec();
    assert_eq!(table, [1, 224, 3584, 327_680, 0]);
    assert!(matches!(
        compile_cfg_to_grassmannian(u64::MAX, 2).volume(),
        Err(OracleError::Overflow { .. })
    ));
}

#[test]
fn well_formed_prefixes_have_a_nonempty_volume() {
    assert!(!well_formed_prefix(0, 32));
    assert!(well_formed_prefix(1, 1));
    assert!(!well_formed_prefix(7, 0));
    for p in 0..9 {
        for l in 0..9 {
            let v = compile_cfg_to_grassmannian(p, l).volume().unwrap();
            assert!(!well_formed_prefix(p, l) || v >= 1);
        }
    }
}
