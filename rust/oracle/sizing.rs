//! Prefix-volume laws of the cache (Lean `Gnosis.TopologicalAmplituhedron` and
//! `Gnosis.TopologicalGrassmannianCompiler`): the swerve, the Fibonacci execution volume,
//! topological erasure, and `volume = states × constraints`.

use super::OracleError;

/// The swerve: the smallest prefix that carries a volume, one token (Lean `Nat.succ 0`).
pub const CLINAMEN_SWERVE: u64 = 1;

/// A prefix of `prefix_len` tokens admits a cached volume iff `prefix_len ≥ CLINAMEN_SWERVE`
/// (the empty prefix never makes a volume).
pub fn admits_volume(prefix_len: u64) -> bool {
    prefix_len >= CLINAMEN_SWERVE
}

/// F(n) by the linear recurrence, with `add` the checked addition of the integer type.
/// Stops at F(n) itself (F(n + 1) is never formed), so F(93) fits a u64 although F(94) does
/// not.
fn fib_with<T: Copy>(n: u64, zero: T, one: T, add: impl Fn(T, T) -> Option<T>) -> Option<T> {
    if n == 0 {
        return Some(zero);
    }
    let (mut a, mut b) = (zero, one); // (F(k−1), F(k)) for k = 1
    for _ in 1..n {
        (a, b) = (b, add(a, b)?);
    }
    Some(b)
}

/// Fibonacci number F(n) (F(0) = 0, F(1) = 1) as a `u64`; `None` when it overflows, which
/// happens first at n = 94 (F(93) = 12200160415121876738 is the largest that fits).
pub fn fib(n: u64) -> Option<u64> {
    fib_with(n, 0u64, 1, u64::checked_add)
}

/// F(n) as a `u128` (fits up to n = 186), for checking values beyond u64 such as F(94).
pub fn fib_u128(n: u64) -> Option<u128> {
    fib_with(n, 0u128, 1, u128::checked_add)
}

/// Execution volume of an `n`-step prefix: the Lean `execution_volume = fib` (definitional,
/// `timeless_isomorphism`).
pub fn execution_volume(n: u64) -> Option<u64> {
    fib(n)
}

/// Volume after one defect: the trailing position is removed, and erasing the empty volume
/// is a no-op (truncated subtraction, as Lean's `Nat` `v - 1`).
pub fn topological_erasure(volume: u64) -> u64 {
    volume.saturating_sub(1)
}

/// The list-level erasure: drop the last element (Lean `List.dropLast`; empty stays empty).
pub fn trim_trailing<T>(xs: &[T]) -> &[T] {
    xs.split_last().map_or(xs, |(_, rest)| rest)
}

/// A compiled prefix volume: `states` prompt positions × `constraints` layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrassmannianVolume {
    /// Prompt positions.
    pub states: u64,
    /// Transformer layers.
    pub constraints: u64,
}

impl GrassmannianVolume {
    /// Number of cached (position, layer) slots, `states × constraints`.
    pub fn volume(&self) -> Result<u64, OracleError> {
        self.states
            .checked_mul(self.constraints)
            .ok_or(OracleError::Overflow {
                quantity: "a volume (states × constraints)",
            })
    }
}

/// Compile a `(prompt_len, num_layers)` configuration into its volume.
pub fn compile_cfg_to_grassmannian(prompt_len: u64, num_layers: u64) -> GrassmannianVolume {
    GrassmannianVolume {
        states: prompt_len,
        constraints: num_layers,
    }
}

/// A well-formed prefix has at least one token and at least one layer (both ≥ the swerve).
pub fn well_formed_prefix(prompt_len: u64, num_layers: u64) -> bool {
    admits_volume(prompt_len) && admits_volume(num_layers)
}

#[cfg(test)]
mod tests;
