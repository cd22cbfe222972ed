//! Slab layout and the finiteness kernels that guard every copy into or out of the cache.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use crate::ring::{KvDtype, KvSlice};

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

/// An element type a volume's KV is stored in: `f32`, or the f16 bit patterns (`u16`) an
/// f16 ring holds, so a volume of an f16 model takes half the bytes and replays as a copy.
pub(crate) trait KvElem: Copy + Send + Sync + PartialEq + std::fmt::Debug + 'static {
    /// The storage type.
    const DTYPE: KvDtype;
    /// A NaN (fault injection).
    const NAN: Self;
    /// 1 if the value is ±inf or NaN, else 0: branch-free on the bits, so the loops over it
    /// vectorise.
    fn non_finite_bit(self) -> u32;
    /// Zero.
    const ZERO: Self;
    /// `values` as a [`KvSlice`].
    fn slice(values: &[Self]) -> KvSlice<'_>;
    /// Owned values, tagged with their type.
    fn heap(values: Vec<Self>) -> HeapKv;
}

/// KV values owned on the heap, as f32 or as f16 bit patterns.
pub(super) enum HeapKv {
    F32(Box<[f32]>),
    F16(Box<[u16]>),
}

impl HeapKv {
    pub(super) fn slice(&self) -> KvSlice<'_> {
        match self {
            HeapKv::F32(v) => KvSlice::F32(v),
            HeapKv::F16(v) => KvSlice::F16(v),
        }
    }
}

/// Largest `|bits|` of a finite f32 (as `i32`); anything above is ±inf or NaN.
const MAX_FINITE_ABS_BITS: i32 = 0x7f7f_ffff;
const ABS_MASK: u32 = 0x7fff_ffff;
/// The exponent bits of an f16: all set is ±inf or NaN.
const F16_EXPONENT: u16 = 0x7c00;

impl KvElem for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
    const NAN: f32 = f32::NAN;
    #[inline(always)]
    fn non_finite_bit(self) -> u32 {
        // The mask clears the sign bit, so the signed compare is exact.
        u32::from((self.to_bits() & ABS_MASK) as i32 > MAX_FINITE_ABS_BITS)
    }
    const ZERO: f32 = 0.0;
    fn slice(values: &[f32]) -> KvSlice<'_> {
        KvSlice::F32(values)
    }
    fn heap(values: Vec<f32>) -> HeapKv {
        HeapKv::F32(values.into_boxed_slice())
    }
}

impl KvElem for u16 {
    const DTYPE: KvDtype = KvDtype::F16;
    const NAN: u16 = 0x7e00;
    #[inline(always)]
    fn non_finite_bit(self) -> u32 {
        u32::from(self & F16_EXPONENT == F16_EXPONENT)
    }
    const ZERO: u16 = 0;
    fn slice(values: &[u16]) -> KvSlice<'_> {
        KvSlice::F16(values)
    }
    fn heap(values: Vec<u16>) -> HeapKv {
        HeapKv::F16(values.into_boxed_slice())
    }
}

/// Whether every value is finite (one vectorised pass, no early exit).
pub(crate) fn all_finite<T: KvElem>(values: &[T]) -> bool {
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
pub(crate) fn copy_all_finite<T: KvElem>(src: &[T], dst: &mut [T]) -> bool {
    assert_eq!(src.len(), dst.len(), "copy_all_finite: length mismatch");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { avx2::copy_all_finite(src, dst) };
    }
    copy_all_finite_portable(src, dst)
}

#[inline(always)]
pub(super) fn all_finite_portable<T: KvElem>(values: &[T]) -> bool {
    values.iter().fold(0u32, |bad, &v| bad | v.non_finite_bit()) == 0
}

#[inline(always)]
pub(super) fn copy_all_finite_portable<T: KvElem>(src: &[T], dst: &mut [T]) -> bool {
    let chunk = 4096 / std::mem::size_of::<T>();
    let mut bad = 0u32;
    for (d, s) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
        d.copy_from_slice(s);
        bad |= s.iter().fold(0u32, |b, &v| b | v.non_finite_bit());
    }
    bad == 0
}

/// Index of the first non-finite value, if any.
pub(super) fn first_non_finite<T: KvElem>(values: &[T]) -> Option<usize> {
    values.iter().position(|v| v.non_finite_bit() != 0)
}

/// Smallest position `< kv_len` at which any layer/head row of `slab` holds a non-finite
/// value, with the (local layer, head) where it was found first.
pub(super) fn first_damaged_row<T: KvElem>(
    shape: SlabShape,
    kv_len: usize,
    slab: &[T],
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

/// Evaluates `$body` with `$s` bound to the elements of the [`KvSlice`] `$slice`, whatever
/// its storage type (the body is generic over [`KvElem`]).
macro_rules! with_elems {
    ($slice:expr, $s:ident => $body:expr) => {
        match $slice {
            $crate::ring::KvSlice::F32($s) => $body,
            $crate::ring::KvSlice::F16($s) => $body,
        }
    };
}
pub(crate) use with_elems;
