//! The AVX2 + FMA lanes (two `__m256`), and the 8-lane x86 helpers both SIMD paths share.

use std::arch::x86_64::*;
use std::ops::Range;

use super::kernel::{kernel, Lanes};
use super::{AttnDims, AttnInputs};

/// Round to nearest even, no exceptions.
pub(super) const ROUND_NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

/// Tree steps `l + l⊕4`, `l + l⊕2`, `l + l⊕1` of eight lanes (shared by both x86 paths).
#[inline(always)]
pub(super) unsafe fn tree8_add(x: __m256) -> f32 {
    let t4 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps::<1>(t2, t2)))
}

/// [`tree8_add`] with `max` (`a > b ? a : b`, the lower lanes as `a`).
#[inline(always)]
pub(super) unsafe fn tree8_max(x: __m256) -> f32 {
    let t4 = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let t2 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
    _mm_cvtss_f32(_mm_max_ss(t2, _mm_shuffle_ps::<1>(t2, t2)))
}

/// Lane masks (all bits set = on) of the first `n ≤ 16` lanes, as two halves of 8.
#[inline(always)]
unsafe fn lane_masks(n: usize) -> (__m256i, __m256i) {
    let n = _mm256_set1_epi32(n as i32);
    (
        _mm256_cmpgt_epi32(n, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
        _mm256_cmpgt_epi32(n, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)),
    )
}

#[derive(Clone, Copy)]
pub(super) struct Avx2Lanes(__m256, __m256);

impl Lanes for Avx2Lanes {
    /// 4 keys × 2 `__m256` accumulators of one head (16 ymm registers in all).
    const KEY_GROUP: usize = 4;
    const SCORE_HEADS: usize = 1;
    /// 3 heads × 2 vectors × 2 `__m256` accumulators + the 4 of a loaded value block: the
    /// 16 ymm registers. (4 × 4, the AVX-512 blocking, spills: ~13% slower at 256 keys.)
    const VALUE_VECTORS: usize = 2;
    const VALUE_HEADS: usize = 3;

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Avx2Lanes(_mm256_set1_ps(x), _mm256_set1_ps(x))
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        Avx2Lanes(_mm256_loadu_ps(ptr), _mm256_loadu_ps(ptr.add(8)))
    }
    #[inline(always)]
    unsafe fn load_f16(ptr: *const u16) -> Self {
        Avx2Lanes(
            _mm256_cvtph_ps(_mm_loadu_si128(ptr as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(ptr.add(8) as *const __m128i)),
        )
    }
    #[inline(always)]
    unsafe fn load_partial(ptr: *const f32, n: usize) -> Self {
        let (lo, hi) = lane_masks(n);
        // Masked-off lanes are never read (no fault), so the high half may point past
        // the data; `wrapping_add` keeps that arithmetic defined.
        Avx2Lanes(
            _mm256_maskload_ps(ptr, lo),
            _mm256_maskload_ps(ptr.wrapping_add(8), hi),
        )
    }
    #[inline(always)]
    unsafe fn store_partial(self, ptr: *mut f32, n: usize) {
        let (lo, hi) = lane_masks(n);
        _mm256_maskstore_ps(ptr, lo, self.0);
        _mm256_maskstore_ps(ptr.wrapping_add(8), hi, self.1);
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        _mm256_storeu_ps(ptr, self.0);
        _mm256_storeu_ps(ptr.add(8), self.1);
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Avx2Lanes(
            _mm256_fmadd_ps(a.0, b.0, c.0),
            _mm256_fmadd_ps(a.1, b.1, c.1),
        )
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Avx2Lanes(_mm256_add_ps(a.0, b.0), _mm256_add_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Avx2Lanes(_mm256_sub_ps(a.0, b.0), _mm256_sub_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Avx2Lanes(_mm256_mul_ps(a.0, b.0), _mm256_mul_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        Avx2Lanes(_mm256_max_ps(a.0, b.0), _mm256_max_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn round_even(a: Self) -> Self {
        Avx2Lanes(
            _mm256_round_ps::<ROUND_NEAREST>(a.0),
            _mm256_round_ps::<ROUND_NEAREST>(a.1),
        )
    }
    #[inline(always)]
    unsafe fn pow2_int(a: Self) -> Self {
        let bits = |x: __m256| {
            let e = _mm256_add_epi32(_mm256_cvtps_epi32(x), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
        };
        Avx2Lanes(bits(a.0), bits(a.1))
    }
    #[inline(always)]
    unsafe fn zero_below(x: Self, threshold: f32, y: Self) -> Self {
        let t = _mm256_set1_ps(threshold);
        let zero = _mm256_setzero_ps();
        Avx2Lanes(
            _mm256_blendv_ps(y.0, zero, _mm256_cmp_ps::<_CMP_LT_OQ>(x.0, t)),
            _mm256_blendv_ps(y.1, zero, _mm256_cmp_ps::<_CMP_LT_OQ>(x.1, t)),
        )
    }
    #[inline(always)]
    unsafe fn hsum(self) -> f32 {
        tree8_add(_mm256_add_ps(self.0, self.1))
    }
    #[inline(always)]
    unsafe fn hmax(self) -> f32 {
        tree8_max(_mm256_max_ps(self.0, self.1))
    }

    /// The [`Lanes::hsum`] trees of 8 vectors at once (see the AVX-512 version): after
    /// `l⊕8` (one `__m256` per key), key `k`'s bit 1 picks its partner at `l⊕4`, bit 0
    /// at `l⊕2`, bit 2 its `__m256` until the last step.
    #[inline(always)]
    unsafe fn hsum8(xs: &[Self; 8]) -> Self {
        // (Loops, not closures: a closure would not inherit the target features.)
        // l + l⊕8: one __m256 per key.
        let mut t8 = [_mm256_setzero_ps(); 8];
        for (t, x) in t8.iter_mut().zip(xs) {
            *t = _mm256_add_ps(x.0, x.1);
        }
        // l + l⊕4: 128-bit halves [a0+a1, b0+b1] of keys a = k, b = k + 2 (bit 1 clear).
        let mut t4 = [_mm256_setzero_ps(); 4];
        for (m, t) in t4.iter_mut().enumerate() {
            let k = (m & 1) | ((m >> 1) << 2);
            let (a, b) = (t8[k], t8[k + 2]);
            *t = _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            );
        }
        // l + l⊕2 within each half: [r0+r2, r1+r3, s0+s2, s1+s3], bit 0 = s; w0 holds
        // the keys with bit 2 clear.
        let w0 = _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(t4[0], t4[1]),
            _mm256_shuffle_ps::<0b11_10_11_10>(t4[0], t4[1]),
        );
        let w1 = _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(t4[2], t4[3]),
            _mm256_shuffle_ps::<0b11_10_11_10>(t4[2], t4[3]),
        );
        // l + l⊕1: half `k1` holds keys [k0 + 2·k2] = [0, 1, 4, 5] | [2, 3, 6, 7]; the
        // 64-bit permute puts them in order.
        let sums = _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(w0, w1),
            _mm256_shuffle_ps::<0b11_01_11_01>(w0, w1),
        );
        let ordered = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(
            sums,
        )));
        Avx2Lanes(ordered, _mm256_setzero_ps())
    }

    #[inline(always)]
    unsafe fn store8(self, ptr: *mut f32) {
        _mm256_storeu_ps(ptr, self.0)
    }
}

/// The kernel compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; inputs must be validated.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend_avx2(
    inputs: &AttnInputs<'_>,
    dims: AttnDims,
    scale: f32,
    heads: Range<usize>,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    kernel::<Avx2Lanes>(inputs, dims, scale, heads, scratch, out)
}

/// [`super::kernel::exp_shifted_lanes`] on AVX2 + FMA.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn exp_shifted_avx2(values: &[f32], shift: f32, out: &mut [f32]) {
    super::kernel::exp_shifted_lanes::<Avx2Lanes>(values, shift, out)
}

/// `exp` of 16 values on AVX2 (for the cross-ISA exp test).
#[cfg(test)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn exp_avx2(x: *const f32, out: *mut f32) {
    Avx2Lanes::exp_nonpositive(Avx2Lanes::load(x)).store(out)
}

/// [`super::kernel::probe_lanes`] on AVX2 + FMA.
#[cfg(test)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn probe_avx2(probe: &mut super::kernel::LanesProbe) {
    super::kernel::probe_lanes::<Avx2Lanes>(probe)
}
