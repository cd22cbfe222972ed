//! AVX-512 kernels: F + BW, with or without VNNI. Lanes are output rows: 16 rows advance
//! together through the blocks, each lane doing exactly the scalar canonical sequence
//! `acc = acc + term_b`, so results match `scalar` bit for bit. Weight codes are unpacked
//! once per block and reused for up to 8 tokens (the prefill GEMM tile).

use core::arch::x86_64::*;
use std::ops::Range;

use super::activation::{block_scale, quantize_block, ActBlocks, ROUNDING_MAGIC};
use super::format::{BlockFormat, GgmlType, Q40, Q41, Q80, QK};
use super::kernel::OutPtr;
use super::scalar;

/// Rows per step.
const GROUP: usize = 16;

/// AVX-512 rectangle of a quantized matmul.
///
/// # Safety
/// The CPU supports AVX-512 F + BW (+ VNNI when `vnni`); `data` holds whole rows of
/// `row_bytes` for every row in `rows`; `act` holds every token in `tokens`; `out` is
/// valid and exclusively owned for the rectangle `rows × tokens`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn quant_rect(
    dtype: GgmlType,
    vnni: bool,
    data: &[u8],
    row_bytes: usize,
    act: &ActBlocks<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        match (dtype, vnni) {
            (GgmlType::Q4_0, true) => rect_vnni::<Q40>(data, row_bytes, act, rows, tokens, out),
            (GgmlType::Q4_1, true) => rect_vnni::<Q41>(data, row_bytes, act, rows, tokens, out),
            (GgmlType::Q8_0, true) => rect_vnni::<Q80>(data, row_bytes, act, rows, tokens, out),
            (GgmlType::Q4_0, false) => rect_bw::<Q40>(data, row_bytes, act, rows, tokens, out),
            (GgmlType::Q4_1, false) => rect_bw::<Q41>(data, row_bytes, act, rows, tokens, out),
            (GgmlType::Q8_0, false) => rect_bw::<Q80>(data, row_bytes, act, rows, tokens, out),
            _ => unreachable!("no AVX-512 kernel for {dtype}"),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn rect_vnni<F: BlockFormat>(
    data: &[u8],
    row_bytes: usize,
    act: &ActBlocks<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    // SAFETY: forwarded to the caller; the features the body needs are enabled here.
    unsafe { rect_body::<F, true>(data, row_bytes, act, rows, tokens, out) }
}

#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn rect_bw<F: BlockFormat>(
    data: &[u8],
    row_bytes: usize,
    act: &ActBlocks<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    // SAFETY: forwarded to the caller; the features the body needs are enabled here.
    unsafe { rect_body::<F, false>(data, row_bytes, act, rows, tokens, out) }
}

/// Walks the rectangle in groups of 16 rows × token tiles of 8, 4, 2, 1; leftover rows
/// (fewer than 16) take the scalar path, which computes the same bits.
#[inline(always)]
unsafe fn rect_body<F: BlockFormat, const VNNI: bool>(
    data: &[u8],
    row_bytes: usize,
    act: &ActBlocks<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    let nb = row_bytes / F::BLOCK_BYTES;
    let simd_end = rows.start + rows.len() / GROUP * GROUP;
    for r in (rows.start..simd_end).step_by(GROUP) {
        let mut t = tokens.start;
        while t < tokens.end {
            // SAFETY: rows r..r+16 and tokens t..t+tile are inside the caller's rectangle
            // and inside `data` / `act`.
            unsafe {
                let w = data.as_ptr().add(r * row_bytes);
                // The first token tile of a group prefetches the next group's weights:
                // the hardware prefetchers see 16 interleaved row streams too late.
                let next = if t == tokens.start && r + 2 * GROUP <= simd_end {
                    w.add(GROUP * row_bytes)
                } else {
                    std::ptr::null()
                };
                let o = out.at(t, r);
                let s = out.stride;
                t += match tokens.end - t {
                    8.. => group::<F, 8, VNNI>(w, next, row_bytes, nb, act, t, o, s),
                    4.. => group::<F, 4, VNNI>(w, next, row_bytes, nb, act, t, o, s),
                    2.. => group::<F, 2, VNNI>(w, next, row_bytes, nb, act, t, o, s),
                    _ => group::<F, 1, VNNI>(w, next, row_bytes, nb, act, t, o, s),
                };
            }
        }
    }
    if simd_end < rows.end {
        // SAFETY: forwarded to the caller.
        unsafe { scalar::quant_rect::<F>(data, row_bytes, act, simd_end..rows.end, tokens, out) };
    }
}

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

/// Prefetches slice `b` (of `span` bytes) of the next row group, one block's share of it.
#[inline(always)]
unsafe fn prefetch_slice(next: *const u8, b: usize, span: usize) {
    let from = next.wrapping_add(b * span);
    for off in (0..span).step_by(64).chain([span - 1]) {
        // SAFETY: prefetches never fault; `wrapping_add` keeps the address computation
        // defined even past the end of `data`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(from.wrapping_add(off) as *const i8) };
    }
}

/// Lane `4L + k` of the result is dword 0 of 128-bit lane `L` of `a[k]` (the layout
/// `transpose_sum` produces).
#[inline(always)]
unsafe fn first_dwords(a: [__m512i; 4]) -> __m512i {
    let t0 = _mm512_unpacklo_epi32(a[0], a[1]);
    let t1 = _mm512_unpacklo_epi32(a[2], a[3]);
    _mm512_unpacklo_epi64(t0, t1)
}

/// Sums the four i32 of every 128-bit lane of four vectors: lane `4L + k` of the result is
/// the sum of 128-bit lane `L` of `p[k]`.
#[inline(always)]
unsafe fn transpose_sum(p: [__m512i; 4]) -> __m512i {
    let t0 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(p[0], p[1]),
        _mm512_unpackhi_epi32(p[0], p[1]),
    );
    let t1 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(p[2], p[3]),
        _mm512_unpackhi_epi32(p[2], p[3]),
    );
    _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1))
}

/// 16 rows × `T` tokens: `out[t·out_stride + i]` for row `i` of the group. Returns `T`.
///
/// # Safety
/// `w` points at 16 consecutive rows of `nb` blocks of `F`; tokens `t0..t0+T` exist in
/// `act`; `out` is writable for 16 floats at each of the `T` token strides.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group<F: BlockFormat, const T: usize, const VNNI: bool>(
    w: *const u8,
    next: *const u8,
    row_bytes: usize,
    nb: usize,
    act: &ActBlocks<'_>,
    t0: usize,
    out: *mut f32,
    out_stride: usize,
) -> usize {
    let zero = _mm512_setzero_si512();
    let nibble_mask = _mm512_set1_epi8(0x0f);
    let ones16 = _mm512_set1_epi16(1);
    let bpt = act.blocks_per_token;
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..nb {
        // SAFETY: block b of the 16 rows is inside `w` (caller); every activation index is
        // below n_tokens · blocks_per_token (caller).
        unsafe {
            let blk = w.add(b * F::BLOCK_BYTES);
            if !next.is_null() {
                prefetch_slice(next, b, GROUP * F::BLOCK_BYTES);
            }
            // d (low half) and m (high half, Q4_1) of the 16 rows: the first dword of each
            // row's block.
            // (Loads and three shuffles: a gather is several times slower on Zen 4 and on
            // Intel parts with the gather-data-sampling microcode fix.)
            let head = |k: usize| {
                let row = |l: usize| blk.add((4 * l + k) * row_bytes);
                load4(row(0), row(1), row(2), row(3))
            };
            let dm = first_dwords([head(0), head(1), head(2), head(3)]);
            let dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
            let m = if F::HAS_MIN {
                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm)))
            } else {
                _mm512_setzero_ps()
            };
            // Quad k holds rows k, 4+k, 8+k, 12+k in its 128-bit lanes, so `transpose_sum`
            // puts row i in lane i.
            let qs = blk.add(F::QS_OFFSET);
            let row = |k: usize, l: usize| qs.add((4 * l + k) * row_bytes);
            let mut low = [zero; 4];
            let mut high = [zero; 4];
            let mut low_neg = [0u64; 4];
            let mut high_neg = [0u64; 4];
            for k in 0..4 {
                if F::NIBBLES {
                    let v = load4(row(k, 0), row(k, 1), row(k, 2), row(k, 3));
                    low[k] = _mm512_and_si512(v, nibble_mask);
                    high[k] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble_mask);
                } else {
                    let vl = load4(row(k, 0), row(k, 1), row(k, 2), row(k, 3));
                    let vh = load4(
                        row(k, 0).add(16),
                        row(k, 1).add(16),
                        row(k, 2).add(16),
                        row(k, 3).add(16),
                    );
                    // u8 × s8 needs an unsigned operand: |w| times a with w's sign. (The
                    // alternative, w ^ 0x80 = w + 128 and a correction of 128·Σa, computes
                    // faster from cache but streams from memory markedly slower on Zen 4.)
                    low[k] = _mm512_abs_epi8(vl);
                    high[k] = _mm512_abs_epi8(vh);
                    low_neg[k] = _mm512_movepi8_mask(vl);
                    high_neg[k] = _mm512_movepi8_mask(vh);
                }
            }
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let i = (t0 + t) * bpt + b;
                let a = act.qs.as_ptr().add(i * QK) as *const __m128i;
                let a_low = _mm512_broadcast_i32x4(_mm_loadu_si128(a));
                let a_high = _mm512_broadcast_i32x4(_mm_loadu_si128(a.add(1)));
                let mut partial = [zero; 4];
                for k in 0..4 {
                    partial[k] = if F::NIBBLES && VNNI {
                        let p = _mm512_dpbusd_epi32(zero, low[k], a_low);
                        _mm512_dpbusd_epi32(p, high[k], a_high)
                    } else if F::NIBBLES {
                        // 4-bit × 7-bit pair sums stay far inside i16.
                        let p = _mm512_add_epi16(
                            _mm512_maddubs_epi16(low[k], a_low),
                            _mm512_maddubs_epi16(high[k], a_high),
                        );
                        _mm512_madd_epi16(p, ones16)
                    } else if VNNI {
                        let al = _mm512_mask_sub_epi8(a_low, low_neg[k], zero, a_low);
                        let ah = _mm512_mask_sub_epi8(a_high, high_neg[k], zero, a_high);
                        let p = _mm512_dpbusd_epi32(zero, low[k], al);
                        _mm512_dpbusd_epi32(p, high[k], ah)
                    } else {
                        let al = _mm512_mask_sub_epi8(a_low, low_neg[k], zero, a_low);
                        let ah = _mm512_mask_sub_epi8(a_high, high_neg[k], zero, a_high);
                        _mm512_add_epi32(
                            _mm512_madd_epi16(_mm512_maddubs_epi16(low[k], al), ones16),
                            _mm512_madd_epi16(_mm512_maddubs_epi16(high[k], ah), ones16),
                        )
                    };
                }
                let mut isum = transpose_sum(partial);
                if F::NIBBLES && F::ZERO != 0 {
                    let offset = F::ZERO * *act.qsum.get_unchecked(i);
                    isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(offset));
                }
                let da = _mm512_set1_ps(*act.scale.get_unchecked(i));
                let mut term = _mm512_mul_ps(_mm512_mul_ps(dw, da), _mm512_cvtepi32_ps(isum));
                if F::HAS_MIN {
                    let s = _mm512_set1_ps(*act.scaled_sum.get_unchecked(i));
                    term = _mm512_add_ps(term, _mm512_mul_ps(m, s));
                }
                *acc_t = _mm512_add_ps(*acc_t, term);
            }
        }
    }
    for (t, acc_t) in acc.iter().enumerate() {
        // SAFETY: 16 writable floats at each token stride (caller).
        unsafe { _mm512_storeu_ps(out.add(t * out_stride), *acc_t) };
    }
    T
}

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

/// Canonical 16-lane float dot product (see `scalar::float_row_dot`).
#[inline(always)]
unsafe fn float_dot(f16: bool, w: *const u8, x: *const f32, cols: usize) -> f32 {
    let load_w = |p: *const u8| {
        // SAFETY: 16 elements readable at p (callers below).
        unsafe {
            if f16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
            } else {
                _mm512_loadu_ps(p as *const f32)
            }
        }
    };
    let elem = if f16 { 2 } else { 4 };
    let full = cols / 16 * 16;
    let mut acc = _mm512_setzero_ps();
    // SAFETY: `cols` elements are readable at `w` and `x` (caller); the tail is copied into
    // zero-padded buffers, whose +0.0 products leave the lanes unchanged.
    unsafe {
        for i in (0..full).step_by(16) {
            let p = _mm512_mul_ps(load_w(w.add(i * elem)), _mm512_loadu_ps(x.add(i)));
            acc = _mm512_add_ps(acc, p);
        }
        if full < cols {
            let n = cols - full;
            let mut wt = [0u8; 64];
            let mut xt = [0.0f32; 16];
            std::ptr::copy_nonoverlapping(w.add(full * elem), wt.as_mut_ptr(), n * elem);
            std::ptr::copy_nonoverlapping(x.add(full), xt.as_mut_ptr(), n);
            let p = _mm512_mul_ps(load_w(wt.as_ptr()), _mm512_loadu_ps(xt.as_ptr()));
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

/// AVX-512 version of `activation::quantize_blocks` (same operations, same bits).
///
/// # Safety
/// The CPU supports AVX-512 F + BW; `x` and `qs` hold `32 · scale.len()` elements and the
/// other slices `scale.len()`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn quantize_blocks(
    x: &[f32],
    qs: &mut [i8],
    scale: &mut [f32],
    scaled_sum: &mut [f32],
    qsum: &mut [i32],
) {
    let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
    let magic = _mm512_set1_ps(ROUNDING_MAGIC);
    let magic_bits = _mm512_set1_epi32(ROUNDING_MAGIC.to_bits() as i32);
    for b in 0..scale.len() {
        let (xb, qb) = (&x[b * QK..(b + 1) * QK], &mut qs[b * QK..(b + 1) * QK]);
        // SAFETY: 32 floats readable in `xb`, 32 bytes writable in `qb`.
        unsafe {
            let v0 = _mm512_loadu_ps(xb.as_ptr());
            let v1 = _mm512_loadu_ps(xb.as_ptr().add(16));
            let amax = _mm512_max_epu32(
                _mm512_and_si512(_mm512_castps_si512(v0), abs_mask),
                _mm512_and_si512(_mm512_castps_si512(v1), abs_mask),
            );
            let Some((d, id)) = block_scale(_mm512_reduce_max_epu32(amax)) else {
                (scale[b], scaled_sum[b], qsum[b]) = quantize_block(xb, qb);
                continue;
            };
            let id = _mm512_set1_ps(id);
            let round = |v: __m512| {
                let m = _mm512_add_ps(_mm512_mul_ps(v, id), magic);
                _mm512_sub_epi32(_mm512_castps_si512(m), magic_bits)
            };
            let (r0, r1) = (round(v0), round(v1));
            _mm_storeu_si128(qb.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(r0));
            _mm_storeu_si128(
                qb.as_mut_ptr().add(16) as *mut __m128i,
                _mm512_cvtepi32_epi8(r1),
            );
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
            (scale[b], scaled_sum[b], qsum[b]) = (d, d * sum as f32, sum);
        }
    }
}
