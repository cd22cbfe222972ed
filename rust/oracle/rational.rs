//! Exact rationals over `i128`, always in lowest terms with a positive denominator.

use std::fmt;

use super::OracleError;

/// A reduced fraction `num / den` with `den > 0` (the Lean `qnorm` normal form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rational {
    num: i128,
    den: i128,
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn overflow() -> OracleError {
    OracleError::Overflow {
        quantity: "a rational",
    }
}

impl Rational {
    /// Zero, `0 / 1`.
    pub const ZERO: Self = Self { num: 0, den: 1 };

    /// `num / den` in lowest terms with a positive denominator.
    pub fn new(num: i128, den: i128) -> Result<Self, OracleError> {
        if den == 0 {
            return Err(OracleError::ZeroDenominator);
        }
        // Reduce in u128 so that i128::MIN inputs reduce whenever the result is representable.
        let g = gcd(num.unsigned_abs(), den.unsigned_abs()); // ≥ 1 because den ≠ 0
        let (num_abs, den_abs) = (num.unsigned_abs() / g, den.unsigned_abs() / g);
        let negative = (num < 0) != (den < 0);
        let num = if negative {
            0i128.checked_sub_unsigned(num_abs)
        } else {
            i128::try_from(num_abs).ok()
        }
        .ok_or_else(overflow)?;
        let den = i128::try_from(den_abs).map_err(|_| overflow())?;
        Ok(Self { num, den })
    }

    /// The integer `n` as `n / 1`.
    pub fn from_integer(n: i128) -> Self {
        Self { num: n, den: 1 }
    }

    /// The numerator (carries the sign).
    pub fn numerator(&self) -> i128 {
        self.num
    }

    /// The denominator, always > 0.
    pub fn denominator(&self) -> i128 {
        self.den
    }

    /// `(numerator, denominator)`, the pair the Lean oracles write.
    pub fn to_pair(&self) -> (i128, i128) {
        (self.num, self.den)
    }

    /// Exact sum, or [`OracleError::Overflow`].
    pub fn checked_add(self, other: Self) -> Result<Self, OracleError> {
        // a/b + c/d over the least common denominator keeps intermediates small.
        let g = gcd_with_denominator(self.den, other.den);
        let (b, d) = (self.den / g, other.den / g);
        let num = self
            .num
            .checked_mul(d)
            .and_then(|x| other.num.checked_mul(b).and_then(|y| x.checked_add(y)))
            .ok_or_else(overflow)?;
        let den = b.checked_mul(other.den).ok_or_else(overflow)?;
        Self::new(num, den)
    }

    /// Exact product, or [`OracleError::Overflow`].
    pub fn checked_mul(self, other: Self) -> Result<Self, OracleError> {
        // Cross-cancel first so that a product representable in lowest terms never overflows
        // on the way.
        let g1 = gcd_with_denominator(self.num, other.den);
        let g2 = gcd_with_denominator(other.num, self.den);
        let num = (self.num / g1)
            .checked_mul(other.num / g2)
            .ok_or_else(overflow)?;
        let den = (self.den / g2)
            .checked_mul(other.den / g1)
            .ok_or_else(overflow)?;
        Self::new(num, den)
    }
}

/// gcd(|x|, den) for a positive denominator: it divides `den`, so it is in 1..=i128::MAX and
/// the conversion back to i128 is exact.
fn gcd_with_denominator(x: i128, den: i128) -> i128 {
    debug_assert!(den > 0);
    gcd(x.unsigned_abs(), den.unsigned_abs()) as i128
}

impl fmt::Display for Rational {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.den == 1 {
            write!(f, "{}", self.num)
        } else {
            write!(f, "{}/{}", self.num, self.den)
        }
    }
}

#[cfg(test)]
mod tests;
