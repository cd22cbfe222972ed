//! The AVX-512F lanes (one `__m512`).

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::{tree8_add, tree8_max, ROUND_NEAREST};
use super::kernel::{kernel, Lanes};
use super::{AttnDims, AttnInputs};

#[derive(Clone, Copy)]
pub(super) struct Avx512Lanes(__m512);

impl Avx512Lanes {
    /// Lanes 0–7 and 8–15 as two `__m256`.
    #[inline(always)]
    unsafe fn halves(self) -> (__m256, __m256) {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0)));
        (_mm512_castps512_ps256(self.0), hi)
    }
}

impl Lanes for Avx512Lanes {
    /// 4 keys × 3 heads = 12 `__m512` accumulators, plus 3 query and 1 key vector: half
    /// the register file, so the allocator never spills in the FMA loop (8 keys × 3
    /// heads did, and ran slower).
    const KEY_GROUP: usize = 4;
    const SCORE_HEADS: usize = 3;
    const VALUE_VECTORS: usize = 4;
    const VALUE_HEADS: usize = 4;

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Avx512Lanes(_mm512_set1_ps(x))
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        Avx512Lanes(_mm512_loadu_ps(ptr))
    }
    #[inline(always)]
    unsafe fn load_f16(ptr: *const u16) -> Self {
        Avx512Lanes(_mm512_cvtph_ps(_mm256_loadu_si256(ptr as *const __m256i)))
    }
    #[inline(always)]
    unsafe fn load_partial(ptr: *const f32, n: usize) -> Self {
        Avx512Lanes(_mm512_maskz_loadu_ps(((1u32 << n) - 1) as __mmask16, ptr))
    }
    #[inline(always)]
    unsafe fn store_partial(self, ptr: *mut f32, n: usize) {
        _mm512_mask_storeu_ps(ptr, ((1u32 << n) - 1) as __mmask16, self.0)
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        _mm512_storeu_ps(ptr, self.0)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Avx512Lanes(_mm512_fmadd_ps(a.0, b.0, c.0))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Avx512Lanes(_mm512_add_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Avx512Lanes(_mm512_sub_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Avx512Lanes(_mm512_mul_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        Avx512Lanes(_mm512_max_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn round_even(a: Self) -> Self {
        Avx512Lanes(_mm512_roundscale_ps::<ROUND_NEAREST>(a.0))
    }
    #[inline(always)]
    unsafe fn pow2_int(a: Self) -> Self {
        let e = _mm512_add_epi32(_mm512_cvtps_epi32(a.0), _mm512_set1_epi32(127));
        Avx512Lanes(_mm512_castsi512_ps(_mm512_slli_epi32::<23>(e)))
    }
    #[inline(always)]
    unsafe fn zero_below(x: Self, threshold: f32, y: Self) -> Self {
        let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x.0, _mm512_set1_ps(threshold));
        Avx512Lanes(_mm512_mask_blend_ps(below, y.0, _mm512_setzero_ps()))
    }
    #[inline(always)]
    unsafe fn hsum(self) -> f32 {
        let (lo, hi) = self.halves();
        tree8_add(_mm256_add_ps(lo, hi))
    }
    #[inline(always)]
    unsafe fn hmax(self) -> f32 {
        let (lo, hi) = self.halves();
        tree8_max(_mm256_max_ps(lo, hi))
    }

    /// The [`Lanes::hsum`] trees of 8 vectors at once: each step adds the same lane
    /// pairs as the tree, for two vectors per instruction. Each step blends the two
    /// inputs so that one operand is in place and moves only the other (one shuffle
    /// instead of two: the shuffle units are the ones the FMAs compete with).
    #[inline(always)]
    unsafe fn hsum8(xs: &[Self; 8]) -> Self {
        // (Loops, not closures: a closure would not inherit the target features.)
        // l + l⊕8 of keys a = m, b = m + 4: 128-bit blocks [a0+a2, a1+a3, b2+b0, b3+b1].
        let mut t8 = [_mm512_setzero_ps(); 4];
        for (m, t) in t8.iter_mut().enumerate() {
            let (a, b) = (xs[m].0, xs[m + 4].0);
            let x = _mm512_mask_blend_ps(0xFF00, a, b);
            let y = _mm512_shuffle_f32x4::<0b01_00_11_10>(a, b);
            *t = _mm512_add_ps(x, y);
        }
        // l + l⊕4 of vectors p, q: blocks [p0+p1, q1+q0, p2+p3, q3+q2]; so u0 holds keys
        // [0, 1, 4, 5] and u1 keys [2, 3, 6, 7], one per block.
        let mut t4 = [_mm512_setzero_ps(); 2];
        for (m, t) in t4.iter_mut().enumerate() {
            let (p, q) = (t8[2 * m], t8[2 * m + 1]);
            let x = _mm512_mask_blend_ps(0xF0F0, p, q);
            let z = _mm512_mask_blend_ps(0x0F0F, p, q);
            let y = _mm512_shuffle_f32x4::<0b10_11_00_01>(z, z);
            *t = _mm512_add_ps(x, y);
        }
        // l + l⊕2 within each 128-bit block of r = u0, s = u1: [r0+r2, r1+r3, s2+s0,
        // s3+s1]; block i then holds key [0, 1, 4, 5][i] in lanes 0-1, [2, 3, 6, 7][i] in
        // lanes 2-3.
        let (r, s) = (t4[0], t4[1]);
        let x = _mm512_mask_blend_ps(0xCCCC, r, s);
        let z = _mm512_mask_blend_ps(0x3333, r, s);
        let t2 = _mm512_add_ps(x, _mm512_permute_ps::<0b01_00_11_10>(z));
        // l + l⊕1: each lane pair's sum (in both lanes), then keys gathered in order.
        let sums = _mm512_add_ps(t2, _mm512_permute_ps::<0b10_11_00_01>(t2));
        let order = _mm512_setr_epi32(0, 4, 2, 6, 8, 12, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
        Avx512Lanes(_mm512_permutexvar_ps(order, sums))
    }

    #[inline(always)]
    unsafe fn store8(self, ptr: *mut f32) {
        _mm256_storeu_ps(ptr, _mm512_castps512_ps256(self.0))
    }
}

/// The kernel compiled for AVX-512F.
///
/// # Safety
/// The CPU must support AVX-512F; inputs must be validated.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn attend_avx512(
    inputs: &AttnInputs<'_>,
    dims: AttnDims,
    scale: f32,
    heads: Range<usize>,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    kernel::<Avx512Lanes>(inputs, dims, scale, heads, scratch, out)
}

/// [`super::kernel::exp_shifted_lanes`] on AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn exp_shifted_avx512(values: &[f32], shift: f32, out: &mut [f32]) {
    super::kernel::exp_shifted_lanes::<Avx512Lanes>(values, shift, out)
}

/// `exp` of 16 values on AVX-512F (for the cross-ISA exp test).
#[cfg(test)]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn exp_avx512(x: *const f32, out: *mut f32) {
    Avx512Lanes::exp_nonpositive(Avx512Lanes::load(x)).store(out)
}

/// [`super::kernel::probe_lanes`] on AVX-512F.
#[cfg(test)]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn probe_avx512(probe: &mut super::kernel::LanesProbe) {
    super::kernel::probe_lanes::<Avx512Lanes>(probe)
}
