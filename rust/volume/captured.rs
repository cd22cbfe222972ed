//! One cached prefix volume.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use super::data::entry_bytes;
use super::key::PrefixIdentity;
use super::slab::{copy_all_finite, first_damaged_row, first_non_finite, SlabShape};
use super::{VolumeError, VolumeKey};

/// One cached prefix volume. Immutable once built; shared as `Arc` with callers (the
/// Python views borrow its slabs zero-copy). Erasure replaces the cache's `Arc` with a
/// trimmed copy that shares the slabs, so a caller's handle never changes under it.
pub struct AmplituhedronVolume {
    pub(super) model_fingerprint: u64,
    pub(super) lookup_hash: u64,
    pub(super) digest: [u8; 32],
    pub(super) salt_key: Option<[u8; 32]>,
    pub(super) tokens: Vec<u32>,
    pub(super) layer_lo: u16,
    pub(super) layer_hi: u16,
    /// `positions` is `prefix_len`, the stride of the slabs.
    pub(super) shape: SlabShape,
    /// Positions the slabs cover: `prefix_len`, or `prefix_len − 1` after an erasure.
    pub(super) kv_len: usize,
    pub(super) tail: Option<Vec<f32>>,
    pub(super) logits: Option<Vec<f32>>,
    pub(super) kv_keys: Arc<Vec<f32>>,
    pub(super) kv_vals: Arc<Vec<f32>>,
    pub(super) drift: f32,
}

impl AmplituhedronVolume {
    /// Model fingerprint the volume was captured under.
    pub fn model_fingerprint(&self) -> u64 {
        self.model_fingerprint
    }

    /// Lookup hash: the wire `prefix_hash` if unsalted, the tenant-keyed one if salted.
    pub fn prefix_hash(&self) -> u64 {
        self.lookup_hash
    }

    /// Full 32-byte BLAKE3 digest of the tokens (keyed by the tenant key when salted).
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// Whether the volume belongs to a salted tenant.
    pub fn is_salted(&self) -> bool {
        self.salt_key.is_some()
    }

    /// The prefix token ids.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// First layer of the range.
    pub fn layer_lo(&self) -> u16 {
        self.layer_lo
    }

    /// One past the last layer of the range.
    pub fn layer_hi(&self) -> u16 {
        self.layer_hi
    }

    /// Number of tokens in the prefix.
    pub fn prefix_len(&self) -> usize {
        self.tokens.len()
    }

    /// Positions the slabs cover (`prefix_len`, or `prefix_len − 1` after an erasure).
    pub fn kv_len(&self) -> usize {
        self.kv_len
    }

    /// Whether the trailing position was erased.
    pub fn is_erased(&self) -> bool {
        self.kv_len < self.prefix_len()
    }

    /// KV heads per layer.
    pub fn kv_heads(&self) -> usize {
        self.shape.kv_heads
    }

    /// Floats per row.
    pub fn head_dim(&self) -> usize {
        self.shape.head_dim
    }

    /// Storage layout of the slabs: `positions` is `prefix_len` (the row stride) even after
    /// an erasure; only the first [`kv_len`](Self::kv_len) positions are valid.
    pub fn slab_shape(&self) -> SlabShape {
        self.shape
    }

    /// Tail residual; `None` after an erasure (it described the erased position).
    pub fn tail(&self) -> Option<&[f32]> {
        self.tail.as_deref()
    }

    /// Exit-station logits, if captured and not erased.
    pub fn logits(&self) -> Option<&[f32]> {
        self.logits.as_deref()
    }

    /// The whole key slab in [`slab_shape`](Self::slab_shape) layout.
    pub fn kv_keys(&self) -> &[f32] {
        &self.kv_keys
    }

    /// The whole value slab in [`slab_shape`](Self::slab_shape) layout.
    pub fn kv_vals(&self) -> &[f32] {
        &self.kv_vals
    }

    /// Pisot drift of the tail at capture.
    pub fn drift(&self) -> f32 {
        self.drift
    }

    /// Byte size counted against `max_bytes` (formula in the module docs).
    pub fn nbytes(&self) -> usize {
        entry_bytes(
            self.kv_keys.len() + self.kv_vals.len(),
            self.tail.as_ref().map_or(0, Vec::len),
            self.logits.as_ref().map_or(0, Vec::len),
            self.tokens.len(),
        )
    }

    /// Smallest covered position at which any layer/head row of either slab is non-finite.
    pub fn first_non_finite_position(&self) -> Option<usize> {
        let keys = first_damaged_row(self.shape, self.kv_len, &self.kv_keys).map(|r| r.2);
        let limit = keys.unwrap_or(self.kv_len);
        let vals = first_damaged_row(self.shape, limit, &self.kv_vals).map(|r| r.2);
        vals.or(keys)
    }

    /// Copies the key and value rows `(layer, head, positions)` into `dst_keys` / `dst_vals`
    /// (each `positions.len() × head_dim` floats), checking finiteness as it copies.
    ///
    /// `layer` is absolute (in `[layer_lo, layer_hi)`); positions must lie in `[0, kv_len)`.
    /// On [`VolumeError::NonFiniteKv`] the destinations hold partial data and the runtime
    /// should report the damage ([`AmplituhedronCache::report_damage`]).
    pub fn copy_rows_checked(
        &self,
        layer: usize,
        head: usize,
        positions: Range<usize>,
        dst_keys: &mut [f32],
        dst_vals: &mut [f32],
    ) -> Result<(), VolumeError> {
        let out_of_range = || VolumeError::RowsOutOfRange {
            layer,
            head,
            positions: positions.clone(),
        };
        let local = layer
            .checked_sub(usize::from(self.layer_lo))
            .filter(|&l| l < self.shape.layers)
            .ok_or_else(out_of_range)?;
        if head >= self.shape.kv_heads
            || positions.start > positions.end
            || positions.end > self.kv_len
        {
            return Err(out_of_range());
        }
        let n = positions.len() * self.shape.head_dim;
        for dst in [&*dst_keys, &*dst_vals] {
            if dst.len() != n {
                return Err(VolumeError::DestinationLength {
                    expected: n,
                    actual: dst.len(),
                });
            }
        }
        let start = self.shape.row_offset(local, head, positions.start);
        for (which, src, dst) in [
            ("kv_keys", &self.kv_keys, &mut *dst_keys),
            ("kv_vals", &self.kv_vals, &mut *dst_vals),
        ] {
            let src = &src[start..start + n];
            if !copy_all_finite(src, dst) {
                let bad = first_non_finite(src).expect("a non-finite value exists");
                return Err(VolumeError::NonFiniteKv {
                    which,
                    layer,
                    head,
                    position: positions.start + bad / self.shape.head_dim,
                });
            }
        }
        Ok(())
    }

    pub(super) fn matches(&self, key: &VolumeKey<'_>, id: &PrefixIdentity) -> bool {
        self.lookup_hash == id.lookup_hash
            && self.model_fingerprint == key.model_fingerprint
            && self.layer_lo == key.layer_lo
            && self.layer_hi == key.layer_hi
            && self.salt_key == id.salt_key
            && self.digest == id.digest
            && self.tokens == key.tokens
    }

    /// The same slot as `key` (lookup hash and layer range) — a match or a drift.
    pub(super) fn same_slot(&self, key: &VolumeKey<'_>, id: &PrefixIdentity) -> bool {
        self.lookup_hash == id.lookup_hash
            && self.layer_lo == key.layer_lo
            && self.layer_hi == key.layer_hi
    }

    /// A copy with the trailing position erased (its tail and logits described the erased
    /// position, so they go); the slabs are shared, not copied.
    pub(super) fn trimmed(&self) -> Self {
        AmplituhedronVolume {
            model_fingerprint: self.model_fingerprint,
            lookup_hash: self.lookup_hash,
            digest: self.digest,
            salt_key: self.salt_key,
            tokens: self.tokens.clone(),
            layer_lo: self.layer_lo,
            layer_hi: self.layer_hi,
            shape: self.shape,
            kv_len: self.kv_len - 1,
            tail: None,
            logits: None,
            kv_keys: Arc::clone(&self.kv_keys),
            kv_vals: Arc::clone(&self.kv_vals),
            drift: self.drift,
        }
    }
}

impl fmt::Debug for AmplituhedronVolume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Metadata only: the slabs are megabytes.
        f.debug_struct("AmplituhedronVolume")
            .field("model_fingerprint", &self.model_fingerprint)
            .field("prefix_hash", &self.lookup_hash)
            .field("salted", &self.salt_key.is_some())
            .field("layers", &(self.layer_lo..self.layer_hi))
            .field("prefix_len", &self.tokens.len())
            .field("kv_len", &self.kv_len)
            .field("kv_heads", &self.shape.kv_heads)
            .field("head_dim", &self.shape.head_dim)
            .field("drift", &self.drift)
            .field("nbytes", &self.nbytes())
            .finish_non_exhaustive()
    }
}
