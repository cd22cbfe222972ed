//! Eviction policies shared by the volume cache and the matvec memo.
//!
//! Both caches are small, bounded maps that must pick one victim when they are full. The
//! choice is made here, once, so the two caches cannot disagree about what a policy means:
//!
//! - **Pisot-guard** evicts the entry with the largest `drift × (now − last_used)`, where
//!   `drift = |‖v‖₂ − 1|` of the entry's cached vector. Post-RMSNorm residuals sit near unit
//!   norm (drift ≈ 0), so they are sticky; far-from-unit vectors age out first. Ties (most
//!   often every drift being 0) go to the least recently used entry.
//! - **LRU** evicts the entry with the smallest `last_used`.
//!
//! `now` and `last_used` are logical ticks owned by each cache (bumped on every capture,
//! replay, get or insert), so eviction is deterministic and testable.

use std::fmt;
use std::str::FromStr;

/// Which entry a full cache gives up first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum EvictionPolicy {
    /// Largest `drift × age` first; ties to the least recently used.
    #[default]
    PisotGuard,
    /// Least recently used first.
    Lru,
}

impl EvictionPolicy {
    /// The name accepted by [`EvictionPolicy::from_str`] (`"pisot"` or `"lru"`).
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::PisotGuard => "pisot",
            EvictionPolicy::Lru => "lru",
        }
    }
}

impl fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name that is neither `"pisot"` nor `"lru"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownPolicyError(pub String);

impl fmt::Display for UnknownPolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown eviction policy {:?} (expected \"pisot\" or \"lru\")",
            self.0
        )
    }
}

impl std::error::Error for UnknownPolicyError {}

impl FromStr for EvictionPolicy {
    type Err = UnknownPolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pisot" => Ok(EvictionPolicy::PisotGuard),
            "lru" => Ok(EvictionPolicy::Lru),
            other => Err(UnknownPolicyError(other.to_owned())),
        }
    }
}

/// Pisot drift of a cached vector: `|‖v‖₂ − 1|`.
///
/// The norm is accumulated in `f64` so large `f32` inputs cannot overflow it; the result is
/// clamped to `f32::MAX` (and a non-finite input maps to `f32::MAX`, the most evictable
/// value) so a score is always a finite, totally ordered number.
pub fn pisot_drift(v: &[f32]) -> f32 {
    let sum_sq: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    let drift = (sum_sq.sqrt() - 1.0).abs();
    if drift.is_finite() {
        drift.min(f64::from(f32::MAX)) as f32
    } else {
        f32::MAX
    }
}

/// What the policy needs to know about one resident entry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvictionCandidate {
    /// [`pisot_drift`] of the entry's vector, computed when it was inserted.
    pub drift: f32,
    /// Logical tick of the entry's last capture/replay (or insert/get).
    pub last_used: u64,
}

impl EvictionCandidate {
    /// Pisot-guard score `drift × (now − last_used)`, in `f64` (exact enough, never overflows).
    pub fn pisot_score(&self, now: u64) -> f64 {
        f64::from(self.drift) * now.saturating_sub(self.last_used) as f64
    }
}

/// Picks the victim among `candidates` (each tagged with the caller's id for it).
///
/// Returns `None` only when there are no candidates. Pisot-guard takes the largest score,
/// breaking ties by the smallest `last_used`; LRU takes the smallest `last_used`. If two
/// candidates are still tied, the first one offered wins, so the choice is deterministic for
/// a deterministic iteration order (the caches keep `last_used` unique, so this never decides).
pub fn select_victim<K>(
    policy: EvictionPolicy,
    now: u64,
    candidates: impl IntoIterator<Item = (K, EvictionCandidate)>,
) -> Option<K> {
    let mut best: Option<(K, EvictionCandidate)> = None;
    for (id, cand) in candidates {
        let better = match &best {
            None => true,
            Some((_, cur)) => match policy {
                EvictionPolicy::Lru => cand.last_used < cur.last_used,
                EvictionPolicy::PisotGuard => {
                    match cand.pisot_score(now).total_cmp(&cur.pisot_score(now)) {
                        std::cmp::Ordering::Greater => true,
                        std::cmp::Ordering::Less => false,
                        std::cmp::Ordering::Equal => cand.last_used < cur.last_used,
                    }
                }
            },
        };
        if better {
            best = Some((id, cand));
        }
    }
    best.map(|(id, _)| id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cand(drift: f32, last_used: u64) -> EvictionCandidate {
        EvictionCandidate { drift, last_used }
    }

    #[test]
    fn policy_names_round_trip() {
        for p in [EvictionPolicy::PisotGuard, EvictionPolicy::Lru] {
            assert_eq!(p.name().parse::<EvictionPolicy>().unwrap(), p);
            assert_eq!(p.to_string(), p.name());
        }
        let err = "fifo".parse::<EvictionPolicy>().unwrap_err();
        assert!(err.to_string().contains("fifo"));
        assert!(err.to_string().contains("\"lru\""));
    }

    #[test]
    fn drift_is_distance_of_the_norm_from_one() {
        assert_eq!(pisot_drift(&[]), 1.0);
        assert_eq!(pisot_drift(&[1.0]), 0.0);
        assert!(pisot_drift(&[0.6, 0.8]) < 1e-6); // 0.6 and 0.8 are inexact in f32
        assert_eq!(pisot_drift(&[0.0, -1.0, 0.0]), 0.0);
        assert!((pisot_drift(&[3.0, 4.0]) - 4.0).abs() < 1e-6);
        assert!((pisot_drift(&[0.5]) - 0.5).abs() < 1e-6);
        // Huge values do not overflow to infinity; non-finite input is the most evictable.
        assert_eq!(pisot_drift(&[f32::MAX; 4]), f32::MAX);
        assert_eq!(pisot_drift(&[f32::NAN]), f32::MAX);
        assert_eq!(pisot_drift(&[f32::INFINITY]), f32::MAX);
    }

    #[test]
    fn pisot_takes_largest_drift_times_age() {
        // scores at now=10: 0.5*9=4.5, 2.0*4=8.0, 1.0*7=7.0
        let c = [cand(0.5, 1), cand(2.0, 6), cand(1.0, 3)];
        let v = select_victim(
            EvictionPolicy::PisotGuard,
            10,
            c.iter().copied().enumerate(),
        );
        assert_eq!(v, Some(1));
        // LRU ignores drift.
        let v = select_victim(EvictionPolicy::Lru, 10, c.iter().copied().enumerate());
        assert_eq!(v, Some(0));
    }

    #[test]
    fn pisot_ties_go_to_the_least_recently_used() {
        // Equal scores (2*3 = 3*2 = 6): the older entry (last_used 7) goes.
        let c = [cand(3.0, 8), cand(2.0, 7)];
        assert_eq!(
            select_victim(
                EvictionPolicy::PisotGuard,
                10,
                c.iter().copied().enumerate()
            ),
            Some(1)
        );
        // All drifts zero: Pisot degenerates to LRU.
        let c = [cand(0.0, 5), cand(0.0, 2), cand(0.0, 9)];
        assert_eq!(
            select_victim(
                EvictionPolicy::PisotGuard,
                10,
                c.iter().copied().enumerate()
            ),
            Some(1)
        );
    }

    #[test]
    fn no_candidates_no_victim() {
        let none: [(usize, EvictionCandidate); 0] = [];
        assert_eq!(select_victim(EvictionPolicy::Lru, 3, none), None);
    }

    proptest! {
        #[test]
        fn victim_matches_a_brute_force_definition(
            entries in proptest::collection::vec((0.0f32..4.0, 0u64..1000), 1..20),
            extra in 0u64..100,
        ) {
            // Unique last_used ticks, as the caches guarantee.
            let c: Vec<EvictionCandidate> = entries
                .iter()
                .enumerate()
                .map(|(i, &(d, t))| cand(d, t * 32 + i as u64))
                .collect();
            let now = c.iter().map(|e| e.last_used).max().unwrap() + extra;
            let lru = select_victim(EvictionPolicy::Lru, now, c.iter().copied().enumerate()).unwrap();
            prop_assert!(c.iter().all(|e| e.last_used >= c[lru].last_used));
            let p = select_victim(EvictionPolicy::PisotGuard, now, c.iter().copied().enumerate()).unwrap();
            let best = c[p].pisot_score(now);
            for e in &c {
                let s = e.pisot_score(now);
                prop_assert!(s <= best);
                if s == best {
                    prop_assert!(e.last_used >= c[p].last_used);
                }
            }
        }
    }
}
