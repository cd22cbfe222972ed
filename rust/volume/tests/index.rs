//! The prefix index and shared blocks: longest-prefix lookup against a brute-force scan,
//! blocks held once, exact byte accounting, pruning, and correctness at scale.

use super::*;
use crate::ring::KvDtype;

/// `Sample` with one layer, one head and head_dim 2 (tiny KV, many positions).
fn small(tokens: Vec<u32>) -> Sample {
    Sample::with_layout(tokens, 0, 1, 1, 2)
}

fn big_cache(policy: EvictionPolicy) -> AmplituhedronCache {
    AmplituhedronCache::new(CacheConfig {
        max_entries: 1 << 20,
        max_prefix_len: 1 << 12,
        policy,
        ..CacheConfig::default()
    })
    .unwrap()
}

/// Ids `a` and `b` agree on from the start.
fn shared_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// What longest-prefix replay must reuse for `probe`: the best `min(shared, kv_len, len − 1)`
/// over the resident volumes.
fn brute_force_reuse(cache: &AmplituhedronCache, probe: &[u32]) -> usize {
    cache
        .resident()
        .iter()
        .map(|(v, _)| {
            shared_len(v.tokens(), probe)
                .min(v.kv_len())
                .min(probe.len() - 1)
        })
        .max()
        .unwrap_or(0)
}

#[test]
fn volumes_sharing_a_prefix_share_its_full_blocks_and_count_them_once() {
    let mut cache = cache_with(8, EvictionPolicy::Lru);
    let system: Vec<u32> = (0..40).collect();
    let a = Sample::new([system.clone(), vec![100, 101, 102]].concat());
    let b = Sample::new([system.clone(), vec![200; 30]].concat());
    a.capture(&mut cache).unwrap();
    b.capture(&mut cache).unwrap();
    let (va, vb) = (a.replay(&mut cache).unwrap(), b.replay(&mut cache).unwrap());
    a.assert_is(&va);
    b.assert_is(&vb);
    // 40 shared ids: blocks 0 and 1 (positions 0..32) are one allocation, block 2 is not.
    assert!(Arc::ptr_eq(&va.blocks()[0], &vb.blocks()[0]));
    assert!(Arc::ptr_eq(&va.blocks()[1], &vb.blocks()[1]));
    assert!(!Arc::ptr_eq(&va.blocks()[2], &vb.blocks()[2]));
    let block = va.blocks()[0].nbytes();
    assert_eq!(block, 4 * 2 * 2 * 2 * BLOCK_POSITIONS * 4);
    let both = a.expected_bytes() + b.expected_bytes();
    assert_eq!(cache.stats().bytes, both - 2 * block);
    assert_eq!(cache.stats().bytes, resident_bytes(&cache.resident()));
    // Evicting A keeps the blocks B still uses; evicting both frees everything.
    cache.set_max_entries(1).unwrap();
    assert!(a.replay(&mut cache).is_none());
    b.assert_is(&b.replay(&mut cache).unwrap());
    assert_eq!(cache.stats().bytes, b.expected_bytes());
    // A third prompt over the same system prompt shares B's blocks again.
    cache.set_max_entries(8).unwrap();
    let c = Sample::new([system, vec![7; 5]].concat());
    c.capture(&mut cache).unwrap();
    let vc = c.replay(&mut cache).unwrap();
    c.assert_is(&vc);
    assert!(Arc::ptr_eq(&vc.blocks()[1], &vb.blocks()[1]));
    assert_eq!(
        cache.stats().bytes,
        b.expected_bytes() + c.expected_bytes() - 2 * block
    );
    cache.clear();
    assert_eq!((cache.stats().bytes, cache.index.live_nodes()), (0, 0));
}

#[test]
fn a_cached_block_does_not_excuse_bad_input() {
    let mut cache = cache_with(8, EvictionPolicy::Lru);
    let resident = Sample::new((0..40).collect());
    resident.capture(&mut cache).unwrap();
    // Same first 32 ids (two cached blocks), a NaN inside them: refused, nothing changes.
    let mut bad = Sample::new([(0..32).collect::<Vec<u32>>(), vec![9; 4]].concat());
    let row = bad.shape[2] * bad.shape[3]; // floats per (layer, head) row run
    bad.keys[row + 5 * 4] = f32::NAN; // layer 0, head 1, position 5
    let before = cache.stats();
    assert_eq!(
        bad.capture(&mut cache).unwrap_err(),
        VolumeError::NonFiniteKv {
            which: "kv_keys",
            layer: 0,
            head: 1,
            position: 5
        }
    );
    assert_eq!(cache.stats(), before);
    resident.assert_is(&resident.replay(&mut cache).unwrap());
}

#[test]
fn replaying_through_blocks_gives_back_every_row() {
    let mut cache = AmplituhedronCache::default();
    let s = Sample::with_layout((0..37).collect(), 2, 5, 3, 4);
    s.capture(&mut cache).unwrap();
    let v = s.replay(&mut cache).unwrap();
    // blocks_upto covers exactly the asked positions, in order, block by block.
    for kv_len in [1usize, 16, 17, 36, 37] {
        let pieces: Vec<usize> = v.blocks_upto(kv_len).map(|(_, n)| n).collect();
        assert_eq!(pieces.iter().sum::<usize>(), kv_len);
        assert!(pieces.iter().all(|&n| n <= BLOCK_POSITIONS));
    }
    let shape = v.slab_shape();
    let mut start = 0;
    for (block, n) in v.blocks_upto(37) {
        for layer in 0..shape.layers {
            for head in 0..shape.kv_heads {
                let run = n * shape.head_dim;
                let at = (layer * shape.kv_heads + head) * block.positions() * shape.head_dim;
                let src = shape.row_offset(layer, head, start);
                assert_eq!(
                    block.keys().slice(at..at + run).to_f32(),
                    s.keys[src..src + run]
                );
                assert_eq!(
                    block.vals().slice(at..at + run).to_f32(),
                    s.vals[src..src + run]
                );
            }
        }
        start += n;
    }
}

#[derive(Debug, Clone)]
enum IndexOp {
    Capture(Vec<u32>),
    Damage(Vec<u32>, usize),
    Probe(Vec<u32>),
    MaxEntries(usize),
}

/// Ids from a 3-letter alphabet, so prompts share prefixes of every length, across block
/// boundaries.
fn ids() -> impl Strategy<Value = Vec<u32>> {
    proptest::collection::vec(0u32..3, 1..60)
}

fn index_op() -> impl Strategy<Value = IndexOp> {
    prop_oneof![
        5 => ids().prop_map(IndexOp::Capture),
        1 => (ids(), 0usize..3).prop_map(|(t, back)| IndexOp::Damage(t, back)),
        6 => ids().prop_map(IndexOp::Probe),
        1 => (1usize..12).prop_map(IndexOp::MaxEntries),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn longest_prefix_reuse_equals_a_brute_force_scan(
        ops in proptest::collection::vec(index_op(), 1..120),
        policy in 0usize..3,
    ) {
        let mut cache = big_cache(EvictionPolicy::ALL[policy]);
        for op in ops {
            match op {
                IndexOp::Capture(t) => {
                    small(t).capture(&mut cache).unwrap();
                }
                IndexOp::Damage(t, back) => {
                    let pos = t.len().saturating_sub(1 + back);
                    let _ = cache.report_damage(&small(t).key(), pos);
                }
                IndexOp::Probe(t) => {
                    let want = brute_force_reuse(&cache, &t);
                    match cache.replay_longest_prefix(&small(t.clone()).key(), 1).unwrap() {
                        Some((v, usable)) => {
                            prop_assert_eq!(usable, want);
                            prop_assert!(shared_len(v.tokens(), &t) >= usable);
                            prop_assert!(v.kv_len() >= usable);
                        }
                        None => prop_assert_eq!(want, 0),
                    }
                }
                IndexOp::MaxEntries(n) => cache.set_max_entries(n).unwrap(),
            }
            prop_assert_eq!(cache.stats().bytes, resident_bytes(&cache.resident()));
        }
        cache.clear();
        prop_assert_eq!(cache.index.live_nodes(), 0);
        prop_assert_eq!(cache.stats().bytes, 0);
    }
}

#[test]
fn twenty_thousand_entries_answer_exactly_with_zero_false_hits() {
    // 16 system prompts of 24 ids, then 8 ids unique to each prompt.
    let prompt = |i: u32| -> Vec<u32> {
        let system = (0..24).map(|t| (i % 16) * 100 + t);
        system.chain((0..8).map(|t| 10_000 + i * 8 + t)).collect()
    };
    let n = 20_000u32;
    let mut cache = big_cache(EvictionPolicy::CostAware);
    for i in 0..n {
        assert!(matches!(
            small(prompt(i)).capture(&mut cache).unwrap(),
            CaptureOutcome::Stored { .. }
        ));
    }
    assert_eq!(cache.len(), n as usize);
    for i in (0..n).step_by(97) {
        let s = small(prompt(i));
        s.assert_is(&s.replay(&mut cache).unwrap());
        // Same system prompt and first 4 unique ids, then a new tail: 28 ids shared.
        let mut near = prompt(i);
        near[28..].iter_mut().for_each(|t| *t = 900_000);
        let k = small(near.clone());
        assert!(k.replay(&mut cache).is_none(), "false hit for {near:?}");
        let (v, usable) = cache.replay_longest_prefix(&k.key(), 16).unwrap().unwrap();
        assert_eq!((usable, &v.tokens()[..28]), (28, &near[..28]));
        // Only the system prompt in common (24 ids).
        let mut stranger = near.clone();
        stranger[24..].iter_mut().for_each(|t| *t = 800_000);
        let (_, usable) = cache
            .replay_longest_prefix(&small(stranger).key(), 16)
            .unwrap()
            .unwrap();
        assert_eq!(usable, 24);
    }
    assert!(cache
        .replay_longest_prefix(&small(vec![5_000_000; 30]).key(), 1)
        .unwrap()
        .is_none());
    let st = cache.stats();
    assert_eq!(st.hits, u64::from(n.div_ceil(97)));
    assert_eq!(st.bytes, resident_bytes(&cache.resident()));
}

#[test]
fn a_ring_filled_from_blocks_equals_one_filled_from_the_whole_slab() {
    use crate::model::testing::tiny_config;
    use crate::model::{SequenceKv, SessionConfig};
    use crate::ring::SpanType;

    let c = tiny_config();
    let (layers, heads, head_dim) = (c.n_layers, c.n_kv_heads, c.head_dim());
    // A small window (64 slots, 8 recall) that 150 positions wrap, pieces of 24 rows.
    let cfg = SessionConfig {
        slots: 64,
        recall: 8,
        n_sys: 4,
        max_chunk: 24,
    };
    let s = Sample::with_layout((0..150).collect(), 0, layers as u16, heads, head_dim);
    let mut cache = AmplituhedronCache::default();
    cache.set_max_prefix_len(1000).unwrap();
    s.capture(&mut cache).unwrap();
    let v = s.replay(&mut cache).unwrap();
    let blocks: Vec<_> = v.blocks().iter().map(|b| (b.keys(), b.vals())).collect();
    for kv_len in [1, 16, 17, 100, 150] {
        let mut from_blocks = SequenceKv::new(&c, 0, layers, &cfg, KvDtype::default()).unwrap();
        let mut from_slab = SequenceKv::new(&c, 0, layers, &cfg, KvDtype::default()).unwrap();
        from_blocks
            .append_blocks(&blocks, BLOCK_POSITIONS, kv_len, SpanType::User)
            .unwrap();
        from_slab
            .append_volume(&s.keys, &s.vals, 150, kv_len, SpanType::User)
            .unwrap();
        let (a, b) = (from_blocks.rings().layer(0).0, from_slab.rings().layer(0).0);
        assert_eq!(a.clock(), b.clock());
        assert_eq!(a.active_slots(), b.active_slots());
        assert_eq!(a.spans().collect::<Vec<_>>(), b.spans().collect::<Vec<_>>());
        // The anchor positions are resident whatever wrapped: their rows are the same.
        let m = kv_len.min(4);
        let read = |ring: &crate::ring::DynamicRingBuffer| {
            let mut keys = vec![0.0; layers * heads * m * head_dim];
            let mut vals = keys.clone();
            ring.read_logical(0, layers, m, &mut keys, &mut vals)
                .unwrap();
            (keys, vals)
        };
        assert_eq!(read(a), read(b));
    }
    // Blocks that do not fit the volume's shape are refused, and the ring stays as it was.
    let mut kv = SequenceKv::new(&c, 0, layers, &cfg, KvDtype::default()).unwrap();
    let (k0, v0) = blocks[0];
    let short = [(k0.slice(1..k0.len()), v0.slice(1..v0.len()))];
    assert!(kv
        .append_blocks(&short, BLOCK_POSITIONS, 4, SpanType::User)
        .is_err());
    assert!(kv
        .append_blocks(&blocks, BLOCK_POSITIONS, 151, SpanType::User)
        .is_err());
    assert_eq!(kv.clock(), 0);
}
