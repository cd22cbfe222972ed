//! How lookup and capture scale with the number of resident volumes (10, 10³, 10⁵).
//!
//! Every prompt is 64 tokens: one of 16 shared 32-token "system prompts" followed by a
//! unique 32-token tail, so the index holds many prefixes that share their first half (the
//! shape longest-prefix reuse exists for). Volumes are tiny (one layer, one KV head,
//! head_dim 2) so that 10⁵ of them fit in memory; lookup cost is in the index, not the copy.
//!
//! - `exact_hit`: replay of a resident prompt (BLAKE3 of the ids, index probe, id check);
//! - `prefix_hit`: longest-prefix lookup of a new prompt that shares 48 tokens with a
//!   resident one (the exact probe misses first, as the pipeline does);
//! - `miss`: exact and longest-prefix lookup of a prompt sharing nothing;
//! - `capture_<policy>`: capturing a new prompt into a full cache (`max_entries` = N), which
//!   evicts one entry by that policy (Pisot-guard's victim search is a scan: its scores all
//!   move with the clock, so they keep no order; the others keep an ordered queue).
//!
//! After criterion finishes, the medians of this run are printed with the 10 → 10⁵ ratio of
//! each operation (target ≤ 3×).
//!
//! Run: `cargo bench --bench volume_index`

use std::hint::black_box;
use std::time::{Duration, SystemTime};

use amplituhedron::eviction::EvictionPolicy;
use amplituhedron::volume::{AmplituhedronCache, CacheConfig, VolumeData, VolumeKey};
use criterion::{BenchmarkId, Criterion};

mod common;
use common::median_ns;

const SIZES: [usize; 3] = [10, 1_000, 100_000];
const PROMPT_LEN: usize = 64;
const SYSTEM_LEN: usize = 32;
const SYSTEM_PROMPTS: u32 = 16;
const FINGERPRINT: u64 = 0xfeed;
const MIN_REUSE: usize = 16;

/// Prompt `i`: system prompt `i % 16`, then 32 ids unique to `i` (a bijective mix, so no two
/// prompts share a tail).
fn prompt(i: u64) -> Vec<u32> {
    let system = (i % u64::from(SYSTEM_PROMPTS)) as u32;
    let mut ids: Vec<u32> = (0..SYSTEM_LEN as u32).map(|t| system * 1000 + t).collect();
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for _ in SYSTEM_LEN..PROMPT_LEN {
        x ^= x >> 29;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        ids.push(100_000 + (x % 40_000) as u32);
    }
    ids
}

fn key(tokens: &[u32]) -> VolumeKey<'_> {
    VolumeKey {
        model_fingerprint: FINGERPRINT,
        tokens,
        layer_lo: 0,
        layer_hi: 1,
        salt: None,
    }
}

struct Payload {
    tail: Vec<f32>,
    slab: Vec<f32>,
}

impl Payload {
    fn new() -> Self {
        Payload {
            tail: vec![0.5; 4],
            slab: (0..PROMPT_LEN * 2).map(|i| i as f32 * 0.01).collect(),
        }
    }

    fn data(&self) -> VolumeData<'_> {
        VolumeData {
            kv_shape: [1, 1, PROMPT_LEN, 2],
            tail: &self.tail,
            kv_keys: (&self.slab).into(),
            kv_vals: (&self.slab).into(),
            logits: None,
        }
    }
}

/// A cache holding prompts `0..n`, with room for exactly `n`.
fn filled(n: usize, payload: &Payload) -> AmplituhedronCache {
    let mut cache = AmplituhedronCache::new(CacheConfig {
        max_entries: n,
        max_prefix_len: PROMPT_LEN,
        ..CacheConfig::default()
    })
    .expect("valid config");
    for i in 0..n as u64 {
        cache
            .capture(&key(&prompt(i)), payload.data())
            .expect("valid capture");
    }
    assert_eq!(cache.len(), n);
    cache
}

fn bench_index(c: &mut Criterion) {
    let payload = Payload::new();
    let mut group = c.benchmark_group("volume_index");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(20);
    for n in SIZES {
        let mut cache = filled(n, &payload);
        // Resident prompts to probe, spread over the whole cache.
        let resident: Vec<Vec<u32>> = (0..64).map(|j| prompt(j * n as u64 / 64)).collect();
        // New prompts sharing 48 tokens with a resident one.
        let near: Vec<Vec<u32>> = resident
            .iter()
            .map(|p| {
                let mut q = p.clone();
                q[48..].iter_mut().for_each(|t| *t = 900_000 + *t % 7);
                q
            })
            .collect();
        let strangers: Vec<Vec<u32>> = (0..64u32)
            .map(|j| {
                (0..PROMPT_LEN as u32)
                    .map(|t| 500_000 + j * 100 + t)
                    .collect()
            })
            .collect();
        let mut j = 0usize;
        group.bench_with_input(BenchmarkId::new("exact_hit", n), &n, |b, _| {
            b.iter(|| {
                j = (j + 1) % resident.len();
                let hit = cache.replay(black_box(&key(&resident[j]))).expect("valid");
                black_box(hit.expect("resident"));
            })
        });
        group.bench_with_input(BenchmarkId::new("prefix_hit", n), &n, |b, _| {
            b.iter(|| {
                j = (j + 1) % near.len();
                let k = key(&near[j]);
                assert!(cache.replay(black_box(&k)).expect("valid").is_none());
                let (_, reused) = cache
                    .replay_longest_prefix(&k, MIN_REUSE)
                    .expect("valid")
                    .expect("shares 48 tokens");
                assert_eq!(reused, 48);
            })
        });
        group.bench_with_input(BenchmarkId::new("miss", n), &n, |b, _| {
            b.iter(|| {
                j = (j + 1) % strangers.len();
                let k = key(&strangers[j]);
                assert!(cache.replay(black_box(&k)).expect("valid").is_none());
                let longest = cache.replay_longest_prefix(&k, MIN_REUSE).expect("valid");
                assert!(longest.is_none());
            })
        });
        let mut next = n as u64;
        for policy in EvictionPolicy::ALL {
            cache.set_policy(policy);
            let id = BenchmarkId::new(format!("capture_{policy}"), n);
            group.bench_with_input(id, &n, |b, _| {
                b.iter(|| {
                    next += 1;
                    let out = cache.capture(&key(&prompt(next)), payload.data());
                    black_box(out.expect("valid capture"));
                })
            });
            assert_eq!(cache.len(), n, "every capture evicted exactly one entry");
        }
    }
    group.finish();
}

fn summary(since: SystemTime) {
    println!("\nvolume index summary (medians of this run)");
    let captures = EvictionPolicy::ALL.map(|p| format!("capture_{p}"));
    let lookups = ["exact_hit", "prefix_hit", "miss"].map(str::to_owned);
    for function in lookups.iter().chain(&captures) {
        let times: Vec<Option<f64>> = SIZES
            .iter()
            .map(|&n| median_ns(&["volume_index", function, &n.to_string()], since))
            .collect();
        let shown: Vec<String> = SIZES
            .iter()
            .zip(&times)
            .map(|(n, t)| {
                t.map_or_else(
                    || format!("{n}: n/a"),
                    |t| format!("{n}: {:.2} µs", t / 1e3),
                )
            })
            .collect();
        let ratio = match (times[0], times[2]) {
            (Some(small), Some(large)) => format!("{:.2}× (target <= 3×)", large / small),
            _ => "n/a".to_owned(),
        };
        println!("  {function:<14} {}  10 -> 10^5: {ratio}", shown.join(", "));
    }
}

fn main() {
    let since = SystemTime::now();
    let mut c = Criterion::default().configure_from_args();
    bench_index(&mut c);
    c.final_summary();
    summary(since);
}
