//! Incoming capture data, its validation and its split into KV blocks.

use std::sync::Arc;

use super::block::{block_spans, KvBlock};
use super::slab::{all_finite, first_damaged_row, first_non_finite, with_elems, KvElem, SlabShape};
use super::{VolumeError, VolumeKey};
use crate::ring::KvSlice;

/// Borrowed volume data for [`AmplituhedronCache::capture`](super::AmplituhedronCache::capture)
/// (copied once into the cache's blocks).
#[derive(Debug, Clone, Copy)]
pub struct VolumeData<'a> {
    /// `[layer_hi − layer_lo, kv_heads, prefix_len, head_dim]` of both slabs.
    pub kv_shape: [usize; 4],
    /// Hidden state emitted for the last prefix position (`hidden_dim` floats).
    pub tail: &'a [f32],
    /// Key slab, row-major in `kv_shape`: f32, or f16 bit patterns (the volume then stores
    /// f16, half the bytes).
    pub kv_keys: KvSlice<'a>,
    /// Value slab, row-major in `kv_shape`, of the keys' type.
    pub kv_vals: KvSlice<'a>,
    /// The exit station's logits for the last prefix position.
    pub logits: Option<&'a [f32]>,
}

/// Owned volume data for
/// [`AmplituhedronCache::capture_owned`](super::AmplituhedronCache::capture_owned), for callers
/// that gathered their slabs into buffers of their own.
#[derive(Debug, Clone)]
pub struct OwnedVolumeData {
    /// `[layer_hi − layer_lo, kv_heads, prefix_len, head_dim]` of both slabs.
    pub kv_shape: [usize; 4],
    /// Hidden state emitted for the last prefix position (`hidden_dim` floats).
    pub tail: Vec<f32>,
    /// Key slab, row-major in `kv_shape`.
    pub kv_keys: Vec<f32>,
    /// Value slab, row-major in `kv_shape`.
    pub kv_vals: Vec<f32>,
    /// The exit station's logits for the last prefix position.
    pub logits: Option<Vec<f32>>,
}

impl OwnedVolumeData {
    /// The same data, borrowed.
    pub fn borrowed(&self) -> VolumeData<'_> {
        VolumeData {
            kv_shape: self.kv_shape,
            tail: &self.tail,
            kv_keys: KvSlice::F32(&self.kv_keys),
            kv_vals: KvSlice::F32(&self.kv_vals),
            logits: self.logits.as_deref(),
        }
    }
}

impl VolumeData<'_> {
    pub(super) fn shape(&self) -> SlabShape {
        SlabShape::from_dims(self.kv_shape)
    }

    /// Checks shapes, lengths, tail and logits against the key (cheap; no slab scan).
    pub(super) fn validate_shape(&self, key: &VolumeKey<'_>) -> Result<(), VolumeError> {
        key.validate()?;
        let layers = usize::from(key.layer_hi - key.layer_lo);
        let s = self.shape();
        if s.layers != layers {
            return Err(VolumeError::SlabDimension {
                dim: "layers (dim 0)",
                expected: layers,
                actual: s.layers,
            });
        }
        if s.positions != key.tokens.len() {
            return Err(VolumeError::SlabDimension {
                dim: "positions (dim 2, must equal prefix_len)",
                expected: key.tokens.len(),
                actual: s.positions,
            });
        }
        if s.kv_heads == 0 {
            return Err(VolumeError::ZeroDimension {
                dim: "kv_heads (dim 1)",
            });
        }
        if s.head_dim == 0 {
            return Err(VolumeError::ZeroDimension {
                dim: "head_dim (dim 3)",
            });
        }
        let expected = s.checked_len().ok_or(VolumeError::SlabTooLarge)?;
        if self.kv_keys.dtype() != self.kv_vals.dtype() {
            return Err(VolumeError::KvDtypeMismatch);
        }
        for (which, slab) in [("kv_keys", self.kv_keys), ("kv_vals", self.kv_vals)] {
            if slab.len() != expected {
                return Err(VolumeError::SlabLength {
                    which,
                    expected,
                    actual: slab.len(),
                });
            }
        }
        if self.tail.is_empty() {
            return Err(VolumeError::EmptyTail);
        }
        if let Some(index) = first_non_finite(self.tail) {
            return Err(VolumeError::NonFinite {
                what: "tail",
                index,
            });
        }
        if let Some(logits) = self.logits {
            if logits.is_empty() {
                return Err(VolumeError::EmptyLogits);
            }
            if let Some(index) = first_non_finite(logits) {
                return Err(VolumeError::NonFinite {
                    what: "logits",
                    index,
                });
            }
        }
        Ok(())
    }

    /// Byte size the entry will have (see the module docs for the formula).
    pub(super) fn entry_bytes(&self) -> usize {
        entry_bytes(
            self.kv_keys.dtype().bytes() * (self.kv_keys.len() + self.kv_vals.len()),
            self.tail.len(),
            self.logits.map_or(0, <[f32]>::len),
            self.shape().positions,
        )
    }

    /// Checks both slabs for non-finite values without copying them.
    pub(super) fn check_slabs(&self, layer_lo: u16) -> Result<(), VolumeError> {
        let finite = |slab: KvSlice<'_>| with_elems!(slab, v => all_finite(v));
        if finite(self.kv_keys) && finite(self.kv_vals) {
            Ok(())
        } else {
            Err(self.locate_damage(layer_lo))
        }
    }

    /// The slabs as KV blocks: block `j` is `cached[j]` where the cache already holds it (the
    /// input's rows are still checked), otherwise a copy of the input's rows with the
    /// finiteness check fused into the copy. Bad input is an error naming the first damaged
    /// row, whatever is cached.
    pub(super) fn blocks(
        &self,
        cached: &[Option<Arc<KvBlock>>],
        layer_lo: u16,
    ) -> Result<Vec<Arc<KvBlock>>, VolumeError> {
        match (self.kv_keys, self.kv_vals) {
            (KvSlice::F32(k), KvSlice::F32(v)) => self.blocks_of(k, v, cached, layer_lo),
            (KvSlice::F16(k), KvSlice::F16(v)) => self.blocks_of(k, v, cached, layer_lo),
            _ => Err(VolumeError::KvDtypeMismatch),
        }
    }

    fn blocks_of<T: KvElem>(
        &self,
        keys: &[T],
        vals: &[T],
        cached: &[Option<Arc<KvBlock>>],
        layer_lo: u16,
    ) -> Result<Vec<Arc<KvBlock>>, VolumeError> {
        let shape = self.shape();
        let mut blocks = Vec::with_capacity(shape.positions.div_ceil(super::BLOCK_POSITIONS));
        for (j, (start, n)) in block_spans(shape.positions).enumerate() {
            // A cached block is shared only if it stores the input's type: one volume's
            // blocks (and its file) hold one type.
            let shared = cached
                .get(j)
                .cloned()
                .flatten()
                .filter(|b| b.dtype() == T::DTYPE);
            let block = match shared {
                Some(b) if KvBlock::rows_finite(shape, keys, vals, start, n) => Some(b),
                Some(_) => None,
                None => KvBlock::copy_from(shape, keys, vals, start, n).map(Arc::new),
            };
            blocks.push(block.ok_or_else(|| self.locate_damage(layer_lo))?);
        }
        Ok(blocks)
    }

    /// The error for slabs known to hold a non-finite value, naming the earliest damaged
    /// row (keys before values).
    fn locate_damage(&self, layer_lo: u16) -> VolumeError {
        let shape = self.shape();
        let (which, slab) = if with_elems!(self.kv_keys, k => all_finite(k)) {
            ("kv_vals", self.kv_vals)
        } else {
            ("kv_keys", self.kv_keys)
        };
        let (layer, head, position) =
            with_elems!(slab, v => first_damaged_row(shape, shape.positions, v))
                .expect("caller saw a non-finite value");
        VolumeError::NonFiniteKv {
            which,
            layer: usize::from(layer_lo) + layer,
            head,
            position,
        }
    }
}

/// Byte size of an entry: both KV slabs (`kv_bytes`: 4 bytes a value as f32, 2 as f16), the
/// f32 tail and logits, and the u32 token ids.
pub(super) fn entry_bytes(
    kv_bytes: usize,
    tail_len: usize,
    logits_len: usize,
    prefix_len: usize,
) -> usize {
    kv_bytes + 4 * (tail_len + logits_len + prefix_len)
}
