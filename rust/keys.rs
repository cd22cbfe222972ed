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
    let mut hasher = blake3::Hasher::new();
    for t in tokens {
        hasher.update(&t.to_le_bytes());
    }
    *hasher.finalize().as_bytes()
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
}
