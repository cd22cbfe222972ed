//! Cache keys: the BLAKE3 prefix hash and the tagged key spaces of the two caches.
//!
//! Every serialised key starts with a tag byte, so the matvec-memo keys ("death #1") and the
//! volume keys ("death #2") can never collide even if they shared one byte-keyed map — the
//! Lean theorem `death1_death2_keys_disjoint` is only meaningful because the tag comes first.

/// Tag byte of every MatVecMemo key (Lean `keyTag (.death1 _) = 1`).
pub const MEMO_TAG: u8 = 1;
/// Tag byte of every volume-cache key (Lean `keyTag (.death2 _ _ _ _) = 2`).
pub const VOLUME_TAG: u8 = 2;

/// Full 32-byte BLAKE3 digest of the token ids, each as a little-endian `u32`.
pub fn prefix_digest(tokens: &[u32]) -> [u8; 32] {
    digest_tokens(blake3::Hasher::new(), tokens)
}

/// The 32-byte BLAKE3 key of a tenant: `BLAKE3(salt bytes)`.
pub fn tenant_key(salt: &str) -> [u8; 32] {
    *blake3::hash(salt.as_bytes()).as_bytes()
}

/// Keyed BLAKE3 (keyed by [`tenant_key`]) over the token ids as little-endian `u32`s.
///
/// A tenant's lookup hash is the first 8 bytes of this digest: without the key nobody can
/// compute it, so one tenant cannot probe whether another tenant's prefix is cached.
pub fn salted_prefix_digest(tokens: &[u32], tenant_key: &[u8; 32]) -> [u8; 32] {
    digest_tokens(blake3::Hasher::new_keyed(tenant_key), tokens)
}

/// BLAKE3 of an `f32` vector's little-endian bytes (the matvec memo's input key).
pub fn f32_digest(x: &[f32]) -> [u8; 32] {
    digest_le_words(blake3::Hasher::new(), x, f32::to_le_bytes)
}

fn digest_tokens(hasher: blake3::Hasher, tokens: &[u32]) -> [u8; 32] {
    digest_le_words(hasher, tokens, u32::to_le_bytes)
}

/// Feeds 4-byte words to `hasher` as one LE byte stream, in stack-buffered chunks: large
/// `update` calls let BLAKE3 use its SIMD path (per-word updates do not).
fn digest_le_words<T: Copy>(
    mut hasher: blake3::Hasher,
    words: &[T],
    le_bytes: impl Fn(T) -> [u8; 4],
) -> [u8; 32] {
    const CHUNK: usize = 1024;
    let mut buf = [0u8; CHUNK * 4];
    for chunk in words.chunks(CHUNK) {
        for (dst, &w) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&le_bytes(w));
        }
        hasher.update(&buf[..chunk.len() * 4]);
    }
    *hasher.finalize().as_bytes()
}

/// A key of either cache, in the disjoint tagged key space (Lean `CacheKey`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CacheKey {
    /// MatVecMemo key ("death #1"): weight id and the BLAKE3 digest of `x`.
    Memo {
        /// Caller-chosen id of the weight matrix `W`.
        weight_id: u64,
        /// [`f32_digest`] of the input vector `x`.
        input_digest: [u8; 32],
    },
    /// Volume-cache key ("death #2").
    Volume {
        /// Hash of the model's content.
        model_fingerprint: u64,
        /// Lookup hash of the prefix (the wire `prefix_hash`, or the salted one).
        prefix_hash: u64,
        /// First layer of the station's range.
        layer_lo: u16,
        /// One past the last layer of the range.
        layer_hi: u16,
    },
}

impl CacheKey {
    /// The leading tag byte: [`MEMO_TAG`] or [`VOLUME_TAG`].
    pub fn tag(&self) -> u8 {
        match self {
            CacheKey::Memo { .. } => MEMO_TAG,
            CacheKey::Volume { .. } => VOLUME_TAG,
        }
    }

    /// Serialised key: the tag byte, then every field little-endian in declaration order
    /// (memo: 1 + 8 + 32 = 41 bytes; volume: 1 + 8 + 8 + 2 + 2 = 21 bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![self.tag()];
        match self {
            CacheKey::Memo {
                weight_id,
                input_digest,
            } => {
                out.extend_from_slice(&weight_id.to_le_bytes());
                out.extend_from_slice(input_digest);
            }
            CacheKey::Volume {
                model_fingerprint,
                prefix_hash,
                layer_lo,
                layer_hi,
            } => {
                out.extend_from_slice(&model_fingerprint.to_le_bytes());
                out.extend_from_slice(&prefix_hash.to_le_bytes());
                out.extend_from_slice(&layer_lo.to_le_bytes());
                out.extend_from_slice(&layer_hi.to_le_bytes());
            }
        }
        out
    }
}

/// The wire `prefix_hash`: the first 8 bytes (little-endian `u64`) of [`prefix_digest`].
pub fn prefix_hash(tokens: &[u32]) -> u64 {
    digest_prefix_u64(&prefix_digest(tokens))
}

/// First 8 bytes of a digest as a little-endian `u64`.
pub fn digest_prefix_u64(digest: &[u8; 32]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first)
}

#[cfg(test)]
mod tests {
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
}
