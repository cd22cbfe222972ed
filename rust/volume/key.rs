//! How a volume is addressed: [`VolumeKey`] and the digest identity a probe computes.

use super::VolumeError;
use crate::keys::{digest_prefix_u64, prefix_digest, salted_prefix_digest, tenant_key, CacheKey};

/// Everything that addresses a volume: model, prefix tokens, layer range, tenant salt.
#[derive(Debug, Clone, Copy)]
pub struct VolumeKey<'a> {
    /// Hash of the model's content (weights + config).
    pub model_fingerprint: u64,
    /// The prefix token ids (`prefix_len` of them).
    pub tokens: &'a [u32],
    /// First layer of the station's range.
    pub layer_lo: u16,
    /// One past its last layer.
    pub layer_hi: u16,
    /// Optional tenant salt; salted and unsalted (or differently salted) keys never meet.
    pub salt: Option<&'a str>,
}

impl VolumeKey<'_> {
    /// Checks the key on its own: a non-empty prefix and a non-empty layer range.
    pub fn validate(&self) -> Result<(), VolumeError> {
        if self.tokens.is_empty() {
            return Err(VolumeError::EmptyPrefix);
        }
        if self.layer_lo >= self.layer_hi {
            return Err(VolumeError::EmptyLayerRange {
                layer_lo: self.layer_lo,
                layer_hi: self.layer_hi,
            });
        }
        Ok(())
    }

    /// The lookup hash: the wire `prefix_hash` without a salt, else the first 8 bytes of the
    /// BLAKE3 digest keyed by `BLAKE3(salt)`.
    pub fn lookup_hash(&self) -> u64 {
        PrefixIdentity::of(self).lookup_hash
    }

    /// This key in the tagged key space shared with the matvec memo.
    pub fn cache_key(&self) -> CacheKey {
        CacheKey::Volume {
            model_fingerprint: self.model_fingerprint,
            prefix_hash: self.lookup_hash(),
            layer_lo: self.layer_lo,
            layer_hi: self.layer_hi,
        }
    }
}

/// How a probe identifies a prefix: the digest (keyed when salted) and its u64 prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PrefixIdentity {
    pub(super) digest: [u8; 32],
    pub(super) lookup_hash: u64,
    pub(super) salt_key: Option<[u8; 32]>,
}

impl PrefixIdentity {
    pub(super) fn of(key: &VolumeKey<'_>) -> Self {
        let salt_key = key.salt.map(tenant_key);
        let digest = tenant_digest(key.tokens, salt_key.as_ref());
        PrefixIdentity {
            digest,
            lookup_hash: digest_prefix_u64(&digest),
            salt_key,
        }
    }
}

/// Everything but the token ids that must agree for two volumes to be interchangeable: the
/// model, the layer range and the tenant. Prefixes are indexed, and KV blocks shared, only
/// within one namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Namespace {
    pub(super) fingerprint: u64,
    pub(super) layer_lo: u16,
    pub(super) layer_hi: u16,
    pub(super) salt_key: Option<[u8; 32]>,
}

impl Namespace {
    pub(super) fn of(key: &VolumeKey<'_>, id: &PrefixIdentity) -> Self {
        Namespace {
            fingerprint: key.model_fingerprint,
            layer_lo: key.layer_lo,
            layer_hi: key.layer_hi,
            salt_key: id.salt_key,
        }
    }

    /// Layers in the range.
    pub(super) fn layers(&self) -> usize {
        usize::from(self.layer_hi - self.layer_lo)
    }

    /// The digest of `tokens` under this namespace's tenant key (what [`PrefixIdentity`]
    /// computes for a probe), to check ids read back from a file.
    pub(super) fn digest_of(&self, tokens: &[u32]) -> [u8; 32] {
        tenant_digest(tokens, self.salt_key.as_ref())
    }
}

/// BLAKE3 of the ids, keyed by the tenant key when there is one.
fn tenant_digest(tokens: &[u32], tenant_key: Option<&[u8; 32]>) -> [u8; 32] {
    match tenant_key {
        Some(k) => salted_prefix_digest(tokens, k),
        None => prefix_digest(tokens),
    }
}
