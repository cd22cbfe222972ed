//! Tests of the volume cache (a child module of `volume`, so they can force a lookup-hash
//! collision through the private identity-taking entry points).

mod disk;
mod index;

use super::block::{self, Floats};
use super::slab::{all_finite, all_finite_portable, copy_all_finite, copy_all_finite_portable};
use super::*;
use crate::eviction::Tracked;
use crate::keys::digest_prefix_u64;
use crate::ring::{KvDtype, KvSlice};
use proptest::prelude::*;
use std::collections::HashSet;

/// A capture request with owned buffers, easy to mutate into bad input.
#[derive(Debug, Clone)]
struct Sample {
    fp: u64,
    tokens: Vec<u32>,
    lo: u16,
    hi: u16,
    shape: [usize; 4],
    tail: Vec<f32>,
    keys: Vec<f32>,
    vals: Vec<f32>,
    logits: Option<Vec<f32>>,
    salt: Option<String>,
}

impl Sample {
    /// Layers [0, 2), 2 heads, head_dim 4, a unit-norm tail, logits.
    fn new(tokens: Vec<u32>) -> Self {
        Self::with_layout(tokens, 0, 2, 2, 4)
    }

    fn with_layout(tokens: Vec<u32>, lo: u16, hi: u16, heads: usize, head_dim: usize) -> Self {
        let layers = usize::from(hi - lo);
        let shape = [layers, heads, tokens.len(), head_dim];
        // As a model's KV: position p depends on the ids up to p only (so prompts sharing a
        // prefix share its KV), and on the absolute layer, the head and the dimension.
        let mut h = 0u32;
        let prefix: Vec<u32> = tokens
            .iter()
            .map(|&t| {
                h = h.wrapping_mul(31).wrapping_add(t).wrapping_add(7);
                h % 997
            })
            .collect();
        let mut keys = Vec::with_capacity(shape.iter().product());
        for layer in 0..layers {
            for head in 0..heads {
                for &p in &prefix {
                    for d in 0..head_dim {
                        let row = (usize::from(lo) + layer) * 7 + head * 3 + d;
                        keys.push(p as f32 * 0.25 + row as f32 * 0.125);
                    }
                }
            }
        }
        let vals: Vec<f32> = keys.iter().map(|k| -k - 1.0).collect();
        let mut tail = vec![0.0; 8];
        tail[0] = 1.0;
        Sample {
            fp: 1,
            tokens,
            lo,
            hi,
            shape,
            tail,
            keys,
            vals,
            logits: Some(vec![0.5, -0.5, 2.0]),
            salt: None,
        }
    }

    fn key(&self) -> VolumeKey<'_> {
        VolumeKey {
            model_fingerprint: self.fp,
            tokens: &self.tokens,
            layer_lo: self.lo,
            layer_hi: self.hi,
            salt: self.salt.as_deref(),
        }
    }

    fn data(&self) -> VolumeData<'_> {
        VolumeData {
            kv_shape: self.shape,
            tail: &self.tail,
            kv_keys: (&self.keys).into(),
            kv_vals: (&self.vals).into(),
            logits: self.logits.as_deref(),
        }
    }

    fn owned(&self) -> OwnedVolumeData {
        OwnedVolumeData {
            kv_shape: self.shape,
            tail: self.tail.clone(),
            kv_keys: self.keys.clone(),
            kv_vals: self.vals.clone(),
            logits: self.logits.clone(),
        }
    }

    fn capture(&self, cache: &mut AmplituhedronCache) -> Result<CaptureOutcome, VolumeError> {
        cache.capture(&self.key(), self.data())
    }

    fn replay(&self, cache: &mut AmplituhedronCache) -> Option<Arc<AmplituhedronVolume>> {
        cache.replay(&self.key()).unwrap()
    }

    fn expected_bytes(&self) -> usize {
        4 * (self.keys.len()
            + self.vals.len()
            + self.tail.len()
            + self.logits.as_ref().map_or(0, Vec::len)
            + self.tokens.len())
    }

    fn assert_is(&self, v: &AmplituhedronVolume) {
        assert_eq!(v.tokens(), &self.tokens[..]);
        assert_eq!(v.model_fingerprint(), self.fp);
        assert_eq!((v.layer_lo(), v.layer_hi()), (self.lo, self.hi));
        assert_eq!(v.slab_shape().dims(), self.shape);
        assert_eq!(v.kv_keys(), &self.keys[..]);
        assert_eq!(v.kv_vals(), &self.vals[..]);
        assert_eq!(v.tail(), Some(&self.tail[..]));
        assert_eq!(v.logits(), self.logits.as_deref());
        assert_eq!(v.prefix_len(), self.tokens.len());
        assert_eq!(v.kv_len(), self.tokens.len());
        assert_eq!(v.nbytes(), self.expected_bytes());
    }
}

fn cache_with(max_entries: usize, policy: EvictionPolicy) -> AmplituhedronCache {
    AmplituhedronCache::new(CacheConfig {
        max_entries,
        policy,
        ..CacheConfig::default()
    })
    .unwrap()
}

/// Deterministic splitmix64 (no rand dependency needed).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// `keys` and `vals` in `shape`'s slab layout as blocks, unchecked (the only way to build a
/// damaged volume: the cache never makes one).
fn unchecked_blocks(shape: SlabShape, keys: &[f32], vals: &[f32]) -> Vec<Arc<KvBlock>> {
    block::block_spans(shape.positions)
        .map(|(start, n)| {
            let gather = |src: &[f32]| -> Vec<f32> {
                let run = n * shape.head_dim;
                (0..shape.layers * shape.kv_heads)
                    .flat_map(|i| {
                        let from = shape.row_offset(i / shape.kv_heads, i % shape.kv_heads, start);
                        src[from..from + run].iter().copied()
                    })
                    .collect()
            };
            let data = [gather(keys), gather(vals)].concat().into_boxed_slice();
            Arc::new(KvBlock::new(n, Floats::Heap(slab::HeapKv::F32(data))))
        })
        .collect()
}

/// A copy of `vol` with a non-finite value at each `(slab, layer, head, position)` row.
fn damaged(vol: &AmplituhedronVolume, rows: &[(&str, usize, usize, usize)]) -> AmplituhedronVolume {
    let mut keys = vol.kv_keys().to_vec();
    let mut vals = vol.kv_vals().to_vec();
    for &(which, layer, head, pos) in rows {
        let off = vol.shape.row_offset(layer, head, pos) + vol.shape.head_dim / 2;
        match which {
            "kv_keys" => keys[off] = f32::NAN,
            _ => vals[off] = f32::INFINITY,
        }
    }
    vol.with_blocks(unchecked_blocks(vol.shape, &keys, &vals))
}

// ---- round trips and sizes ------------------------------------------------------------

#[test]
fn capture_then_replay_round_trips_every_field() {
    let mut cache = AmplituhedronCache::default();
    let s = Sample::new(vec![10, 20, 30]);
    let bytes = s.expected_bytes();
    assert_eq!(
        s.capture(&mut cache).unwrap(),
        CaptureOutcome::Stored { bytes }
    );
    let v = s.replay(&mut cache).expect("hit");
    s.assert_is(&v);
    assert_eq!(v.prefix_hash(), crate::keys::prefix_hash(&s.tokens));
    assert_eq!(v.digest(), &crate::keys::prefix_digest(&s.tokens));
    assert!(!v.is_salted() && !v.is_erased());
    assert_eq!(v.drift(), 0.0);
    let st = cache.stats();
    assert_eq!(
        st,
        CacheStats {
            hits: 1,
            misses: 0,
            evictions: 0,
            entries: 1,
            bytes,
            captures: 1,
            ..CacheStats::default()
        }
    );
    // The owned variant stores the same thing.
    let mut other = AmplituhedronCache::default();
    assert_eq!(
        other.capture_owned(&s.key(), s.owned()).unwrap(),
        CaptureOutcome::Stored { bytes }
    );
    s.assert_is(&s.replay(&mut other).unwrap());
    // Logits are optional.
    let mut no_logits = Sample::new(vec![4, 5]);
    no_logits.logits = None;
    no_logits.capture(&mut cache).unwrap();
    assert_eq!(no_logits.replay(&mut cache).unwrap().logits(), None);
}

#[test]
fn byte_size_is_the_documented_formula_and_linear_in_states_times_layers() {
    for (p, lo, hi, heads, hd) in [
        (1usize, 0u16, 1u16, 1usize, 1usize),
        (7, 3, 5, 3, 8),
        (64, 0, 3, 2, 16),
    ] {
        let s = Sample::with_layout((0..p as u32).collect(), lo, hi, heads, hd);
        let mut cache = AmplituhedronCache::default();
        let out = s.capture(&mut cache).unwrap();
        let layers = usize::from(hi - lo);
        let want = 4 * (2 * p * layers * heads * hd + s.tail.len() + 3 + p);
        assert_eq!(out.cached_bytes(), want);
        assert_eq!(cache.stats().bytes, want);
    }
    // Lean volume = states × constraints: the slab holds 2·kv_heads·head_dim floats per
    // (position, layer) slot, so doubling either factor doubles it (oracle 7 × 32 = 224).
    let slab_floats = |p: usize, layers: u16| {
        let s = Sample::with_layout((0..p as u32).collect(), 0, layers, 2, 4);
        let v = {
            let mut c = AmplituhedronCache::default();
            s.capture(&mut c).unwrap();
            s.replay(&mut c).unwrap()
        };
        (v.kv_keys().len() + v.kv_vals().len()) / (2 * 2 * 4)
    };
    assert_eq!(slab_floats(7, 32), 224);
    assert_eq!(slab_floats(14, 32), 2 * slab_floats(7, 32));
    assert_eq!(slab_floats(7, 64), 2 * slab_floats(7, 32));
    assert_eq!(slab_floats(1, 1), 1);
}

// ---- bad input ------------------------------------------------------------------------

/// Stats plus a full replay of `resident` (which counts one hit on both sides).
fn snapshot(cache: &mut AmplituhedronCache, resident: &Sample) -> (CacheStats, usize) {
    let st = cache.stats();
    let v = resident
        .replay(cache)
        .expect("resident entry still replays");
    resident.assert_is(&v);
    (st, cache.len())
}

#[test]
fn every_bad_input_is_an_error_that_changes_nothing() {
    let mut cache = cache_with(4, EvictionPolicy::PisotGuard);
    let resident = Sample::new(vec![1, 2, 3, 4]);
    resident.capture(&mut cache).unwrap();
    let good = Sample::new(vec![9, 8, 7]);

    let mut cases: Vec<(Sample, VolumeError)> = Vec::new();
    let mut s = good.clone();
    s.tokens.clear();
    s.shape[2] = 0;
    s.keys.clear();
    s.vals.clear();
    cases.push((s, VolumeError::EmptyPrefix));
    let mut s = good.clone();
    s.lo = 2;
    cases.push((
        s,
        VolumeError::EmptyLayerRange {
            layer_lo: 2,
            layer_hi: 2,
        },
    ));
    let mut s = good.clone();
    (s.lo, s.hi) = (5, 3);
    cases.push((
        s,
        VolumeError::EmptyLayerRange {
            layer_lo: 5,
            layer_hi: 3,
        },
    ));
    let mut s = good.clone();
    s.hi = 3;
    cases.push((
        s,
        VolumeError::SlabDimension {
            dim: "layers (dim 0)",
            expected: 3,
            actual: 2,
        },
    ));
    let mut s = good.clone();
    s.tokens.push(6);
    cases.push((
        s,
        VolumeError::SlabDimension {
            dim: "positions (dim 2, must equal prefix_len)",
            expected: 4,
            actual: 3,
        },
    ));
    let mut s = good.clone();
    s.shape[1] = 0;
    cases.push((
        s,
        VolumeError::ZeroDimension {
            dim: "kv_heads (dim 1)",
        },
    ));
    let mut s = good.clone();
    s.shape[3] = 0;
    cases.push((
        s,
        VolumeError::ZeroDimension {
            dim: "head_dim (dim 3)",
        },
    ));
    let mut s = good.clone();
    s.shape[1] = usize::MAX / 2;
    cases.push((s, VolumeError::SlabTooLarge));
    let mut s = good.clone();
    s.keys.pop();
    cases.push((
        s,
        VolumeError::SlabLength {
            which: "kv_keys",
            expected: 48,
            actual: 47,
        },
    ));
    let mut s = good.clone();
    s.vals.push(0.0);
    cases.push((
        s,
        VolumeError::SlabLength {
            which: "kv_vals",
            expected: 48,
            actual: 49,
        },
    ));
    let mut s = good.clone();
    s.tail.clear();
    cases.push((s, VolumeError::EmptyTail));
    let mut s = good.clone();
    s.tail[3] = f32::NAN;
    cases.push((
        s,
        VolumeError::NonFinite {
            what: "tail",
            index: 3,
        },
    ));
    let mut s = good.clone();
    s.logits = Some(vec![0.0, f32::NEG_INFINITY]);
    cases.push((
        s,
        VolumeError::NonFinite {
            what: "logits",
            index: 1,
        },
    ));
    let mut s = good.clone();
    s.logits = Some(vec![]);
    cases.push((s, VolumeError::EmptyLogits));
    // Layout (2 layers, 2 heads, 3 positions, 4): layer 1, head 1, position 2 is row 11.
    let mut s = good.clone();
    (s.lo, s.hi) = (5, 7);
    s.keys[11 * 4 + 1] = f32::NAN;
    s.keys[10 * 4] = f32::INFINITY; // layer 1, head 1, position 1: the earliest damage
    cases.push((
        s,
        VolumeError::NonFiniteKv {
            which: "kv_keys",
            layer: 6,
            head: 1,
            position: 1,
        },
    ));
    let mut s = good.clone();
    s.vals[3 * 4 + 2] = f32::NAN; // layer 0, head 1, position 0
    cases.push((
        s,
        VolumeError::NonFiniteKv {
            which: "kv_vals",
            layer: 0,
            head: 1,
            position: 0,
        },
    ));
    // A capture that would drift-clear the resident entry (same prompt, new model) but has
    // damaged data must not clear anything.
    let mut s = resident.clone();
    s.fp = 2;
    s.vals[0] = f32::NAN;
    cases.push((
        s,
        VolumeError::NonFiniteKv {
            which: "kv_vals",
            layer: 0,
            head: 0,
            position: 0,
        },
    ));

    for (s, want) in &cases {
        let before = snapshot(&mut cache, &resident);
        assert_eq!(
            &s.capture(&mut cache).unwrap_err(),
            want,
            "borrowed: {want}"
        );
        assert_eq!(
            snapshot(&mut cache, &resident),
            (before.0.with_hit(), before.1)
        );
        let before = snapshot(&mut cache, &resident);
        assert_eq!(
            &cache.capture_owned(&s.key(), s.owned()).unwrap_err(),
            want,
            "owned"
        );
        assert_eq!(
            snapshot(&mut cache, &resident),
            (before.0.with_hit(), before.1)
        );
        assert!(!want.to_string().is_empty());
    }

    // Errors do not depend on the cache's state: disabled, too long or too large.
    let mut nan = good.clone();
    nan.keys[0] = f32::NAN;
    for setup in 0..3 {
        let mut c = AmplituhedronCache::default();
        match setup {
            0 => c.enable(false),
            1 => c.set_max_prefix_len(1).unwrap(),
            _ => c.set_max_bytes(Some(8)).unwrap(),
        }
        let st = c.stats();
        assert!(matches!(
            nan.capture(&mut c),
            Err(VolumeError::NonFiniteKv { .. })
        ));
        assert_eq!(c.stats(), st);
    }

    // Replay and report_damage validate their keys too.
    let before = cache.stats();
    let mut empty = good.clone();
    empty.tokens.clear();
    assert_eq!(
        cache.replay(&empty.key()).unwrap_err(),
        VolumeError::EmptyPrefix
    );
    assert_eq!(
        cache.report_damage(&empty.key(), 0).unwrap_err(),
        VolumeError::EmptyPrefix
    );
    let mut inverted = good.clone();
    inverted.lo = 9;
    assert!(matches!(
        cache.replay(&inverted.key()),
        Err(VolumeError::EmptyLayerRange { .. })
    ));
    assert_eq!(cache.stats(), before);

    // Config setters refuse zero.
    for r in [
        cache.set_max_entries(0),
        cache.set_max_prefix_len(0),
        cache.set_max_bytes(Some(0)),
    ] {
        assert!(matches!(r, Err(VolumeError::InvalidConfig { .. })));
    }
    assert_eq!(
        cache.config(),
        &CacheConfig {
            max_entries: 4,
            policy: EvictionPolicy::PisotGuard,
            ..CacheConfig::default()
        }
    );
    assert!(AmplituhedronCache::new(CacheConfig {
        max_entries: 0,
        ..CacheConfig::default()
    })
    .is_err());
    assert_eq!(snapshot(&mut cache, &resident).1, 1);
}

impl CacheStats {
    fn with_hit(mut self) -> Self {
        self.hits += 1;
        self
    }
}

// ---- outcomes that store nothing ------------------------------------------------------

#[test]
fn too_long_too_large_and_disabled_store_nothing() {
    let mut cache = AmplituhedronCache::default();
    cache.set_max_prefix_len(3).unwrap();
    let long = Sample::new(vec![1, 2, 3, 4]);
    assert_eq!(
        long.capture(&mut cache).unwrap(),
        CaptureOutcome::SkippedTooLong {
            prefix_len: 4,
            max: 3
        }
    );
    assert_eq!(cache.stats().skipped_too_long, 1);
    assert!(cache.is_empty());
    let fits = Sample::new(vec![1, 2, 3]);
    assert!(matches!(
        fits.capture(&mut cache).unwrap(),
        CaptureOutcome::Stored { .. }
    ));

    cache
        .set_max_bytes(Some(fits.expected_bytes() + 4))
        .unwrap();
    let big = Sample::with_layout(vec![7, 7], 0, 4, 2, 4);
    assert_eq!(
        big.capture(&mut cache).unwrap(),
        CaptureOutcome::SkippedTooLarge {
            bytes: big.expected_bytes(),
            max: fits.expected_bytes() + 4
        }
    );
    assert_eq!(cache.stats().skipped_too_large, 1);
    assert_eq!(cache.len(), 1, "a too-large capture evicts nothing");

    cache.enable(false);
    assert!(!cache.is_enabled());
    let st = cache.stats();
    let other = Sample::new(vec![5]);
    assert_eq!(other.capture(&mut cache).unwrap(), CaptureOutcome::Disabled);
    assert_eq!(CaptureOutcome::Disabled.cached_bytes(), 0);
    assert!(fits.replay(&mut cache).is_none(), "disabled replays miss");
    assert_eq!(cache.stats(), st, "a disabled cache counts nothing");
    cache.enable(true);
    assert!(
        fits.replay(&mut cache).is_some(),
        "entries survive disabling"
    );
}

#[test]
fn capturing_the_same_content_again_is_a_no_op_that_marks_it_used() {
    let mut cache = cache_with(2, EvictionPolicy::Lru);
    let a = Sample::new(vec![1]);
    let b = Sample::new(vec![2]);
    a.capture(&mut cache).unwrap();
    b.capture(&mut cache).unwrap();
    let st = cache.stats();
    assert_eq!(
        a.capture(&mut cache).unwrap(),
        CaptureOutcome::AlreadyPresent {
            bytes: a.expected_bytes()
        }
    );
    assert_eq!(cache.stats(), st);
    // `a` was touched last, so LRU evicts `b` for `c`.
    Sample::new(vec![3]).capture(&mut cache).unwrap();
    assert!(a.replay(&mut cache).is_some());
    assert!(b.replay(&mut cache).is_none());
}

// ---- what decides a hit ---------------------------------------------------------------

#[test]
fn fingerprint_layer_range_and_tokens_all_decide_a_hit() {
    let mut cache = cache_with(8, EvictionPolicy::PisotGuard);
    let s = Sample::new(vec![3, 1, 4, 1, 5]);
    s.capture(&mut cache).unwrap();
    let mut other_fp = s.clone();
    other_fp.fp = 2;
    assert!(other_fp.replay(&mut cache).is_none(), "model changed: miss");
    let mut other_range = s.clone();
    (other_range.lo, other_range.hi) = (1, 3);
    assert!(other_range.replay(&mut cache).is_none());
    let mut longer = s.clone();
    longer.tokens.push(9);
    assert!(
        longer.replay(&mut cache).is_none(),
        "a longer prompt is another prefix"
    );
    let mut shorter = s.clone();
    shorter.tokens.pop();
    assert!(shorter.replay(&mut cache).is_none());
    assert!(s.replay(&mut cache).is_some());
    // Two layer ranges of one prompt coexist: not drift.
    let mut range_b = Sample::with_layout(s.tokens.clone(), 2, 4, 2, 4);
    range_b.fp = s.fp;
    assert!(matches!(
        range_b.capture(&mut cache).unwrap(),
        CaptureOutcome::Stored { .. }
    ));
    assert!(s.replay(&mut cache).is_some() && range_b.replay(&mut cache).is_some());
    assert_eq!(cache.stats().misses, 4);
}

#[test]
fn a_new_fingerprint_in_a_slot_clears_every_entry_of_the_old_model() {
    let mut cache = cache_with(8, EvictionPolicy::PisotGuard);
    let a = Sample::new(vec![1, 2]);
    let b = Sample::new(vec![3, 4]);
    let mut c_other_model = Sample::new(vec![5, 6]);
    c_other_model.fp = 77;
    for s in [&a, &b, &c_other_model] {
        s.capture(&mut cache).unwrap();
    }
    let mut a2 = a.clone();
    a2.fp = 2;
    assert_eq!(
        a2.capture(&mut cache).unwrap(),
        CaptureOutcome::StoredAfterDrift {
            bytes: a2.expected_bytes(),
            cleared: 2
        }
    );
    assert_eq!(cache.stats().drift_clears, 2);
    assert!(a.replay(&mut cache).is_none() && b.replay(&mut cache).is_none());
    assert!(a2.replay(&mut cache).is_some());
    assert!(
        c_other_model.replay(&mut cache).is_some(),
        "only the drifted model's entries go"
    );
    assert_eq!(cache.len(), 2);
}

#[test]
fn a_forced_u64_collision_never_hits_and_drops_only_that_entry() {
    let mut cache = cache_with(8, EvictionPolicy::PisotGuard);
    let a = Sample::new(vec![11, 12, 13]);
    let b = Sample::new(vec![21, 22, 23]);
    let bystander = Sample::new(vec![99]);
    bystander.capture(&mut cache).unwrap();
    const FORCED: u64 = 0xdead_beef_cafe_f00d;
    let forced = |s: &Sample| PrefixIdentity {
        lookup_hash: FORCED,
        ..PrefixIdentity::of(&s.key())
    };
    let out = cache
        .capture_identified(&a.key(), forced(&a), a.data())
        .unwrap();
    assert!(matches!(out, CaptureOutcome::Stored { .. }));
    // Same u64 and layer range, different digest and ids: a miss, not a false hit.
    assert!(cache.replay_identified(&b.key(), &forced(&b)).is_none());
    // Same u64 and digest but other ids (a forced full-digest collision): still a miss.
    let digest_twin = PrefixIdentity {
        digest: forced(&a).digest,
        ..forced(&b)
    };
    assert!(cache.replay_identified(&b.key(), &digest_twin).is_none());
    assert_eq!(cache.stats().misses, 2);
    assert!(cache.replay_identified(&a.key(), &forced(&a)).is_some());
    // Capturing `b` into the collided slot drops `a` (same model: a collision, not a
    // model change) and nothing else.
    let out = cache
        .capture_identified(&b.key(), forced(&b), b.data())
        .unwrap();
    assert_eq!(
        out,
        CaptureOutcome::StoredAfterDrift {
            bytes: b.expected_bytes(),
            cleared: 1
        }
    );
    assert!(cache.replay_identified(&a.key(), &forced(&a)).is_none());
    assert!(cache.replay_identified(&b.key(), &forced(&b)).is_some());
    assert!(bystander.replay(&mut cache).is_some());
    assert_eq!(cache.stats().drift_clears, 1);
}

#[test]
fn one_hundred_thousand_random_distinct_prompts_give_zero_false_hits() {
    let mut rng = SplitMix(0x5eed);
    let mut seen = HashSet::new();
    let mut prompts = Vec::with_capacity(100_000);
    while prompts.len() < 100_000 {
        let len = 1 + (rng.next() % 16) as usize;
        // A small vocabulary makes near-duplicates (shared prefixes) common.
        let vocab = if prompts.len() % 2 == 0 {
            8
        } else {
            u64::from(u32::MAX) + 1
        };
        let p: Vec<u32> = (0..len).map(|_| (rng.next() % vocab) as u32).collect();
        if seen.insert(p.clone()) {
            prompts.push(p);
        }
    }
    let captured = 64;
    let mut cache = cache_with(captured, EvictionPolicy::PisotGuard);
    for p in &prompts[..captured] {
        let s = Sample::with_layout(p.clone(), 0, 1, 1, 1);
        assert!(matches!(
            s.capture(&mut cache).unwrap(),
            CaptureOutcome::Stored { .. }
        ));
    }
    let mut hits = 0;
    for (i, p) in prompts.iter().enumerate() {
        let key = VolumeKey {
            model_fingerprint: 1,
            tokens: p,
            layer_lo: 0,
            layer_hi: 1,
            salt: None,
        };
        match cache.replay(&key).unwrap() {
            Some(v) => {
                assert!(i < captured, "false hit for prompt {i}");
                assert_eq!(v.tokens(), &p[..]);
                hits += 1;
            }
            None => assert!(i >= captured, "captured prompt {i} missed"),
        }
    }
    assert_eq!(hits, captured);
    assert_eq!(cache.stats().misses, (prompts.len() - captured) as u64);
}

#[test]
fn salts_isolate_tenants() {
    let mut cache = cache_with(8, EvictionPolicy::PisotGuard);
    let plain = Sample::new(vec![42, 43, 44]);
    let mut t1 = plain.clone();
    t1.salt = Some("tenant-1".into());
    let mut t2 = plain.clone();
    t2.salt = Some("tenant-2".into());
    let mut empty_salt = plain.clone();
    empty_salt.salt = Some(String::new());

    let hashes: HashSet<u64> = [&plain, &t1, &t2, &empty_salt]
        .iter()
        .map(|s| s.key().lookup_hash())
        .collect();
    assert_eq!(hashes.len(), 4, "every salt gives its own lookup hash");
    assert_eq!(
        plain.key().lookup_hash(),
        crate::keys::prefix_hash(&plain.tokens)
    );
    let tk = crate::keys::tenant_key("tenant-1");
    assert_eq!(
        t1.key().lookup_hash(),
        digest_prefix_u64(&crate::keys::salted_prefix_digest(&t1.tokens, &tk))
    );

    plain.capture(&mut cache).unwrap();
    assert!(
        t1.replay(&mut cache).is_none(),
        "a tenant cannot see unsalted volumes"
    );
    t1.capture(&mut cache).unwrap();
    assert!(t2.replay(&mut cache).is_none(), "nor another tenant's");
    assert!(
        empty_salt.replay(&mut cache).is_none(),
        "an empty salt is still a salt"
    );
    let v = t1.replay(&mut cache).unwrap();
    assert!(v.is_salted());
    assert_eq!(v.prefix_hash(), t1.key().lookup_hash());
    assert!(!plain.replay(&mut cache).unwrap().is_salted());
    assert_eq!(cache.len(), 2);
    // Different salts never drift-clear each other (different slots).
    assert_eq!(cache.stats().drift_clears, 0);
    assert_ne!(
        t1.key().cache_key().encode(),
        plain.key().cache_key().encode()
    );
}

// ---- erasure --------------------------------------------------------------------------

#[test]
fn erasure_trims_the_trailing_position_once_then_clears() {
    let mut cache = cache_with(8, EvictionPolicy::PisotGuard);
    let a = Sample::new(vec![1, 2, 3, 4]);
    let b = Sample::new(vec![5, 6, 7]);
    a.capture(&mut cache).unwrap();
    b.capture(&mut cache).unwrap();
    let held = a.replay(&mut cache).unwrap();

    assert_eq!(
        cache.report_damage(&a.key(), 3).unwrap(),
        DamageOutcome::Trimmed { kv_len: 3 }
    );
    let t = a.replay(&mut cache).unwrap();
    assert_eq!((t.prefix_len(), t.kv_len()), (4, 3));
    assert!(t.is_erased());
    assert_eq!(t.tail(), None, "the tail described the erased position");
    assert_eq!(t.logits(), None);
    assert_eq!(t.kv_keys()[..], a.keys[..]);
    let shared = t.blocks().iter().zip(held.blocks());
    assert!(
        shared.into_iter().all(|(x, y)| Arc::ptr_eq(x, y)),
        "blocks are shared, not copied"
    );
    assert_eq!(t.nbytes(), a.expected_bytes() - 4 * (a.tail.len() + 3));
    assert_eq!(cache.stats().bytes, t.nbytes() + b.expected_bytes());
    a.assert_is(&held); // a caller's handle never changes under it
    assert_eq!(cache.tail(a.key().lookup_hash()), None);

    // Damage at a position the trimmed volume no longer covers is an error; nothing moves.
    let st = cache.stats();
    assert_eq!(
        cache.report_damage(&a.key(), 3).unwrap_err(),
        VolumeError::DamageOutOfRange {
            position: 3,
            kv_len: 3
        }
    );
    assert_eq!(cache.stats(), st);
    // A fresh capture of the same key restores the full volume (an erased entry is not
    // "the same content"); erase it again for the rest of the test.
    let st = cache.stats();
    assert_eq!(
        a.capture(&mut cache).unwrap(),
        CaptureOutcome::Stored {
            bytes: a.expected_bytes()
        }
    );
    a.assert_is(&a.replay(&mut cache).unwrap());
    assert_eq!(cache.len(), 2);
    assert_eq!(cache.stats().bytes, a.expected_bytes() + b.expected_bytes());
    assert_eq!(cache.stats().captures, st.captures + 1);
    assert_eq!(cache.stats().evictions + cache.stats().drift_clears, 0);
    assert_eq!(
        cache.report_damage(&a.key(), 3).unwrap(),
        DamageOutcome::Trimmed { kv_len: 3 }
    );
    // A second erasure (even at the new trailing position) clears the entry.
    assert_eq!(
        cache.report_damage(&a.key(), 2).unwrap(),
        DamageOutcome::Cleared
    );
    assert!(a.replay(&mut cache).is_none());
    b.assert_is(&b.replay(&mut cache).unwrap());
    assert_eq!(
        cache.report_damage(&a.key(), 0).unwrap(),
        DamageOutcome::Absent
    );
    assert_eq!(cache.stats().erasures, 3);

    // Damage before the trailing position clears at once; other entries stay.
    assert_eq!(
        cache.report_damage(&b.key(), 1).unwrap(),
        DamageOutcome::Cleared
    );
    assert!(b.replay(&mut cache).is_none());
    // A one-token volume cannot be trimmed to nothing: cleared.
    let one = Sample::new(vec![8]);
    let keep = Sample::new(vec![9, 9]);
    one.capture(&mut cache).unwrap();
    keep.capture(&mut cache).unwrap();
    assert_eq!(
        cache.report_damage(&one.key(), 0).unwrap(),
        DamageOutcome::Cleared
    );
    keep.assert_is(&keep.replay(&mut cache).unwrap());
    assert_eq!(cache.len(), 1);
    assert_eq!(cache.stats().bytes, keep.expected_bytes());
}

#[test]
fn damage_is_located_and_row_copies_check_finiteness() {
    let mut cache = AmplituhedronCache::default();
    let s = Sample::with_layout(vec![1, 2, 3, 4, 5], 4, 7, 2, 8);
    s.capture(&mut cache).unwrap();
    let v = s.replay(&mut cache).unwrap();
    assert_eq!(v.first_non_finite_position(), None);

    // Every row range copies exactly the source rows.
    let hd = 8;
    for layer in 4..7 {
        for head in 0..2 {
            let mut dk = vec![0.0; 3 * hd];
            let mut dv = vec![0.0; 3 * hd];
            v.copy_rows_checked(layer, head, 1..4, &mut dk, &mut dv)
                .unwrap();
            let off = v.slab_shape().row_offset(layer - 4, head, 1);
            assert_eq!(dk, &s.keys[off..off + 3 * hd]);
            assert_eq!(dv, &s.vals[off..off + 3 * hd]);
        }
    }
    let mut d = vec![0.0; hd];
    let mut e = vec![0.0; hd];
    for (layer, head, pos) in [
        (3usize, 0usize, 0..1),
        (7, 0, 0..1),
        (4, 2, 0..1),
        (4, 0, 4..6),
    ] {
        assert!(matches!(
            v.copy_rows_checked(layer, head, pos, &mut d, &mut e),
            Err(VolumeError::RowsOutOfRange { .. })
        ));
    }
    assert_eq!(
        v.copy_rows_checked(4, 0, 0..2, &mut d, &mut e),
        Err(VolumeError::DestinationLength {
            expected: 16,
            actual: 8
        })
    );

    // Damaged copies: the earliest damaged position over all layers and heads, both slabs.
    let bad = damaged(&v, &[("kv_keys", 2, 1, 3)]);
    assert_eq!(bad.first_non_finite_position(), Some(3));
    let worse = damaged(&v, &[("kv_keys", 2, 1, 3), ("kv_vals", 0, 0, 1)]);
    assert_eq!(worse.first_non_finite_position(), Some(1));
    let mut dk = vec![0.0; 5 * hd];
    let mut dv = vec![0.0; 5 * hd];
    assert_eq!(
        bad.copy_rows_checked(6, 1, 0..5, &mut dk, &mut dv),
        Err(VolumeError::NonFiniteKv {
            which: "kv_keys",
            layer: 6,
            head: 1,
            position: 3
        })
    );
    assert!(bad
        .copy_rows_checked(6, 1, 0..3, &mut dk[..3 * hd], &mut dv[..3 * hd])
        .is_ok());
    assert_eq!(
        worse.copy_rows_checked(4, 0, 0..5, &mut dk, &mut dv),
        Err(VolumeError::NonFiniteKv {
            which: "kv_vals",
            layer: 4,
            head: 0,
            position: 1
        })
    );
    // Damage beyond kv_len (the erased trailing position) is not covered, so not found.
    let trailing = damaged(&v, &[("kv_keys", 0, 0, 4)]);
    assert_eq!(trailing.first_non_finite_position(), Some(4));
    assert_eq!(trailing.trimmed().first_non_finite_position(), None);
    assert!(matches!(
        trailing
            .trimmed()
            .copy_rows_checked(4, 0, 0..5, &mut dk, &mut dv),
        Err(VolumeError::RowsOutOfRange { .. })
    ));
}

#[test]
fn finiteness_kernels_agree_with_is_finite() {
    let specials = [
        0.0f32,
        -0.0,
        1.0,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        1e-45,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
    ];
    // Both the run-time dispatched kernels and the portable ones (used without AVX2), on
    // lengths around the vector widths and across the 1024-float copy chunks.
    type Check = fn(&[f32]) -> bool;
    type Copy = fn(&[f32], &mut [f32]) -> bool;
    let kernels: [(Check, Copy); 2] = [
        (all_finite, copy_all_finite),
        (all_finite_portable, copy_all_finite_portable),
    ];
    for (check, copy) in kernels {
        for &x in &specials {
            for len in [1usize, 7, 33, 1024, 2500] {
                for at in [0, len / 2, len - 1, len.min(1025) - 1] {
                    let mut src: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
                    src[at] = x;
                    let mut dst = vec![0.0; len];
                    assert_eq!(check(&src), x.is_finite());
                    assert_eq!(copy(&src, &mut dst), x.is_finite());
                    assert_eq!(
                        dst.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        src.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    );
                }
            }
        }
        assert!(check(&[]));
    }
}

// ---- tail accessor --------------------------------------------------------------------

#[test]
fn tail_answers_only_for_the_last_verified_hit_still_resident() {
    let mut cache = cache_with(2, EvictionPolicy::Lru);
    let mut a = Sample::new(vec![1, 2]);
    a.tail = vec![0.25; 8];
    let h = a.key().lookup_hash();
    a.capture(&mut cache).unwrap();
    assert_eq!(cache.tail(h), None, "captured but never replayed");
    a.replay(&mut cache).unwrap();
    assert_eq!(cache.tail(h), Some(a.tail.clone()));
    assert_eq!(cache.tail(h ^ 1), None);
    cache.clear();
    assert_eq!(cache.tail(h), None);
    a.capture(&mut cache).unwrap();
    a.replay(&mut cache).unwrap();
    Sample::new(vec![3]).capture(&mut cache).unwrap();
    Sample::new(vec![4]).capture(&mut cache).unwrap(); // evicts `a` (LRU)
    assert_eq!(cache.tail(h), None, "evicted");
}

// ---- bounds and eviction --------------------------------------------------------------

#[test]
fn limits_evict_at_once_and_never_the_incoming_entry() {
    let mut cache = cache_with(4, EvictionPolicy::Lru);
    let samples: Vec<Sample> = (0..4).map(|i| Sample::new(vec![i, i + 1])).collect();
    for s in &samples {
        s.capture(&mut cache).unwrap();
    }
    cache.set_max_entries(2).unwrap();
    assert_eq!(cache.len(), 2);
    assert_eq!(cache.stats().evictions, 2);
    assert!(samples[2].replay(&mut cache).is_some() && samples[3].replay(&mut cache).is_some());
    let one = samples[0].expected_bytes();
    cache.set_max_bytes(Some(one)).unwrap();
    assert_eq!(cache.len(), 1);
    assert!(
        samples[3].replay(&mut cache).is_some(),
        "LRU kept the most recently used"
    );
    // A full cache makes room for the new entry; with room for exactly one, it is the one.
    cache.set_max_entries(1).unwrap();
    samples[0].capture(&mut cache).unwrap();
    assert_eq!(cache.len(), 1);
    assert!(samples[0].replay(&mut cache).is_some());
    cache.set_max_bytes(None).unwrap();
    assert_eq!(cache.config().max_bytes, None);
}

#[derive(Debug, Clone)]
enum Op {
    Capture {
        prompt: u8,
        len: usize,
        layers: u16,
        drift: u8,
    },
    Replay {
        prompt: u8,
        len: usize,
        layers: u16,
    },
    Damage {
        prompt: u8,
        len: usize,
        layers: u16,
        back: usize,
    },
    SetMaxEntries(usize),
    SetMaxBytes(Option<usize>),
    Enable(bool),
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    let slot = || (0u8..6, 1usize..6, 1u16..3);
    prop_oneof![
        6 => (slot(), 0u8..4).prop_map(|((prompt, len, layers), drift)| Op::Capture { prompt, len, layers, drift }),
        4 => slot().prop_map(|(prompt, len, layers)| Op::Replay { prompt, len, layers }),
        2 => (slot(), 0usize..3).prop_map(|((prompt, len, layers), back)| Op::Damage { prompt, len, layers, back }),
        1 => (1usize..6).prop_map(Op::SetMaxEntries),
        1 => proptest::option::of(200usize..2000).prop_map(Op::SetMaxBytes),
        1 => any::<bool>().prop_map(Op::Enable),
        1 => Just(Op::Clear),
    ]
}

fn op_sample(prompt: u8, len: usize, layers: u16, drift: u8) -> Sample {
    let mut s = Sample::with_layout(vec![u32::from(prompt); len], 0, layers, 1, 2);
    s.tail = vec![1.0 + f32::from(drift)];
    s
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_operation_sequences_never_exceed_the_bounds(
        ops in proptest::collection::vec(op(), 1..80),
        policy in 0usize..3,
    ) {
        let policy = EvictionPolicy::ALL[policy];
        let mut cache = AmplituhedronCache::new(CacheConfig {
            max_entries: 3,
            max_prefix_len: 4,
            max_bytes: Some(900),
            policy,
            ..CacheConfig::default()
        }).unwrap();
        for op in ops {
            match op {
                Op::Capture { prompt, len, layers, drift } => {
                    op_sample(prompt, len, layers, drift).capture(&mut cache).unwrap();
                }
                Op::Replay { prompt, len, layers } => {
                    if let Some(v) = op_sample(prompt, len, layers, 0).replay(&mut cache) {
                        prop_assert_eq!(v.tokens(), &vec![u32::from(prompt); len][..]);
                    }
                }
                Op::Damage { prompt, len, layers, back } => {
                    let s = op_sample(prompt, len, layers, 0);
                    let pos = len.saturating_sub(1 + back);
                    match cache.report_damage(&s.key(), pos) {
                        Ok(_) | Err(VolumeError::DamageOutOfRange { .. }) => {}
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::SetMaxEntries(n) => cache.set_max_entries(n).unwrap(),
                Op::SetMaxBytes(b) => cache.set_max_bytes(b).unwrap(),
                Op::Enable(on) => cache.enable(on),
                Op::Clear => cache.clear(),
            }
            let st = cache.stats();
            let cfg = cache.config();
            prop_assert!(st.entries <= cfg.max_entries);
            prop_assert!(cfg.max_bytes.is_none_or(|b| st.bytes <= b));
            let resident = cache.resident();
            prop_assert_eq!(st.entries, resident.len());
            prop_assert_eq!(st.bytes, resident_bytes(&resident));
            let ticks: HashSet<u64> = resident.iter().map(|(_, t)| t.last_used).collect();
            prop_assert_eq!(ticks.len(), resident.len(), "last_used ticks are unique");
        }
    }

    #[test]
    fn the_evicted_entry_is_the_policy_choice(
        drifts in proptest::collection::vec(0u8..4, 2..7),
        touches in proptest::collection::vec(0usize..7, 0..12),
        policy in 0usize..3,
    ) {
        let policy = EvictionPolicy::ALL[policy];
        let n = drifts.len();
        let mut cache = cache_with(n, policy);
        let samples: Vec<Sample> = drifts
            .iter()
            .enumerate()
            .map(|(i, &d)| op_sample(i as u8, 2, 1, d))
            .collect();
        for s in &samples {
            s.capture(&mut cache).unwrap();
        }
        let mut hits = vec![0u32; n];
        for t in touches {
            samples[t % n].replay(&mut cache).unwrap();
            hits[t % n] += 1;
        }
        // Brute force over (drift, last_used, hits) at the tick the next capture will run at.
        let now = cache.tick + 1;
        let resident = cache.resident();
        let state: Vec<(usize, f32, u64)> = samples
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let (v, t) = resident.iter().find(|(v, _)| v.tokens() == &s.tokens[..]).unwrap();
                (i, v.drift(), t.last_used)
            })
            .collect();
        let oldest = |a: &(usize, f32, u64), b: &(usize, f32, u64)| b.2.cmp(&a.2);
        let expected = match policy {
            EvictionPolicy::Lru => state.iter().max_by(|a, b| oldest(a, b)),
            EvictionPolicy::PisotGuard => state.iter().max_by(|a, b| {
                let score = |x: &(usize, f32, u64)| f64::from(x.1) * (now - x.2) as f64;
                score(a).total_cmp(&score(b)).then(oldest(a, b))
            }),
            // Nothing was evicted yet (inflation 0) and every entry has the same size and
            // 2-position, 1-layer prefill: the value per byte orders by hits (each saves its
            // 2 positions again), the fewest first, ties to the oldest.
            EvictionPolicy::CostAware => state.iter().max_by(|a, b| {
                hits[b.0].cmp(&hits[a.0]).then(oldest(a, b))
            }),
        }
        .unwrap()
        .0;
        op_sample(100, 2, 1, 0).capture(&mut cache).unwrap();
        prop_assert_eq!(cache.stats().evictions, 1);
        let resident = cache.resident();
        for (i, s) in samples.iter().enumerate() {
            let kept = resident.iter().any(|(v, _)| v.tokens() == &s.tokens[..]);
            prop_assert_eq!(kept, i != expected, "entry {} (expected victim {})", i, expected);
        }
    }
}

impl AmplituhedronCache {
    /// Every resident volume with what the memory queue knows of it.
    fn resident(&self) -> Vec<(Arc<AmplituhedronVolume>, Tracked)> {
        self.live_ids()
            .filter_map(|e| {
                let r = self.entry(e).resident.as_ref()?;
                Some((
                    Arc::clone(&r.volume),
                    *self.memory.get(&e).expect("tracked"),
                ))
            })
            .collect()
    }
}

/// The memory the resident volumes take, each block counted once: what `stats().bytes`
/// must be.
fn resident_bytes(resident: &[(Arc<AmplituhedronVolume>, Tracked)]) -> usize {
    let mut blocks: HashSet<*const KvBlock> = HashSet::new();
    let mut bytes = 0;
    for (v, _) in resident {
        bytes += entry_bytes(
            0,
            v.tail().map_or(0, <[f32]>::len),
            v.logits().map_or(0, <[f32]>::len),
            v.prefix_len(),
        );
        for b in v.blocks() {
            if blocks.insert(Arc::as_ptr(b)) {
                bytes += b.nbytes();
            }
        }
    }
    bytes
}

// ---- f16 volumes -----------------------------------------------------------------------

/// The f16 bit patterns of `values` (what an f16 ring stores).
fn f16_bits(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| half::f16::from_f32(v).to_bits())
        .collect()
}

/// `bits` widened to f32.
fn widened(bits: &[u16]) -> Vec<f32> {
    bits.iter()
        .map(|&b| half::f16::from_bits(b).to_f32())
        .collect()
}

/// A sample's KV as f16 bit patterns (keys, values).
fn f16_slabs(s: &Sample) -> (Vec<u16>, Vec<u16>) {
    (f16_bits(&s.keys), f16_bits(&s.vals))
}

fn f16_data<'a>(s: &'a Sample, slabs: &'a (Vec<u16>, Vec<u16>)) -> VolumeData<'a> {
    VolumeData {
        kv_keys: KvSlice::F16(&slabs.0),
        kv_vals: KvSlice::F16(&slabs.1),
        ..s.data()
    }
}

#[test]
fn an_f16_volume_stores_half_the_kv_bytes_and_widens_exactly() {
    let s = Sample::new((0..40).collect());
    let slabs = f16_slabs(&s);
    let mut cache = cache_with(4, EvictionPolicy::Lru);
    let ids_tail_logits = 4 * (s.tokens.len() + s.tail.len() + 3);
    let expected = 2 * (slabs.0.len() + slabs.1.len()) + ids_tail_logits;
    assert_eq!(
        expected,
        (s.expected_bytes() - ids_tail_logits) / 2 + ids_tail_logits
    );
    assert_eq!(
        cache.capture(&s.key(), f16_data(&s, &slabs)).unwrap(),
        CaptureOutcome::Stored { bytes: expected }
    );
    assert_eq!(cache.stats().bytes, expected);
    let v = s.replay(&mut cache).unwrap();
    assert_eq!(v.kv_dtype(), KvDtype::F16);
    assert!(v.blocks().iter().all(|b| b.dtype() == KvDtype::F16));
    assert_eq!(v.nbytes(), expected);
    assert_eq!(v.kv_keys(), &widened(&slabs.0)[..]);
    assert_eq!(v.kv_vals(), &widened(&slabs.1)[..]);
    // The blocks hold the bits themselves: replay into an f16 ring copies them.
    let (b0, _) = v.blocks_upto(16).next().unwrap();
    let KvSlice::F16(bits) = b0.keys() else {
        panic!("an f16 block")
    };
    assert_eq!(bits[..4], slabs.0[..4]);
    // Row copies widen too.
    let (mut k, mut vv) = (vec![0.0; 3 * 4], vec![0.0; 3 * 4]);
    v.copy_rows_checked(1, 1, 17..20, &mut k, &mut vv).unwrap();
    let at = SlabShape::from_dims(s.shape).row_offset(1, 1, 17);
    assert_eq!(k, widened(&slabs.0[at..at + 12]));
    assert_eq!(vv, widened(&slabs.1[at..at + 12]));
}

#[test]
fn mixed_kv_dtypes_are_refused_and_change_nothing() {
    let s = Sample::new((0..20).collect());
    let slabs = f16_slabs(&s);
    let mut cache = cache_with(4, EvictionPolicy::Lru);
    let mixed = VolumeData {
        kv_keys: KvSlice::F32(&s.keys),
        kv_vals: KvSlice::F16(&slabs.1),
        ..s.data()
    };
    assert_eq!(
        cache.capture(&s.key(), mixed).unwrap_err(),
        VolumeError::KvDtypeMismatch
    );
    assert_eq!((cache.stats().entries, cache.stats().bytes), (0, 0));
    assert!(s.replay(&mut cache).is_none());
}

#[test]
fn volumes_of_different_kv_dtypes_never_share_a_block() {
    // Same namespace and a shared 20-id prefix: an f16 capture after an f32 one (and the
    // reverse) keeps its own first block, so one volume (and its file) holds one type.
    let shared: Vec<u32> = (0..20).collect();
    let a = Sample::new([shared.clone(), vec![7, 8, 9]].concat());
    let b = Sample::new([shared, vec![30; 17]].concat());
    let b_slabs = f16_slabs(&b);
    let mut cache = cache_with(8, EvictionPolicy::Lru);
    a.capture(&mut cache).unwrap();
    cache.capture(&b.key(), f16_data(&b, &b_slabs)).unwrap();
    let (va, vb) = (a.replay(&mut cache).unwrap(), b.replay(&mut cache).unwrap());
    assert_eq!((va.kv_dtype(), vb.kv_dtype()), (KvDtype::F32, KvDtype::F16));
    assert!(!Arc::ptr_eq(&va.blocks()[0], &vb.blocks()[0]));
    assert!(vb.blocks().iter().all(|blk| blk.dtype() == KvDtype::F16));
    assert_eq!(cache.stats().bytes, resident_bytes(&cache.resident()));
    // Two f16 volumes do share it.
    let mut cache = cache_with(8, EvictionPolicy::Lru);
    let c = Sample::new([(0..20).collect::<Vec<u32>>(), vec![5; 4]].concat());
    let c_slabs = f16_slabs(&c);
    cache.capture(&b.key(), f16_data(&b, &b_slabs)).unwrap();
    cache.capture(&c.key(), f16_data(&c, &c_slabs)).unwrap();
    let (vb, vc) = (b.replay(&mut cache).unwrap(), c.replay(&mut cache).unwrap());
    assert!(Arc::ptr_eq(&vb.blocks()[0], &vc.blocks()[0]));
    assert_eq!(cache.stats().bytes, resident_bytes(&cache.resident()));
}

#[test]
fn non_finite_f16_bits_are_refused_and_injected_faults_are_found() {
    let s = Sample::new((0..40).collect());
    let shape = SlabShape::from_dims(s.shape);
    let mut cache = cache_with(4, EvictionPolicy::Lru);
    for (bad_keys, bits) in [(true, 0x7c00u16), (false, 0xfe00)] {
        let mut slabs = f16_slabs(&s);
        let at = shape.row_offset(1, 0, 21) + 2;
        if bad_keys {
            slabs.0[at] = bits;
        } else {
            slabs.1[at] = bits;
        }
        assert_eq!(
            cache.capture(&s.key(), f16_data(&s, &slabs)).unwrap_err(),
            VolumeError::NonFiniteKv {
                which: if bad_keys { "kv_keys" } else { "kv_vals" },
                layer: 1,
                head: 0,
                position: 21,
            }
        );
    }
    assert_eq!(cache.stats().entries, 0);
    let slabs = f16_slabs(&s);
    cache.capture(&s.key(), f16_data(&s, &slabs)).unwrap();
    assert!(cache.inject_fault(&s.key(), 33).unwrap());
    let v = s.replay(&mut cache).unwrap();
    assert_eq!(v.kv_dtype(), KvDtype::F16);
    assert_eq!(v.first_non_finite_position(), Some(33));
}
