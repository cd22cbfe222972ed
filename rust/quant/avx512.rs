//! AVX-512 kernels: F + BW, with or without VNNI. The quantized formats run the lane kernels
//! (`lanes`) over [`Avx512`]: 16 rows per vector, `vpdpbusd` with VNNI, `vpmaddubsw` +
//! `vpmaddwd` without; float weights and activation quantization are here.

use core::arch::x86_64::*;
use std::ops::Range;

use super::activation::{block_scale, quantize_span, ROUNDING_MAGIC};
use super::kernel::OutPtr;
use super::lanes::{self, Isa};

/// AVX-512 F + BW (+ VNNI when `VNNI`).
#[derive(Clone, Copy)]
pub(crate) struct Avx512<const VNNI: bool>;

/// Four 16-byte loads into the four 128-bit lanes of a vector.
#[inline(always)]
unsafe fn load4(p0: *const u8, p1: *const u8, p2: *const u8, p3: *const u8) -> __m512i {
    // SAFETY: the caller guarantees 16 readable bytes at each pointer.
    unsafe {
        let v = _mm512_castsi128_si512(_mm_loadu_si128(p0 as *const __m128i));
        let v = _mm512_inserti32x4::<1>(v, _mm_loadu_si128(p1 as *const __m128i));
        let v = _mm512_inserti32x4::<2>(v, _mm_loadu_si128(p2 as *const __m128i));
        _mm512_inserti32x4::<3>(v, _mm_loadu_si128(p3 as *const __m128i))
    }
}

/// The four activation bytes at `a`, broadcast to every lane.
#[inline(always)]
unsafe fn broadcast4(a: *const i8) -> __m512i {
    // SAFETY: the caller guarantees 4 readable bytes at `a`.
    unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(a as *const i32)) }
}

/// Byte offsets of the 32-bit words of a 128-bit lane, for `vpshufb` controls.
#[inline(always)]
unsafe fn dword_base() -> __m512i {
    _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x0404_0404, 0x0808_0808, 0x0c0c_0c0c))
}

impl<const VNNI: bool> Isa for Avx512<VNNI> {
    const LANES: usize = 16;
    const VNNI: bool = VNNI;
    const TILE: usize = 8;
    const UNIT: usize = 8;
    type I = __m512i;
    type F = __m512;

    #[inline(always)]
    unsafe fn zero() -> __m512i {
        _mm512_setzero_si512()
    }
    #[inline(always)]
    unsafe fn splat(v: i32) -> __m512i {
        _mm512_set1_epi32(v)
    }
    #[inline(always)]
    unsafe fn splat_load(p: *const i32) -> __m512i {
        // SAFETY: `p` is readable (caller).
        unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(p)) }
    }
    #[inline(always)]
    unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
        _mm512_and_si512(a, b)
    }
    #[inline(always)]
    unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
        _mm512_or_si512(a, b)
    }
    #[inline(always)]
    unsafe fn add32(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sub32(a: __m512i, b: __m512i) -> __m512i {
        _mm512_sub_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sub8(a: __m512i, b: __m512i) -> __m512i {
        _mm512_sub_epi8(a, b)
    }
    #[inline(always)]
    unsafe fn mullo32(a: __m512i, b: __m512i) -> __m512i {
        _mm512_mullo_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn srl32(a: __m512i, n: u32) -> __m512i {
        _mm512_srl_epi32(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline(always)]
    unsafe fn sll32(a: __m512i, n: u32) -> __m512i {
        _mm512_sll_epi32(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline(always)]
    unsafe fn sra32(a: __m512i, n: u32) -> __m512i {
        _mm512_sra_epi32(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline(always)]
    unsafe fn sra16(a: __m512i, n: u32) -> __m512i {
        _mm512_sra_epi16(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline(always)]
    unsafe fn dword_bytes(a: __m512i, ctrl: u32) -> __m512i {
        // SAFETY: plain vector arithmetic (caller's features).
        unsafe {
            _mm512_shuffle_epi8(
                a,
                _mm512_add_epi8(_mm512_set1_epi32(ctrl as i32), dword_base()),
            )
        }
    }
    #[inline(always)]
    unsafe fn bits_to_ones(a: __m512i, mask: __m512i) -> __m512i {
        _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(a, mask), _mm512_set1_epi8(1))
    }
    #[inline(always)]
    unsafe fn load(p: *const __m512i) -> __m512i {
        // SAFETY: the caller guarantees 64 readable bytes.
        unsafe { _mm512_load_si512(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut __m512i, v: __m512i) {
        // SAFETY: the caller guarantees 64 writable, aligned bytes.
        unsafe { _mm512_store_si512(p, v) }
    }
    #[inline(always)]
    unsafe fn rows_x16(p: *const u8, stride: usize) -> [__m512i; 4] {
        // SAFETY: the caller guarantees 16 readable bytes at p + i·stride, i < 16.
        unsafe {
            // Vector k holds rows k, 4+k, 8+k, 12+k in its 128-bit lanes; a 4×4 transpose of
            // the 32-bit words within the lanes puts row i in lane i.
            let mut v = [_mm512_setzero_si512(); 4];
            for (k, vk) in v.iter_mut().enumerate() {
                let row = p.add(k * stride);
                let s4 = 4 * stride;
                *vk = load4(row, row.add(s4), row.add(2 * s4), row.add(3 * s4));
            }
            let [v0, v1, v2, v3] = v;
            let t0 = _mm512_unpacklo_epi32(v0, v1);
            let t1 = _mm512_unpackhi_epi32(v0, v1);
            let t2 = _mm512_unpacklo_epi32(v2, v3);
            let t3 = _mm512_unpackhi_epi32(v2, v3);
            [
                _mm512_unpacklo_epi64(t0, t2),
                _mm512_unpackhi_epi64(t0, t2),
                _mm512_unpacklo_epi64(t1, t3),
                _mm512_unpackhi_epi64(t1, t3),
            ]
        }
    }
    #[inline(always)]
    unsafe fn dot_pair(acc: __m512i, c0: __m512i, c1: __m512i, a: *const i8) -> __m512i {
        // SAFETY: 8 readable bytes at `a` (caller).
        unsafe {
            let (a0, a1) = (broadcast4(a), broadcast4(a.add(4)));
            if VNNI {
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, c0, a0), c1, a1)
            } else {
                // Codes below 64: the 4 products of a pair of i16 sums fit in i16.
                let p =
                    _mm512_add_epi16(_mm512_maddubs_epi16(c0, a0), _mm512_maddubs_epi16(c1, a1));
                _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))
            }
        }
    }
    #[inline(always)]
    unsafe fn pair_products(c: __m512i, a: *const i8) -> __m512i {
        // SAFETY: 4 readable bytes at `a` (caller).
        unsafe { _mm512_maddubs_epi16(c, broadcast4(a)) }
    }
    #[inline(always)]
    unsafe fn add16(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn widen16(a: __m512i) -> __m512i {
        _mm512_madd_epi16(a, _mm512_set1_epi16(1))
    }
    #[inline(always)]
    unsafe fn dot_codes_scaled(
        codes: &[__m512i],
        a: *const i8,
        scale: __m512i,
        run: usize,
    ) -> __m512i {
        // SAFETY: as above.
        unsafe {
            if VNNI {
                _mm512_mullo_epi32(pair_sums::<VNNI>(codes, a, scale, run), scale)
            } else {
                pair_sums::<VNNI>(codes, a, scale, run)
            }
        }
    }
    #[inline(always)]
    unsafe fn scale_form(bytes: __m512i, k: u32, signed: bool) -> __m512i {
        // SAFETY: plain vector arithmetic (caller's features).
        unsafe {
            match (VNNI, signed) {
                (true, false) => Self::dword_bytes(bytes, 0x8080_8000 | k),
                (true, true) => Self::sra32(Self::dword_bytes(bytes, 0x0080_8080 | (k << 24)), 24),
                (false, false) => Self::dword_bytes(bytes, 0x8000_8000 | k | (k << 16)),
                (false, true) => Self::sra16(
                    Self::dword_bytes(bytes, 0x0080_0080 | (k << 8) | (k << 24)),
                    8,
                ),
            }
        }
    }
    #[inline(always)]
    unsafe fn madd_pairs(acc: __m512i, pairs: __m512i, s: *const i16) -> __m512i {
        // SAFETY: 4 readable bytes at `s` (caller).
        unsafe {
            let s = _mm512_set1_epi32(std::ptr::read_unaligned(s as *const i32));
            if VNNI {
                _mm512_dpwssd_epi32(acc, pairs, s)
            } else {
                _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, s))
            }
        }
    }
    #[inline(always)]
    unsafe fn dot4_signed(acc: __m512i, abs_q: __m512i, q: __m512i, a: *const i8) -> __m512i {
        // SAFETY: 4 readable bytes at `a` (caller).
        unsafe {
            // |q| × (a with q's sign): pair sums ≤ 2·128·127 fit i16.
            let a = broadcast4(a);
            let signed_a =
                _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(q), _mm512_setzero_si512(), a);
            let p = _mm512_maddubs_epi16(abs_q, signed_a);
            _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))
        }
    }
    #[inline(always)]
    unsafe fn abs8(q: __m512i) -> __m512i {
        _mm512_abs_epi8(q)
    }
    #[inline(always)]
    unsafe fn loadu(p: *const u8) -> __m512i {
        // SAFETY: 64 readable bytes at `p` (caller).
        unsafe { _mm512_loadu_si512(p as *const __m512i) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m512 {
        // SAFETY: 32 readable bytes at `p` (caller).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }

    #[inline(always)]
    unsafe fn fzero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn fsplat(v: f32) -> __m512 {
        _mm512_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn fadd(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fsub(a: __m512, b: __m512) -> __m512 {
        _mm512_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn cvt(a: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn f16_low(a: __m512i) -> __m512 {
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(a))
    }
    #[inline(always)]
    unsafe fn fload(p: *const __m512) -> __m512 {
        // SAFETY: 64 readable, aligned bytes (caller).
        unsafe { _mm512_load_ps(p as *const f32) }
    }
    #[inline(always)]
    unsafe fn fstore(p: *mut __m512, v: __m512) {
        // SAFETY: 64 writable, aligned bytes (caller).
        unsafe { _mm512_store_ps(p as *mut f32, v) }
    }
    #[inline(always)]
    unsafe fn fstore_out(p: *mut f32, v: __m512) {
        // SAFETY: 16 writable floats (caller).
        unsafe { _mm512_storeu_ps(p, v) }
    }
}

/// `Σ_v` of the code vectors' dot products with the activation words: with VNNI, chained
/// `vpdpbusd` (`pair_weight` unused); without it, `vpmaddwd` sums weighted by `pair_weight`
/// of the `vpmaddubsw` results of `run` consecutive vectors, added in i16 first (the
/// caller's bound keeps them exact).
#[inline(always)]
unsafe fn pair_sums<const VNNI: bool>(
    codes: &[__m512i],
    a: *const i8,
    pair_weight: __m512i,
    run: usize,
) -> __m512i {
    // SAFETY: 4·codes.len() readable bytes at `a` (caller).
    unsafe {
        let mut acc = _mm512_setzero_si512();
        if VNNI {
            // Two independent chains (integer sums, so any order gives the same result):
            // one chain of 8 would leave the token's dot latency-bound.
            let mut odd = _mm512_setzero_si512();
            for (k, pair) in codes.chunks_exact(2).enumerate() {
                acc = _mm512_dpbusd_epi32(acc, pair[0], broadcast4(a.add(8 * k)));
                odd = _mm512_dpbusd_epi32(odd, pair[1], broadcast4(a.add(8 * k + 4)));
            }
            acc = _mm512_add_epi32(acc, odd);
        } else {
            for (k, chunk) in codes.chunks(run).enumerate() {
                let at = a.add(4 * k * run);
                let mut p = _mm512_maddubs_epi16(chunk[0], broadcast4(at));
                for (j, &c) in chunk.iter().enumerate().skip(1) {
                    p = _mm512_add_epi16(p, _mm512_maddubs_epi16(c, broadcast4(at.add(4 * j))));
                }
                acc = _mm512_add_epi32(acc, _mm512_madd_epi16(p, pair_weight));
            }
        }
        acc
    }
}

lanes::lane_entries!(
    Avx512<true>,
    "avx512f,avx512bw,avx512vnni",
    small_vnni,
    k_vnni
);
lanes::lane_entries!(Avx512<false>, "avx512f,avx512bw", small_bw, k_bw);

/// AVX-512 rectangle of a float-weight matmul (F32 or F16 weights, f32 activations).
///
/// # Safety
/// The CPU supports AVX-512 F; `data` holds whole rows for `rows`, `x` holds
/// `tokens.end × cols` floats; `out` as for [`quant_rect`].
#[target_feature(enable = "avx512f")]
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

/// Sixteen float weights (F16 or F32 bytes) at `p`, as f32.
#[inline(always)]
unsafe fn load_w16(f16: bool, p: *const u8) -> __m512 {
    // SAFETY: 16 elements readable at p (callers below).
    unsafe {
        if f16 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        } else {
            _mm512_loadu_ps(p as *const f32)
        }
    }
}

/// Canonical 16-lane float dot product (see `scalar::float_row_dot`).
#[inline(always)]
unsafe fn float_dot(f16: bool, w: *const u8, x: *const f32, cols: usize) -> f32 {
    let elem = if f16 { 2 } else { 4 };
    let full = cols / 16 * 16;
    let mut acc = _mm512_setzero_ps();
    // SAFETY: `cols` elements are readable at `w` and `x` (caller); the tail is copied into
    // zero-padded buffers, whose +0.0 products leave the lanes unchanged.
    unsafe {
        for i in (0..full).step_by(16) {
            let p = _mm512_mul_ps(load_w16(f16, w.add(i * elem)), _mm512_loadu_ps(x.add(i)));
            acc = _mm512_add_ps(acc, p);
        }
        if full < cols {
            let n = cols - full;
            let mut wt = [0u8; 64];
            let mut xt = [0.0f32; 16];
            std::ptr::copy_nonoverlapping(w.add(full * elem), wt.as_mut_ptr(), n * elem);
            std::ptr::copy_nonoverlapping(x.add(full), xt.as_mut_ptr(), n);
            let p = _mm512_mul_ps(load_w16(f16, wt.as_ptr()), _mm512_loadu_ps(xt.as_ptr()));
            acc = _mm512_add_ps(acc, p);
        }
        let low = _mm512_castps512_ps256(acc);
        let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
        let s8 = _mm256_add_ps(low, high);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }
}

/// AVX-512 version of `activation::quantize_spans` (same operations, same bits).
///
/// # Safety
/// The CPU supports AVX-512 F + BW; `block` is a multiple of 16; `x` and `qs` hold
/// `block · scale.len()` elements and `qsum` `scale.len()`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn quantize_spans(
    x: &[f32],
    qs: &mut [i8],
    block: usize,
    scale: &mut [f32],
    qsum: &mut [i32],
) {
    let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
    let magic = _mm512_set1_ps(ROUNDING_MAGIC);
    let magic_bits = _mm512_set1_epi32(ROUNDING_MAGIC.to_bits() as i32);
    for b in 0..scale.len() {
        let (xb, qb) = (
            &x[b * block..(b + 1) * block],
            &mut qs[b * block..(b + 1) * block],
        );
        // SAFETY: `block` floats readable in `xb`, `block` bytes writable in `qb`, in steps
        // of 16.
        unsafe {
            let mut amax = _mm512_setzero_si512();
            for i in (0..block).step_by(16) {
                let bits = _mm512_castps_si512(_mm512_loadu_ps(xb.as_ptr().add(i)));
                amax = _mm512_max_epu32(amax, _mm512_and_si512(bits, abs_mask));
            }
            let Some((d, id)) = block_scale(_mm512_reduce_max_epu32(amax)) else {
                (scale[b], qsum[b]) = quantize_span(xb, qb);
                continue;
            };
            let id = _mm512_set1_ps(id);
            let mut sum = _mm512_setzero_si512();
            for i in (0..block).step_by(16) {
                let v = _mm512_loadu_ps(xb.as_ptr().add(i));
                let m = _mm512_add_ps(_mm512_mul_ps(v, id), magic);
                let r = _mm512_sub_epi32(_mm512_castps_si512(m), magic_bits);
                _mm_storeu_si128(
                    qb.as_mut_ptr().add(i) as *mut __m128i,
                    _mm512_cvtepi32_epi8(r),
                );
                sum = _mm512_add_epi32(sum, r);
            }
            (scale[b], qsum[b]) = (d, _mm512_reduce_add_epi32(sum));
        }
    }
}
