//! AVX2 kernels (with FMA and F16C present, though no FMA is used: see `scalar`). The
//! quantized formats run the lane kernels (`lanes`) over [`Avx2`]: 8 rows per vector,
//! `vpmaddubsw` + `vpmaddwd`; float weights and activation quantization are here.

use core::arch::x86_64::*;
use std::ops::Range;

use super::activation::{block_scale, quantize_span, ROUNDING_MAGIC};
use super::kernel::OutPtr;
use super::lanes::{self, Isa};

/// AVX2 + FMA + F16C.
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

/// Two 16-byte loads into the two 128-bit lanes of a vector.
#[inline(always)]
unsafe fn load2(p0: *const u8, p1: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at each pointer.
    unsafe { _mm256_loadu2_m128i(p1 as *const __m128i, p0 as *const __m128i) }
}

/// The four activation bytes at `a`, broadcast to every lane.
#[inline(always)]
unsafe fn broadcast4(a: *const i8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes at `a`.
    unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(a as *const i32)) }
}

/// `Σ_v` of the code vectors' dot products with the activation words, `vpmaddwd` sums
/// weighted by `pair_weight` (a group scale); the `vpmaddubsw` results of `run` consecutive
/// vectors are added in i16 first (the caller's bound keeps them exact).
#[inline(always)]
unsafe fn pair_sums(codes: &[__m256i], a: *const i8, pair_weight: __m256i, run: usize) -> __m256i {
    // SAFETY: 4·codes.len() readable bytes at `a` (caller).
    unsafe {
        let mut acc = _mm256_setzero_si256();
        for (k, chunk) in codes.chunks(run).enumerate() {
            let at = a.add(4 * k * run);
            let mut p = _mm256_maddubs_epi16(chunk[0], broadcast4(at));
            for (j, &c) in chunk.iter().enumerate().skip(1) {
                p = _mm256_add_epi16(p, _mm256_maddubs_epi16(c, broadcast4(at.add(4 * j))));
            }
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, pair_weight));
        }
        acc
    }
}

impl Isa for Avx2 {
    const LANES: usize = 8;
    const VNNI: bool = false;
    const TILE: usize = 4;
    const UNIT: usize = 4;
    type I = __m256i;
    type F = __m256;

    #[inline(always)]
    unsafe fn zero() -> __m256i {
        _mm256_setzero_si256()
    }
    #[inline(always)]
    unsafe fn splat(v: i32) -> __m256i {
        _mm256_set1_epi32(v)
    }
    #[inline(always)]
    unsafe fn splat_load(p: *const i32) -> __m256i {
        // SAFETY: `p` is readable (caller).
        unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(p)) }
    }
    #[inline(always)]
    unsafe fn and(a: __m256i, b: __m256i) -> __m256i {
        _mm256_and_si256(a, b)
    }
    #[inline(always)]
    unsafe fn or(a: __m256i, b: __m256i) -> __m256i {
        _mm256_or_si256(a, b)
    }
    #[inline(always)]
    unsafe fn add32(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sub32(a: __m256i, b: __m256i) -> __m256i {
        _mm256_sub_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sub8(a: __m256i, b: __m256i) -> __m256i {
        _mm256_sub_epi8(a, b)
    }
    #[inline(always)]
    unsafe fn mullo32(a: __m256i, b: __m256i) -> __m256i {
        _mm256_mullo_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn srl32(a: __m256i, n: u32) -> __m256i {
        _mm256_srl_epi32(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline(always)]
    unsafe fn sll32(a: __m256i, n: u32) -> __m256i {
        _mm256_sll_epi32(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline(always)]
    unsafe fn sra32(a: __m256i, n: u32) -> __m256i {
        _mm256_sra_epi32(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline(always)]
    unsafe fn sra16(a: __m256i, n: u32) -> __m256i {
        _mm256_sra_epi16(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline(always)]
    unsafe fn dword_bytes(a: __m256i, ctrl: u32) -> __m256i {
        let base = _mm256_setr_epi32(
            0,
            0x0404_0404,
            0x0808_0808,
            0x0c0c_0c0c,
            0,
            0x0404_0404,
            0x0808_0808,
            0x0c0c_0c0c,
        );
        _mm256_shuffle_epi8(a, _mm256_add_epi8(_mm256_set1_epi32(ctrl as i32), base))
    }
    #[inline(always)]
    unsafe fn bits_to_ones(a: __m256i, mask: __m256i) -> __m256i {
        _mm256_min_epu8(_mm256_and_si256(a, mask), _mm256_set1_epi8(1))
    }
    #[inline(always)]
    unsafe fn load(p: *const __m256i) -> __m256i {
        // SAFETY: the caller guarantees 32 readable, aligned bytes.
        unsafe { _mm256_load_si256(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut __m256i, v: __m256i) {
        // SAFETY: the caller guarantees 32 writable, aligned bytes.
        unsafe { _mm256_store_si256(p, v) }
    }
    #[inline(always)]
    unsafe fn rows_x16(p: *const u8, stride: usize) -> [__m256i; 4] {
        // SAFETY: the caller guarantees 16 readable bytes at p + i·stride, i < 8.
        unsafe {
            // Vector k holds rows k and 4+k in its 128-bit lanes; a 4×4 transpose of the
            // 32-bit words within the lanes puts row i in lane i.
            let mut v = [_mm256_setzero_si256(); 4];
            for (k, vk) in v.iter_mut().enumerate() {
                *vk = load2(p.add(k * stride), p.add((4 + k) * stride));
            }
            let [v0, v1, v2, v3] = v;
            let t0 = _mm256_unpacklo_epi32(v0, v1);
            let t1 = _mm256_unpackhi_epi32(v0, v1);
            let t2 = _mm256_unpacklo_epi32(v2, v3);
            let t3 = _mm256_unpackhi_epi32(v2, v3);
            [
                _mm256_unpacklo_epi64(t0, t2),
                _mm256_unpackhi_epi64(t0, t2),
                _mm256_unpacklo_epi64(t1, t3),
                _mm256_unpackhi_epi64(t1, t3),
            ]
        }
    }
    #[inline(always)]
    unsafe fn dot_pair(acc: __m256i, c0: __m256i, c1: __m256i, a: *const i8) -> __m256i {
        // SAFETY: 8 readable bytes at `a` (caller).
        unsafe {
            // Codes below 64: the 4 products of a pair of i16 sums fit in i16.
            let p0 = _mm256_maddubs_epi16(c0, broadcast4(a));
            let p1 = _mm256_maddubs_epi16(c1, broadcast4(a.add(4)));
            let p = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1));
            _mm256_add_epi32(acc, p)
        }
    }
    #[inline(always)]
    unsafe fn pair_products(c: __m256i, a: *const i8) -> __m256i {
        // SAFETY: 4 readable bytes at `a` (caller).
        unsafe { _mm256_maddubs_epi16(c, broadcast4(a)) }
    }
    #[inline(always)]
    unsafe fn add16(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn widen16(a: __m256i) -> __m256i {
        _mm256_madd_epi16(a, _mm256_set1_epi16(1))
    }
    #[inline(always)]
    unsafe fn dot_codes_scaled(
        codes: &[__m256i],
        a: *const i8,
        scale: __m256i,
        run: usize,
    ) -> __m256i {
        // SAFETY: as above.
        unsafe { pair_sums(codes, a, scale, run) }
    }
    #[inline(always)]
    unsafe fn scale_form(bytes: __m256i, k: u32, signed: bool) -> __m256i {
        // SAFETY: plain vector arithmetic (caller's features).
        unsafe {
            if signed {
                Self::sra16(
                    Self::dword_bytes(bytes, 0x0080_0080 | (k << 8) | (k << 24)),
                    8,
                )
            } else {
                Self::dword_bytes(bytes, 0x8000_8000 | k | (k << 16))
            }
        }
    }
    #[inline(always)]
    unsafe fn madd_pairs(acc: __m256i, pairs: __m256i, s: *const i16) -> __m256i {
        // SAFETY: 4 readable bytes at `s` (caller).
        unsafe {
            let s = _mm256_set1_epi32(std::ptr::read_unaligned(s as *const i32));
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, s))
        }
    }
    #[inline(always)]
    unsafe fn dot4_signed(acc: __m256i, abs_q: __m256i, q: __m256i, a: *const i8) -> __m256i {
        // SAFETY: 4 readable bytes at `a` (caller).
        unsafe {
            // |q| × (a with q's sign): pair sums ≤ 2·128·127 fit i16.
            let p = _mm256_maddubs_epi16(abs_q, _mm256_sign_epi8(broadcast4(a), q));
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }
    #[inline(always)]
    unsafe fn abs8(q: __m256i) -> __m256i {
        _mm256_abs_epi8(q)
    }
    #[inline(always)]
    unsafe fn loadu(p: *const u8) -> __m256i {
        // SAFETY: 32 readable bytes at `p` (caller).
        unsafe { _mm256_loadu_si256(p as *const __m256i) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes at `p` (caller).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    #[inline(always)]
    unsafe fn fzero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn fsplat(v: f32) -> __m256 {
        _mm256_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn fadd(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fsub(a: __m256, b: __m256) -> __m256 {
        _mm256_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn cvt(a: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn f16_low(a: __m256i) -> __m256 {
        // [lanes 0..3 | 0..3 ‖ 4..7 | 4..7] as u16, then the two low quarters together.
        let low = _mm256_and_si256(a, _mm256_set1_epi32(0xffff));
        let packed = _mm256_permute4x64_epi64::<0b00_00_10_00>(_mm256_packus_epi32(low, low));
        _mm256_cvtph_ps(_mm256_castsi256_si128(packed))
    }
    #[inline(always)]
    unsafe fn fload(p: *const __m256) -> __m256 {
        // SAFETY: 32 readable, aligned bytes (caller).
        unsafe { _mm256_load_ps(p as *const f32) }
    }
    #[inline(always)]
    unsafe fn fstore(p: *mut __m256, v: __m256) {
        // SAFETY: 32 writable, aligned bytes (caller).
        unsafe { _mm256_store_ps(p as *mut f32, v) }
    }
    #[inline(always)]
    unsafe fn fstore_out(p: *mut f32, v: __m256) {
        // SAFETY: 8 writable floats (caller).
        unsafe { _mm256_storeu_ps(p, v) }
    }
}

lanes::lane_entries!(Avx2, "avx2,fma,f16c", small, k);

/// AVX2 rectangle of a float-weight matmul (contract as `avx512::float_rect`, AVX2 + F16C).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn float_rect(
    f16: bool,
    data: &[u8],
    row_bytes: usize,
    x: &[f32],
    cols: usize,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    for r in rows {
        for t in tokens.clone() {
            // SAFETY: row r and token t are in bounds (caller); (t, r) is owned (caller).
            unsafe {
                let v = float_dot(
                    f16,
                    data.as_ptr().add(r * row_bytes),
                    x.as_ptr().add(t * cols),
                    cols,
                );
                out.write(t, r, v);
            }
        }
    }
}

/// Eight float weights (F16 or F32 bytes) at `p`, as f32.
#[inline(always)]
unsafe fn load_w8(f16: bool, p: *const u8) -> __m256 {
    // SAFETY: 8 elements readable at p (callers below).
    unsafe {
        if f16 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        } else {
            _mm256_loadu_ps(p as *const f32)
        }
    }
}

/// `acc_low += w[0..8]·x[0..8]`, `acc_high += w[8..16]·x[8..16]` (elements of `elem` bytes).
#[inline(always)]
unsafe fn float_step16(
    f16: bool,
    acc: &mut (__m256, __m256),
    w16: *const u8,
    x16: *const f32,
    elem: usize,
) {
    // SAFETY: 16 elements readable at w16 and x16 (caller).
    unsafe {
        acc.0 = _mm256_add_ps(
            acc.0,
            _mm256_mul_ps(load_w8(f16, w16), _mm256_loadu_ps(x16)),
        );
        let (w8, x8) = (w16.add(8 * elem), x16.add(8));
        acc.1 = _mm256_add_ps(acc.1, _mm256_mul_ps(load_w8(f16, w8), _mm256_loadu_ps(x8)));
    }
}

/// Canonical 16-lane float dot product with two 8-lane accumulators (lanes 0..7, 8..15).
#[inline(always)]
unsafe fn float_dot(f16: bool, w: *const u8, x: *const f32, cols: usize) -> f32 {
    let elem = if f16 { 2 } else { 4 };
    let full = cols / 16 * 16;
    let mut acc = (_mm256_setzero_ps(), _mm256_setzero_ps());
    // SAFETY: as in `avx512::float_dot`.
    unsafe {
        for i in (0..full).step_by(16) {
            float_step16(f16, &mut acc, w.add(i * elem), x.add(i), elem);
        }
        if full < cols {
            let n = cols - full;
            let mut wt = [0u8; 64];
            let mut xt = [0.0f32; 16];
            std::ptr::copy_nonoverlapping(w.add(full * elem), wt.as_mut_ptr(), n * elem);
            std::ptr::copy_nonoverlapping(x.add(full), xt.as_mut_ptr(), n);
            float_step16(f16, &mut acc, wt.as_ptr(), xt.as_ptr(), elem);
        }
        let s8 = _mm256_add_ps(acc.0, acc.1);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }
}

/// AVX2 version of `activation::quantize_spans` (same operations, same bits).
///
/// # Safety
/// The CPU supports AVX2; `block` is a multiple of 32; lengths as for
/// `avx512::quantize_spans`.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn quantize_spans(
    x: &[f32],
    qs: &mut [i8],
    block: usize,
    scale: &mut [f32],
    qsum: &mut [i32],
) {
    let abs_mask = _mm256_set1_epi32(0x7fff_ffff);
    let magic = _mm256_set1_ps(ROUNDING_MAGIC);
    let magic_bits = _mm256_set1_epi32(ROUNDING_MAGIC.to_bits() as i32);
    // Undoes the lane interleaving of the two saturating packs (exact: |r| ≤ 127).
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let hmax = |v: __m256i| {
        let v = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let v = _mm_max_epu32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
        let v = _mm_max_epu32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v));
        _mm_cvtsi128_si32(v) as u32
    };
    let hsum = |v: __m256i| {
        let v = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
        let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v));
        _mm_cvtsi128_si32(v)
    };
    for b in 0..scale.len() {
        let (xb, qb) = (
            &x[b * block..(b + 1) * block],
            &mut qs[b * block..(b + 1) * block],
        );
        // SAFETY: `block` floats readable in `xb`, `block` bytes writable in `qb`, in steps
        // of 32.
        unsafe {
            let mut amax = _mm256_setzero_si256();
            for i in (0..block).step_by(8) {
                let bits = _mm256_castps_si256(_mm256_loadu_ps(xb.as_ptr().add(i)));
                amax = _mm256_max_epu32(amax, _mm256_and_si256(bits, abs_mask));
            }
            let Some((d, id)) = block_scale(hmax(amax)) else {
                (scale[b], qsum[b]) = quantize_span(xb, qb);
                continue;
            };
            let id = _mm256_set1_ps(id);
            let mut sum = _mm256_setzero_si256();
            for i in (0..block).step_by(32) {
                let r: [__m256i; 4] = std::array::from_fn(|k| {
                    let v = _mm256_loadu_ps(xb.as_ptr().add(i + 8 * k));
                    let m = _mm256_add_ps(_mm256_mul_ps(v, id), magic);
                    _mm256_sub_epi32(_mm256_castps_si256(m), magic_bits)
                });
                let packed = _mm256_packs_epi16(
                    _mm256_packs_epi32(r[0], r[1]),
                    _mm256_packs_epi32(r[2], r[3]),
                );
                let packed = _mm256_permutevar8x32_epi32(packed, order);
                _mm256_storeu_si256(qb.as_mut_ptr().add(i) as *mut __m256i, packed);
                sum = _mm256_add_epi32(
                    sum,
                    _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3])),
                );
            }
            (scale[b], qsum[b]) = (d, hsum(sum));
        }
    }
}
