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
mod tests {
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
}
