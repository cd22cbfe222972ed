//! Eviction policies shared by the volume cache and the matvec memo.
//!
//! Both caches are bounded maps that must give up one entry when they are full. The choice
//! is made here, once, by an [`EvictionQueue`], so the caches cannot disagree about what a
//! policy means:
//!
//! - **Pisot-guard** (the seed's policy) evicts the entry with the largest
//!   `drift × (now − last_used)`, where `drift = |‖v‖₂ − 1|` of the entry's cached vector.
//!   Post-RMSNorm residuals sit near unit norm (drift ≈ 0), so they are sticky; far-from-unit
//!   vectors age out first. Ties (most often every drift being 0) go to the least recently
//!   used entry.
//! - **LRU** evicts the entry with the smallest `last_used`.
//! - **Cost-aware** (GreedyDual-Size-Frequency, Cherkasova 1998; the volume cache's default,
//!   since it beat both others on every trace of the eviction bench) keeps the entries whose
//!   hits save the most recomputation per byte held. Each entry carries
//!   `priority = L + value / bytes`, where `value` is the cost of recomputing the entry (its
//!   prefill, for a volume) plus the cost every hit saved since it was stored, and `L` (the
//!   *inflation*) is the priority of the last victim. The smallest priority goes first, ties
//!   to the least recently used. `L` only grows, so an entry that stops being hit is
//!   overtaken by newer ones and ages out, however valuable it once was.
//!
//! `now` and `last_used` are logical ticks owned by each cache (bumped on every capture,
//! replay, get or insert), so eviction is deterministic and testable.
//!
//! Victim choice costs O(log n) for LRU and the cost-aware policy (an ordered index) and
//! O(n) for Pisot-guard, whose scores all move with `now` and so admit no fixed order.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::hash::Hash;
use std::str::FromStr;

/// Which entry a full cache gives up first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EvictionPolicy {
    /// Largest `drift × age` first; ties to the least recently used.
    PisotGuard,
    /// Least recently used first.
    Lru,
    /// Smallest `inflation + value / bytes` first (GreedyDual-Size-Frequency with the
    /// recomputation a hit saves as the cost); ties to the least recently used.
    CostAware,
}

impl EvictionPolicy {
    /// Every policy, in a fixed order.
    pub const ALL: [EvictionPolicy; 3] = [
        EvictionPolicy::PisotGuard,
        EvictionPolicy::Lru,
        EvictionPolicy::CostAware,
    ];

    /// The name accepted by [`EvictionPolicy::from_str`]: `"pisot"`, `"lru"` or `"gdsf"`.
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::PisotGuard => "pisot",
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::CostAware => "gdsf",
        }
    }
}

impl fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name that is not one of [`EvictionPolicy::ALL`]'s names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownPolicyError(pub String);

impl fmt::Display for UnknownPolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown eviction policy {:?} (expected \"pisot\", \"lru\" or \"gdsf\")",
            self.0
        )
    }
}

impl std::error::Error for UnknownPolicyError {}

impl FromStr for EvictionPolicy {
    type Err = UnknownPolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EvictionPolicy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownPolicyError(s.to_owned()))
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

/// Whether a cache holding `entries` entries of `bytes` bytes in all is over its limits.
pub fn over_limits(
    entries: usize,
    bytes: usize,
    max_entries: usize,
    max_bytes: Option<usize>,
) -> bool {
    entries > max_entries || max_bytes.is_some_and(|m| bytes > m)
}

/// What a policy may weigh about an entry when it is stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EntryFacts {
    /// [`pisot_drift`] of the entry's vector.
    pub drift: f32,
    /// Bytes the entry holds (at least 1 is assumed).
    pub bytes: usize,
    /// Cost of recomputing the entry, in the cache's own unit (≥ 0, finite).
    pub cost: f64,
}

/// What the queue knows about one tracked entry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tracked {
    /// [`pisot_drift`] of the entry's vector.
    pub drift: f32,
    /// Bytes the entry holds.
    pub bytes: usize,
    /// Logical tick of the entry's last store or hit.
    pub last_used: u64,
    /// Recomputation cost plus everything its hits saved since it was stored.
    pub value: f64,
    /// The inflation as of the last store or hit (the priority's base).
    pub base: f64,
    /// Cost-aware priority `base + value / bytes` (at least the inflation after a resize).
    pub priority: f64,
}

impl Tracked {
    /// Pisot-guard score `drift × (now − last_used)`, in `f64` (exact enough, never overflows).
    pub fn pisot_score(&self, now: u64) -> f64 {
        f64::from(self.drift) * now.saturating_sub(self.last_used) as f64
    }
}

/// The ordered index key: `(priority bits, last_used)` for the cost-aware policy (priorities
/// are finite and non-negative, so their bits order like the values), `(last_used, 0)` for
/// LRU. Pisot-guard keeps no order.
type OrderKey = (u64, u64);

/// The entries of one cache tier, in eviction order under one policy.
///
/// The owning cache tells the queue about every store ([`insert`](Self::insert)), hit
/// ([`touch`](Self::touch)) and removal; the queue answers which entry goes next. `K` is the
/// cache's own entry id.
#[derive(Debug, Clone)]
pub struct EvictionQueue<K> {
    policy: EvictionPolicy,
    /// Priority of the last victim (cost-aware policy); never decreases.
    inflation: f64,
    tracked: HashMap<K, Tracked>,
    order: BTreeSet<(OrderKey, K)>,
}

impl<K: Copy + Eq + Hash + Ord> EvictionQueue<K> {
    /// An empty queue.
    pub fn new(policy: EvictionPolicy) -> Self {
        EvictionQueue {
            policy,
            inflation: 0.0,
            tracked: HashMap::new(),
            order: BTreeSet::new(),
        }
    }

    /// The policy.
    pub fn policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// Switches policy, re-ordering every tracked entry (cost-aware priorities are recomputed
    /// from the current inflation).
    pub fn set_policy(&mut self, policy: EvictionPolicy) {
        self.policy = policy;
        let inflation = self.inflation;
        for t in self.tracked.values_mut() {
            t.base = inflation;
            t.priority = inflation + t.value / t.bytes.max(1) as f64;
        }
        self.order = self
            .tracked
            .iter()
            .filter_map(|(&k, t)| order_key(policy, t).map(|o| (o, k)))
            .collect();
    }

    /// Entries tracked.
    pub fn len(&self) -> usize {
        self.tracked.len()
    }

    /// Whether no entry is tracked.
    pub fn is_empty(&self) -> bool {
        self.tracked.is_empty()
    }

    /// The current inflation `L` of the cost-aware policy.
    pub fn inflation(&self) -> f64 {
        self.inflation
    }

    /// What the queue knows about `key`.
    pub fn get(&self, key: &K) -> Option<&Tracked> {
        self.tracked.get(key)
    }

    /// Whether `key` is tracked.
    pub fn contains(&self, key: &K) -> bool {
        self.tracked.contains_key(key)
    }

    /// Tracks a newly stored entry (replacing any previous record of `key`).
    pub fn insert(&mut self, key: K, facts: EntryFacts, now: u64) {
        self.remove(&key);
        let value = sanitize(facts.cost);
        let t = Tracked {
            drift: facts.drift,
            bytes: facts.bytes.max(1),
            last_used: now,
            value,
            base: self.inflation,
            priority: self.inflation + value / facts.bytes.max(1) as f64,
        };
        self.store(key, t);
    }

    /// Records a hit on `key` at `now` that saved `saved` (cost unit). Untracked keys are
    /// ignored.
    pub fn touch(&mut self, key: K, now: u64, saved: f64) {
        let Some(mut t) = self.take(&key) else {
            return;
        };
        t.last_used = now;
        t.value = sanitize(t.value + sanitize(saved));
        t.base = self.inflation;
        t.priority = self.inflation + t.value / t.bytes as f64;
        self.store(key, t);
    }

    /// Updates the bytes `key` holds (its priority follows at once).
    pub fn resize(&mut self, key: K, bytes: usize) {
        let Some(mut t) = self.take(&key) else {
            return;
        };
        t.bytes = bytes.max(1);
        // From the base, not by adjusting the old priority: `p − old + new` rounds, and a
        // later hit (base' ≥ base, value' ≥ value) could then land an ulp below it.
        t.priority = (t.base + t.value / t.bytes as f64).max(self.inflation);
        self.store(key, t);
    }

    /// Stops tracking `key` (not an eviction: the inflation stays). Whether it was tracked.
    pub fn remove(&mut self, key: &K) -> bool {
        self.take(key).is_some()
    }

    /// The entry the policy gives up next, if any.
    pub fn victim(&self, now: u64) -> Option<K> {
        match self.policy {
            EvictionPolicy::Lru | EvictionPolicy::CostAware => self.order.first().map(|&(_, k)| k),
            EvictionPolicy::PisotGuard => self
                .tracked
                .iter()
                .max_by(|(_, a), (_, b)| {
                    a.pisot_score(now)
                        .total_cmp(&b.pisot_score(now))
                        .then(b.last_used.cmp(&a.last_used))
                })
                .map(|(&k, _)| k),
        }
    }

    /// Removes and returns the victim; under the cost-aware policy the inflation rises to its
    /// priority.
    pub fn pop_victim(&mut self, now: u64) -> Option<K> {
        let key = self.victim(now)?;
        let t = self.take(&key).expect("the victim is tracked");
        if self.policy == EvictionPolicy::CostAware {
            self.inflation = self.inflation.max(t.priority);
        }
        Some(key)
    }

    /// Forgets every entry; the inflation stays (it only ever grows).
    pub fn clear(&mut self) {
        self.tracked.clear();
        self.order.clear();
    }

    fn take(&mut self, key: &K) -> Option<Tracked> {
        let t = self.tracked.remove(key)?;
        if let Some(o) = order_key(self.policy, &t) {
            self.order.remove(&(o, *key));
        }
        Some(t)
    }

    fn store(&mut self, key: K, t: Tracked) {
        if let Some(o) = order_key(self.policy, &t) {
            self.order.insert((o, key));
        }
        self.tracked.insert(key, t);
    }
}

/// A finite, non-negative cost (anything else counts as 0, or as the largest finite value).
fn sanitize(cost: f64) -> f64 {
    if cost.is_nan() || cost <= 0.0 {
        0.0
    } else {
        cost.min(f64::MAX)
    }
}

fn order_key(policy: EvictionPolicy, t: &Tracked) -> Option<OrderKey> {
    match policy {
        EvictionPolicy::Lru => Some((t.last_used, 0)),
        EvictionPolicy::CostAware => Some((t.priority.to_bits(), t.last_used)),
        EvictionPolicy::PisotGuard => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn facts(drift: f32, bytes: usize, cost: f64) -> EntryFacts {
        EntryFacts { drift, bytes, cost }
    }

    #[test]
    fn policy_names_round_trip() {
        for p in EvictionPolicy::ALL {
            assert_eq!(p.name().parse::<EvictionPolicy>().unwrap(), p);
            assert_eq!(p.to_string(), p.name());
        }
        let err = "fifo".parse::<EvictionPolicy>().unwrap_err();
        assert!(err.to_string().contains("fifo"));
        assert!(err.to_string().contains("\"lru\""));
        assert!(err.to_string().contains("\"gdsf\""));
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

    /// A queue holding `(drift, last_used)` entries 0, 1, … with equal bytes and cost.
    fn queue(policy: EvictionPolicy, entries: &[(f32, u64)]) -> EvictionQueue<usize> {
        let mut q = EvictionQueue::new(policy);
        for (i, &(drift, t)) in entries.iter().enumerate() {
            q.insert(i, facts(drift, 10, 1.0), t);
        }
        q
    }

    #[test]
    fn pisot_takes_largest_drift_times_age() {
        // scores at now=10: 0.5*9=4.5, 2.0*4=8.0, 1.0*7=7.0
        let c = [(0.5, 1), (2.0, 6), (1.0, 3)];
        assert_eq!(queue(EvictionPolicy::PisotGuard, &c).victim(10), Some(1));
        // LRU ignores drift.
        assert_eq!(queue(EvictionPolicy::Lru, &c).victim(10), Some(0));
    }

    #[test]
    fn pisot_ties_go_to_the_least_recently_used() {
        // Equal scores (2*3 = 3*2 = 6): the older entry (last_used 7) goes.
        let c = [(3.0, 8), (2.0, 7)];
        assert_eq!(queue(EvictionPolicy::PisotGuard, &c).victim(10), Some(1));
        // All drifts zero: Pisot degenerates to LRU.
        let c = [(0.0, 5), (0.0, 2), (0.0, 9)];
        assert_eq!(queue(EvictionPolicy::PisotGuard, &c).victim(10), Some(1));
    }

    #[test]
    fn cost_aware_weighs_value_per_byte_and_ages_by_inflation() {
        let mut q = EvictionQueue::new(EvictionPolicy::CostAware);
        q.insert("cheap", facts(0.0, 100, 10.0), 1); // 0.1 per byte
        q.insert("dear", facts(0.0, 100, 50.0), 2); // 0.5 per byte
        q.insert("small", facts(0.0, 10, 10.0), 3); // 1.0 per byte
        assert_eq!(q.victim(4), Some("cheap"));
        // A hit adds what it saved: "cheap" now holds 0.3 per byte, still the least.
        q.touch("cheap", 5, 20.0);
        assert_eq!(q.get(&"cheap").unwrap().value, 30.0);
        assert_eq!(q.pop_victim(6), Some("cheap"));
        assert!((q.inflation() - 0.3).abs() < 1e-12);
        // New entries start above the inflation, so a once-valuable entry that is never hit
        // again is overtaken: "dear" (0.5) goes before a newcomer of 0.3 per byte.
        q.insert("new", facts(0.0, 100, 30.0), 7);
        assert!((q.get(&"new").unwrap().priority - 0.6).abs() < 1e-12);
        assert_eq!(q.pop_victim(8), Some("dear"));
        // Equal priorities go to the least recently used; resizing re-prices at once.
        let mut q = EvictionQueue::new(EvictionPolicy::CostAware);
        q.insert(1, facts(0.0, 10, 1.0), 5);
        q.insert(2, facts(0.0, 10, 1.0), 4);
        assert_eq!(q.victim(6), Some(2));
        q.resize(1, 20);
        assert_eq!(q.victim(6), Some(1));
        assert!(!q.remove(&9) && q.remove(&1) && q.len() == 1);
    }

    #[test]
    fn switching_policy_reorders_and_empty_queues_have_no_victim() {
        let mut q = queue(EvictionPolicy::Lru, &[(4.0, 9), (0.0, 2)]);
        assert_eq!(q.victim(10), Some(1));
        q.set_policy(EvictionPolicy::PisotGuard);
        assert_eq!(q.victim(10), Some(0));
        q.set_policy(EvictionPolicy::CostAware);
        assert_eq!(
            q.victim(10),
            Some(1),
            "equal value per byte: the older goes"
        );
        q.clear();
        assert!(q.is_empty());
        assert_eq!(q.pop_victim(11), None);
        // Costs that are not finite and non-negative count as nothing.
        q.insert(0, facts(0.0, 1, f64::NAN), 12);
        q.touch(0, 13, -5.0);
        assert_eq!(q.get(&0).unwrap().value, 0.0);
    }

    /// Proptest's find: re-storing a key, resizing it, then a hit that saves nothing. The hit
    /// must not lower the priority (a resize used to adjust it by `− old + new`, which rounds).
    #[test]
    fn a_resize_then_a_hit_never_lowers_the_priority() {
        let mut q = EvictionQueue::new(EvictionPolicy::CostAware);
        q.insert(0usize, facts(0.0, 1, 0.0), 1);
        q.insert(0, facts(0.0, 2, 1.0), 2);
        q.resize(0, 34);
        let before = *q.get(&0).unwrap();
        q.touch(0, 4, 0.0);
        let after = *q.get(&0).unwrap();
        assert!(after.priority >= before.priority, "{after:?} < {before:?}");
        assert_eq!(after.priority, 1.0 / 34.0);
    }

    /// The brute-force definition of each policy's victim over the tracked entries.
    fn expected_victim(q: &EvictionQueue<usize>, now: u64) -> usize {
        let entries: Vec<(usize, Tracked)> = q.tracked.iter().map(|(&k, &t)| (k, t)).collect();
        let older = |a: &Tracked, b: &Tracked| b.last_used.cmp(&a.last_used);
        entries
            .iter()
            .max_by(|(_, a), (_, b)| match q.policy() {
                EvictionPolicy::Lru => older(a, b),
                EvictionPolicy::PisotGuard => a
                    .pisot_score(now)
                    .total_cmp(&b.pisot_score(now))
                    .then(older(a, b)),
                EvictionPolicy::CostAware => b.priority.total_cmp(&a.priority).then(older(a, b)),
            })
            .unwrap()
            .0
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert {
            key: usize,
            drift: u8,
            bytes: usize,
            cost: u8,
        },
        Touch {
            key: usize,
            saved: u8,
        },
        Resize {
            key: usize,
            bytes: usize,
        },
        Remove {
            key: usize,
        },
        Pop,
        Policy(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0usize..12, 0u8..4, 1usize..64, 0u8..20)
                .prop_map(|(key, drift, bytes, cost)| Op::Insert { key, drift, bytes, cost }),
            4 => (0usize..12, 0u8..20).prop_map(|(key, saved)| Op::Touch { key, saved }),
            1 => (0usize..12, 1usize..64).prop_map(|(key, bytes)| Op::Resize { key, bytes }),
            1 => (0usize..12).prop_map(|key| Op::Remove { key }),
            3 => Just(Op::Pop),
            1 => (0usize..3).prop_map(Op::Policy),
        ]
    }

    proptest! {
        #[test]
        fn every_victim_matches_the_brute_force_definition_and_priorities_stay_bounded(
            ops in proptest::collection::vec(op(), 1..120),
            start in 0usize..3,
        ) {
            let mut q = EvictionQueue::new(EvictionPolicy::ALL[start]);
            let mut now = 0u64;
            for op in ops {
                now += 1; // unique ticks, as the caches guarantee
                let inflation = q.inflation();
                match op {
                    Op::Insert { key, drift, bytes, cost } => {
                        q.insert(key, facts(f32::from(drift), bytes, f64::from(cost)), now);
                    }
                    Op::Touch { key, saved } => {
                        let before = q.get(&key).copied();
                        q.touch(key, now, f64::from(saved));
                        if let (Some(b), Some(a)) = (before, q.get(&key)) {
                            // A hit never lowers an entry's value or priority.
                            prop_assert!(a.value >= b.value && a.priority >= b.priority);
                            prop_assert_eq!(a.last_used, now);
                        }
                    }
                    Op::Resize { key, bytes } => q.resize(key, bytes),
                    Op::Remove { key } => {
                        q.remove(&key);
                    }
                    Op::Pop => {
                        if !q.is_empty() {
                            let want = expected_victim(&q, now);
                            let got = q.pop_victim(now).unwrap();
                            prop_assert_eq!(got, want);
                            prop_assert!(!q.contains(&got));
                        }
                    }
                    Op::Policy(i) => q.set_policy(EvictionPolicy::ALL[i]),
                }
                // The inflation never falls, every priority sits at or above it and equals
                // inflation-at-last-use + value / bytes, and the index holds every entry once.
                prop_assert!(q.inflation() >= inflation);
                for t in q.tracked.values() {
                    prop_assert!(t.priority >= q.inflation() - 1e-9);
                    prop_assert!(t.priority.is_finite() && t.value >= 0.0);
                }
                let ordered = q.policy() != EvictionPolicy::PisotGuard;
                prop_assert_eq!(q.order.len(), if ordered { q.len() } else { 0 });
                if !q.is_empty() {
                    prop_assert_eq!(q.victim(now + 1), Some(expected_victim(&q, now + 1)));
                }
            }
        }
    }
}
