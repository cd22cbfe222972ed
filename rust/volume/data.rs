//! Incoming capture data, borrowed or owned, and its validation.

use std::borrow::Cow;

use super::slab::{all_finite, copy_all_finite, first_damaged_row, first_non_finite, SlabShape};
use super::{VolumeError, VolumeKey};

/// Borrowed volume data for [`AmplituhedronCache::capture`] (copied once into the cache).
#[derive(Debug, Clone, Copy)]
pub struct VolumeData<'a> {
    /// `[layer_hi − layer_lo, kv_heads, prefix_len, head_dim]` of both slabs.
    pub kv_shape: [usize; 4],
    /// Hidden state emitted for the last prefix position (`hidden_dim` floats).
    pub tail: &'a [f32],
    /// Key slab, row-major in `kv_shape`.
    pub kv_keys: &'a [f32],
    /// Value slab, row-major in `kv_shape`.
    pub kv_vals: &'a [f32],
    /// The exit station's logits for the last prefix position.
    pub logits: Option<&'a [f32]>,
}

/// Owned volume data for [`AmplituhedronCache::capture_owned`]: the slabs move into the
/// cache without another copy.
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

/// Both capture variants, borrowed or owned, so one code path validates and stores them.
pub(super) struct IncomingVolume<'a> {
    pub(super) shape: SlabShape,
    pub(super) tail: Cow<'a, [f32]>,
    pub(super) kv_keys: Cow<'a, [f32]>,
    pub(super) kv_vals: Cow<'a, [f32]>,
    pub(super) logits: Option<Cow<'a, [f32]>>,
}

impl<'a> From<VolumeData<'a>> for IncomingVolume<'a> {
    fn from(d: VolumeData<'a>) -> Self {
        IncomingVolume {
            shape: SlabShape::from_dims(d.kv_shape),
            tail: Cow::Borrowed(d.tail),
            kv_keys: Cow::Borrowed(d.kv_keys),
            kv_vals: Cow::Borrowed(d.kv_vals),
            logits: d.logits.map(Cow::Borrowed),
        }
    }
}

impl From<OwnedVolumeData> for IncomingVolume<'static> {
    fn from(d: OwnedVolumeData) -> Self {
        IncomingVolume {
            shape: SlabShape::from_dims(d.kv_shape),
            tail: Cow::Owned(d.tail),
            kv_keys: Cow::Owned(d.kv_keys),
            kv_vals: Cow::Owned(d.kv_vals),
            logits: d.logits.map(Cow::Owned),
        }
    }
}

impl IncomingVolume<'_> {
    /// Checks shapes, lengths, tail and logits against the key (cheap; no slab scan).
    pub(super) fn validate_shape(&self, key: &VolumeKey<'_>) -> Result<(), VolumeError> {
        key.validate()?;
        let layers = usize::from(key.layer_hi - key.layer_lo);
        let s = self.shape;
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
        for (which, slab) in [("kv_keys", &self.kv_keys), ("kv_vals", &self.kv_vals)] {
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
        if let Some(index) = first_non_finite(&self.tail) {
            return Err(VolumeError::NonFinite {
                what: "tail",
                index,
            });
        }
        if let Some(logits) = &self.logits {
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
            self.kv_keys.len() + self.kv_vals.len(),
            self.tail.len(),
            self.logits.as_ref().map_or(0, |l| l.len()),
            self.shape.positions,
        )
    }

    /// Checks both slabs for non-finite values without copying them.
    pub(super) fn check_slabs(&self, layer_lo: u16) -> Result<(), VolumeError> {
        for (which, slab) in [("kv_keys", &self.kv_keys), ("kv_vals", &self.kv_vals)] {
            if !all_finite(slab) {
                return Err(locate_slab_damage(self.shape, which, slab, layer_lo));
            }
        }
        Ok(())
    }
}

/// A checked, owned slab: a borrowed slab is copied once with the check fused into the copy;
/// an owned one is checked and moved (no copy).
pub(super) fn checked_slab(
    shape: SlabShape,
    which: &'static str,
    slab: Cow<'_, [f32]>,
    layer_lo: u16,
) -> Result<Vec<f32>, VolumeError> {
    match slab {
        Cow::Borrowed(src) => {
            // Zeroed allocation of a large buffer is lazily-mapped zero pages: no extra pass.
            let mut dst = vec![0.0f32; src.len()];
            if copy_all_finite(src, &mut dst) {
                Ok(dst)
            } else {
                Err(locate_slab_damage(shape, which, src, layer_lo))
            }
        }
        Cow::Owned(v) => {
            if all_finite(&v) {
                Ok(v)
            } else {
                Err(locate_slab_damage(shape, which, &v, layer_lo))
            }
        }
    }
}

/// The error for a slab known to hold a non-finite value, naming where it is.
fn locate_slab_damage(
    shape: SlabShape,
    which: &'static str,
    slab: &[f32],
    layer_lo: u16,
) -> VolumeError {
    let (layer, head, position) =
        first_damaged_row(shape, shape.positions, slab).expect("caller saw a non-finite value");
    VolumeError::NonFiniteKv {
        which,
        layer: usize::from(layer_lo) + layer,
        head,
        position,
    }
}

/// Byte size of an entry: f32 slabs, tail and logits plus the u32 token ids.
pub(super) fn entry_bytes(
    slab_floats: usize,
    tail_len: usize,
    logits_len: usize,
    prefix_len: usize,
) -> usize {
    4 * (slab_floats + tail_len + logits_len + prefix_len)
}
