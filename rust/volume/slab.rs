//! Slab layout and the finiteness kernels that guard every copy into or out of the cache.

#[cfg(target_arch = "x86_64")]
use super::avx2;

/// Row-major layout `(layers, kv_heads, positions, head_dim)` of a KV slab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlabShape {
    /// Layers in the station's range (`layer_hi − layer_lo`).
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Positions stored per (layer, head): the prefix length.
    pub positions: usize,
    /// Floats per (layer, head, position) row.
    pub head_dim: usize,
}

impl SlabShape {
    /// The shape of a 4-D array `[layers, kv_heads, positions, head_dim]`.
    pub fn from_dims(dims: [usize; 4]) -> Self {
        let [layers, kv_heads, positions, head_dim] = dims;
        SlabShape {
            layers,
            kv_heads,
            positions,
            head_dim,
        }
    }

    /// `[layers, kv_heads, positions, head_dim]`.
    pub fn dims(&self) -> [usize; 4] {
        [self.layers, self.kv_heads, self.positions, self.head_dim]
    }

    /// Number of floats, or `None` if it overflows `usize`.
    pub fn checked_len(&self) -> Option<usize> {
        self.layers
            .checked_mul(self.kv_heads)?
            .checked_mul(self.positions)?
            .checked_mul(self.head_dim)
    }

    /// Offset of the first float of row `(layer, head, position)` (local layer index).
    pub fn row_offset(&self, layer: usize, head: usize, position: usize) -> usize {
        ((layer * self.kv_heads + head) * self.positions + position) * self.head_dim
    }
}

/// Largest `|bits|` of a finite f32 (as `i32`); anything above is ±inf or NaN.
const MAX_FINITE_ABS_BITS: i32 = 0x7f7f_ffff;
const ABS_MASK: u32 = 0x7fff_ffff;

/// 1 if `v` is ±inf or NaN, else 0. Branch-free integer compare on the magnitude bits, so
/// loops over it vectorise with baseline SSE2 (a float `is_finite` test does not).
#[inline(always)]
fn non_finite_bit(v: f32) -> u32 {
    // The mask clears the sign bit, so the signed compare is exact.
    u32::from((v.to_bits() & ABS_MASK) as i32 > MAX_FINITE_ABS_BITS)
}

/// Whether every value is finite (one vectorised pass, no early exit).
pub fn all_finite(values: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { avx2::all_finite(values) };
    }
    all_finite_portable(values)
}

/// Copies `src` into `dst` (equal lengths) and reports whether every value was finite.
///
/// Works in 4 KiB chunks: each chunk is copied (the compiler's memcpy) and then checked
/// while it is still in L1, so the source is read from memory once even for slabs far
/// larger than the caches.
///
/// # Panics
/// If the lengths differ (callers check them first).
pub fn copy_all_finite(src: &[f32], dst: &mut [f32]) -> bool {
    assert_eq!(src.len(), dst.len(), "copy_all_finite: length mismatch");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { avx2::copy_all_finite(src, dst) };
    }
    copy_all_finite_portable(src, dst)
}

#[inline(always)]
pub(super) fn all_finite_portable(values: &[f32]) -> bool {
    values.iter().fold(0u32, |bad, &v| bad | non_finite_bit(v)) == 0
}

#[inline(always)]
pub(super) fn copy_all_finite_portable(src: &[f32], dst: &mut [f32]) -> bool {
    const CHUNK: usize = 1024;
    let mut bad = 0u32;
    for (d, s) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
        d.copy_from_slice(s);
        bad |= s.iter().fold(0u32, |b, &v| b | non_finite_bit(v));
    }
    bad == 0
}

/// Index of the first non-finite value, if any.
pub(super) fn first_non_finite(values: &[f32]) -> Option<usize> {
    values.iter().position(|v| !v.is_finite())
}

/// Smallest position `< kv_len` at which any layer/head row of `slab` holds a non-finite
/// value, with the (local layer, head) where it was found first.
pub(super) fn first_damaged_row(
    shape: SlabShape,
    kv_len: usize,
    slab: &[f32],
) -> Option<(usize, usize, usize)> {
    let mut found: Option<(usize, usize, usize)> = None;
    for layer in 0..shape.layers {
        for head in 0..shape.kv_heads {
            // Only positions before the best hit so far can improve it.
            let limit = found.map_or(kv_len, |(_, _, p)| p);
            let start = shape.row_offset(layer, head, 0);
            let block = &slab[start..start + limit * shape.head_dim];
            if !all_finite(block) {
                let bad = first_non_finite(block).expect("a non-finite value exists");
                found = Some((layer, head, bad / shape.head_dim));
            }
        }
    }
    found
}
