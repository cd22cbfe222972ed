use super::*;
use proptest::prelude::*;

fn enabled(config: MemoConfig) -> MatVecMemo {
    let mut m = MatVecMemo::new(config).unwrap();
    m.enable(true);
    m
}

#[test]
fn off_by_default_and_inert_while_off() {
    let mut m = MatVecMemo::default();
    assert!(!m.is_enabled());
    assert_eq!(
        m.insert(1, &[1.0], &[2.0]).unwrap(),
        MemoInsertOutcome::Disabled
    );
    assert_eq!(m.get(1, &[1.0]), None);
    assert_eq!(m.stats(), MemoStats::default());
}

#[test]
fn exact_match_round_trip_and_stats() {
    let mut m = enabled(MemoConfig::default());
    let x = [0.5f32, -1.0, 3.25];
    let y = [1.0f32, 2.0];
    assert_eq!(m.get(7, &x), None);
    let out = m.insert(7, &x, &y).unwrap();
    assert_eq!(out, MemoInsertOutcome::Stored { bytes: 41 + 8 });
    assert_eq!(out.cached_bytes(), 49);
    assert_eq!(m.get(7, &x), Some(&y[..]));
    // Another weight id, a bit-different x (even -0.0 vs 0.0): misses.
    assert_eq!(m.get(8, &x), None);
    assert_eq!(m.get(7, &[0.5, -1.0, 3.250_000_2]), None);
    assert_eq!(m.get(7, &[0.0]), None);
    m.insert(7, &[0.0], &[1.0]).unwrap();
    assert_eq!(m.get(7, &[-0.0]), None);
    assert_eq!(
        m.insert(7, &x, &y).unwrap(),
        MemoInsertOutcome::AlreadyPresent { bytes: 49 }
    );
    let s = m.stats();
    assert_eq!((s.hits, s.misses, s.entries, s.bytes), (1, 5, 2, 49 + 45));
    m.clear();
    assert_eq!((m.stats().entries, m.stats().bytes), (0, 0));
    assert_eq!(m.get(7, &x), None);
}

#[test]
fn bad_input_is_an_error_that_changes_nothing() {
    let mut m = enabled(MemoConfig::default());
    m.insert(1, &[1.0], &[1.0]).unwrap();
    let before = m.stats();
    let err = m.insert(2, &[1.0], &[0.0, f32::NAN]).unwrap_err();
    assert_eq!(err, MemoError::NonFiniteOutput { index: 1 });
    assert!(err.to_string().contains("index 1"));
    assert_eq!(m.stats(), before);
    assert!(MatVecMemo::new(MemoConfig {
        max_entries: 0,
        ..MemoConfig::default()
    })
    .is_err());
    assert_eq!(
        m.set_max_bytes(Some(0)),
        Err(MemoError::InvalidConfig {
            setting: "max_bytes"
        })
    );
    assert_eq!(m.stats(), before);
}

#[test]
fn too_large_is_skipped_and_limits_evict_at_once() {
    let mut m = enabled(MemoConfig {
        max_entries: 8,
        max_bytes: Some(100),
        policy: EvictionPolicy::Lru,
    });
    assert_eq!(
        m.insert(1, &[1.0], &[0.0; 20]).unwrap(),
        MemoInsertOutcome::SkippedTooLarge {
            bytes: 121,
            max: 100
        }
    );
    for i in 0..4 {
        m.insert(i, &[1.0], &[1.0]).unwrap(); // 45 bytes each: only 2 fit
    }
    assert_eq!(m.stats().entries, 2);
    assert_eq!(m.stats().evictions, 2);
    assert!(m.get(3, &[1.0]).is_some() && m.get(2, &[1.0]).is_some());
    m.set_max_entries(1).unwrap();
    assert_eq!(m.stats().entries, 1);
    assert!(m.get(2, &[1.0]).is_some(), "LRU kept the most recent");
}

#[test]
fn memo_keys_live_in_the_tag_1_space() {
    let k = MatVecMemo::key(3, &[1.0, 2.0]);
    let enc = k.encode();
    assert_eq!(enc[0], crate::keys::MEMO_TAG);
    assert_eq!(enc.len(), MEMO_KEY_BYTES);
}

#[derive(Debug, Clone)]
enum Op {
    Insert {
        w: u64,
        x: u8,
        ylen: usize,
        scale: f32,
    },
    Get {
        w: u64,
        x: u8,
    },
    SetMaxEntries(usize),
    SetMaxBytes(Option<usize>),
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..4, 0u8..8, 1usize..12, 0.0f32..3.0)
            .prop_map(|(w, x, ylen, scale)| Op::Insert { w, x, ylen, scale }),
        4 => (0u64..4, 0u8..8).prop_map(|(w, x)| Op::Get { w, x }),
        1 => (1usize..6).prop_map(Op::SetMaxEntries),
        1 => proptest::option::of(41usize..300).prop_map(Op::SetMaxBytes),
        1 => Just(Op::Clear),
    ]
}

proptest! {
    #[test]
    fn random_sequences_respect_the_bounds(
        ops in proptest::collection::vec(op(), 1..80),
        policy in 0usize..3,
    ) {
        let policy = EvictionPolicy::ALL[policy];
        let mut m = enabled(MemoConfig { max_entries: 3, max_bytes: Some(200), policy });
        for op in ops {
            match op {
                Op::Insert { w, x, ylen, scale } => {
                    let y = vec![scale; ylen];
                    m.insert(w, &[f32::from(x)], &y).unwrap();
                }
                Op::Get { w, x } => {
                    m.get(w, &[f32::from(x)]);
                }
                Op::SetMaxEntries(n) => m.set_max_entries(n).unwrap(),
                Op::SetMaxBytes(b) => m.set_max_bytes(b).unwrap(),
                Op::Clear => m.clear(),
            }
            let s = m.stats();
            let c = m.config();
            prop_assert!(s.entries <= c.max_entries);
            prop_assert!(c.max_bytes.is_none_or(|b| s.bytes <= b));
            prop_assert_eq!(s.entries, m.entries.len());
            prop_assert_eq!(m.queue.len(), m.entries.len());
            prop_assert_eq!(s.bytes, m.entries.values().map(MemoEntry::bytes).sum::<usize>());
        }
    }

    #[test]
    fn the_victim_is_the_policy_choice(
        drifts in proptest::collection::vec(0usize..4, 2..8),
        touches in proptest::collection::vec(0usize..8, 0..10),
        policy in 0usize..3,
    ) {
        let policy = EvictionPolicy::ALL[policy];
        let n = drifts.len();
        let mut m = enabled(MemoConfig { max_entries: n, max_bytes: None, policy });
        // y = [1 + d]: drift exactly d (small integers, so ties happen).
        for (i, &d) in drifts.iter().enumerate() {
            m.insert(i as u64, &[0.0], &[1.0 + d as f32]).unwrap();
        }
        let mut hits = vec![0usize; n];
        for t in touches {
            m.get((t % n) as u64, &[0.0]);
            hits[t % n] += 1;
        }
        let now = m.tick + 1; // the insert below bumps the clock first
        let expected = (0..n as u64)
            .map(|w| {
                let t = m.queue.get(&MatVecMemo::key(w, &[0.0])).unwrap();
                (w, t.drift, t.last_used)
            })
            .max_by(|a, b| {
                let score = |d: f32, t: u64| f64::from(d) * (now - t) as f64;
                match policy {
                    EvictionPolicy::Lru => b.2.cmp(&a.2),
                    EvictionPolicy::PisotGuard => score(a.1, a.2)
                        .total_cmp(&score(b.1, b.2))
                        .then(b.2.cmp(&a.2)),
                    // Equal sizes and costs, nothing evicted yet: fewest hits, then oldest.
                    EvictionPolicy::CostAware => hits[b.0 as usize]
                        .cmp(&hits[a.0 as usize])
                        .then(b.2.cmp(&a.2)),
                }
            })
            .unwrap()
            .0;
        m.insert(99, &[0.0], &[1.0]).unwrap();
        prop_assert_eq!(m.stats().evictions, 1);
        prop_assert!(!m.entries.contains_key(&MatVecMemo::key(expected, &[0.0])));
        prop_assert!(m.entries.contains_key(&MatVecMemo::key(99, &[0.0])));
    }
}
