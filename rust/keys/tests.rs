use super::*;

#[test]
fn hash_is_the_le_prefix_of_blake3_over_le_u32_ids() {
    let tokens = [1u32, 2, 0xdead_beef];
    let mut bytes = Vec::new();
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    let expected = blake3::hash(&bytes);
    assert_eq!(prefix_digest(&tokens), *expected.as_bytes());
    let first8: [u8; 8] = expected.as_bytes()[..8].try_into().unwrap();
    assert_eq!(prefix_hash(&tokens), u64::from_le_bytes(first8));
}

#[test]
fn tags_differ() {
    assert_ne!(MEMO_TAG, VOLUME_TAG);
}

#[test]
fn chunked_digest_equals_one_shot_blake3_for_long_inputs() {
    let tokens: Vec<u32> = (0..5000u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    assert_eq!(prefix_digest(&tokens), *blake3::hash(&bytes).as_bytes());
    let key = tenant_key("tenant-a");
    assert_eq!(key, *blake3::hash(b"tenant-a").as_bytes());
    assert_eq!(
        salted_prefix_digest(&tokens, &key),
        *blake3::keyed_hash(&key, &bytes).as_bytes()
    );
    let x: Vec<f32> = (0..3000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(f32_digest(&x), *blake3::hash(&xb).as_bytes());
}

#[test]
fn salts_separate_digests() {
    let t = [5u32, 6, 7];
    let plain = prefix_digest(&t);
    let a = salted_prefix_digest(&t, &tenant_key("a"));
    let b = salted_prefix_digest(&t, &tenant_key("b"));
    let empty = salted_prefix_digest(&t, &tenant_key(""));
    assert_ne!(plain, a);
    assert_ne!(a, b);
    assert_ne!(plain, empty);
}

#[test]
fn encodings_match_the_lean_layout() {
    // Lean death1_encoding_oracle [1, 42] / death2_encoding_oracle [2, 7, 42, 0, 32],
    // with each field little-endian at its Rust width.
    let memo = CacheKey::Memo {
        weight_id: 42,
        input_digest: [9; 32],
    }
    .encode();
    assert_eq!(memo.len(), 41);
    assert_eq!(memo[0], 1);
    assert_eq!(&memo[1..9], &42u64.to_le_bytes());
    assert_eq!(&memo[9..], &[9u8; 32]);
    let vol = CacheKey::Volume {
        model_fingerprint: 7,
        prefix_hash: 42,
        layer_lo: 0,
        layer_hi: 32,
    }
    .encode();
    let mut want = vec![2u8];
    want.extend_from_slice(&7u64.to_le_bytes());
    want.extend_from_slice(&42u64.to_le_bytes());
    want.extend_from_slice(&0u16.to_le_bytes());
    want.extend_from_slice(&32u16.to_le_bytes());
    assert_eq!(vol, want);
}

proptest::proptest! {
    #[test]
    fn memo_and_volume_encodings_never_coincide(
        weight_id: u64,
        digest: [u8; 32],
        fp: u64,
        ph: u64,
        lo: u16,
        hi: u16,
    ) {
        let m = CacheKey::Memo { weight_id, input_digest: digest };
        let v = CacheKey::Volume { model_fingerprint: fp, prefix_hash: ph, layer_lo: lo, layer_hi: hi };
        proptest::prop_assert_eq!(m.encode()[0], MEMO_TAG);
        proptest::prop_assert_eq!(v.encode()[0], VOLUME_TAG);
        proptest::prop_assert_ne!(m.encode(), v.encode());
    }
}
