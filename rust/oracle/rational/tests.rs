use super::*;

#[test]
fn new_reduces_and_makes_the_denominator_positive() {
    assert_eq!(Rational::new(6, -4).unwrap().to_pair(), (-3, 2));
    assert_eq!(Rational::new(-6, -4).unwrap().to_pair(), (3, 2));
    assert_eq!(Rational::new(0, -7).unwrap().to_pair(), (0, 1));
    assert_eq!(Rational::new(1, 0), Err(OracleError::ZeroDenominator));
}

#[test]
fn extreme_values_reduce_or_report_overflow() {
    assert_eq!(
        Rational::new(i128::MIN, i128::MIN).unwrap().to_pair(),
        (1, 1)
    );
    assert_eq!(
        Rational::new(i128::MIN, 2).unwrap().to_pair(),
        (i128::MIN / 2, 1)
    );
    assert!(matches!(
        Rational::new(1, i128::MIN),
        Err(OracleError::Overflow { .. })
    ));
}

#[test]
fn add_and_mul_are_exact() {
    let a = Rational::new(1, 6).unwrap();
    let b = Rational::new(1, 10).unwrap();
    assert_eq!(a.checked_add(b).unwrap().to_pair(), (4, 15));
    assert_eq!(a.checked_mul(b).unwrap().to_pair(), (1, 60));
    let big = Rational::from_integer(i128::MAX);
    assert!(matches!(
        big.checked_add(big),
        Err(OracleError::Overflow { .. })
    ));
    // Cross-cancellation: (MAX/2) * (2/MAX) = 1 without overflowing.
    let x = Rational::new(i128::MAX, 2).unwrap();
    let y = Rational::new(2, i128::MAX).unwrap();
    assert_eq!(x.checked_mul(y).unwrap(), Rational::from_integer(1));
}

#[test]
fn display_omits_a_unit_denominator() {
    assert_eq!(Rational::new(16, 3).unwrap().to_string(), "16/3");
    assert_eq!(Rational::new(8, 2).unwrap().to_string(), "4");
}
