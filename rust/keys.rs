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
mod tests;
