//! AVX2 kernels (with FMA and F16C present, though no FMA is used: see `scalar`). Lanes are
//! output rows, 8 at a time, each doing the scalar canonical sequence, so results match
//! `scalar` bit for bit. Weight codes are unpacked once per block and reused for up to 4
//! tokens.

use core::arch::x86_64::*;
use std::ops::Range;

use super::activation::{block_scale, quantize_block, ActBlocks, ROUNDING_MAGIC};
use super::format::{BlockFormat, GgmlType, Q40, Q41, Q80, QK};
use super::kernel::OutPtr;
use super::scalar;

/// Rows per step.
const GROUP: usize = 8;

/// AVX2 rectangle of a quantized matmul.
///
/// # Safety
/// The CPU supports AVX2 + F16C; otherwise as for `avx512::quant_rect`.
pub(crate) unsafe fn quant_rect(
    dtype: GgmlType,
    data: &[u8],
    row_bytes: usize,
    act: &ActBlocks<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        match dtype {
            GgmlType::Q4_0 => rect::<Q40>(data, row_bytes, act, rows, tokens, out),
            GgmlType::Q4_1 => rect::<Q41>(data, row_bytes, act, rows, tokens, out),
            GgmlType::Q8_0 => rect::<Q80>(data, row_bytes, act, rows, tokens, out),
            _ => unreachable!("no AVX2 kernel for {dtype}"),
        }
    }
}

/// Walks the rectangle in groups of 8 rows × token tiles of 4, 2, 1; leftover rows take the
/// scalar path, which computes the same bits.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rect<F: BlockFormat>(
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
            // SAFETY: rows r..r+8 and tokens t..t+tile are inside the caller's rectangle
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
                    4.. => group::<F, 4>(w, next, row_bytes, nb, act, t, o, s),
                    2.. => group::<F, 2>(w, next, row_bytes, nb, act, t, o, s),
                    _ => group::<F, 1>(w, next, row_bytes, nb, act, t, o, s),
                };
            }
        }
    }
    if simd_end < rows.end {
        // SAFETY: forwarded to the caller.
        unsafe { scalar::quant_rect::<F>(data, row_bytes, act, simd_end..rows.end, tokens, out) };
    }
}

/// Two 16-byte loads into the two 128-bit lanes of a vector.
#[inline(always)]
unsafe fn load2(p0: *const u8, p1: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at each pointer.
    unsafe { _mm256_loadu2_m128i(p1 as *const __m128i, p0 as *const __m128i) }
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

/// Lane `4L + k` of the result is dword 0 of 128-bit lane `L` of `a[k]`.
#[inline(always)]
unsafe fn first_dwords(a: [__m256i; 4]) -> __m256i {
    let t0 = _mm256_unpacklo_epi32(a[0], a[1]);
    let t1 = _mm256_unpacklo_epi32(a[2], a[3]);
    _mm256_unpacklo_epi64(t0, t1)
}

/// Lane `4L + k` of the result is the sum of the four i32 in 128-bit lane `L` of `p[k]`.
#[inline(always)]
unsafe fn transpose_sum(p: [__m256i; 4]) -> __m256i {
    let t0 = _mm256_add_epi32(
        _mm256_unpacklo_epi32(p[0], p[1]),
        _mm256_unpackhi_epi32(p[0], p[1]),
    );
    let t1 = _mm256_add_epi32(
        _mm256_unpacklo_epi32(p[2], p[3]),
        _mm256_unpackhi_epi32(p[2], p[3]),
    );
    _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1))
}

/// 8 rows × `T` tokens (contract as `avx512::group`, with 8 rows). Returns `T`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group<F: BlockFormat, const T: usize>(
    w: *const u8,
    next: *const u8,
    row_bytes: usize,
    nb: usize,
    act: &ActBlocks<'_>,
    t0: usize,
    out: *mut f32,
    out_stride: usize,
) -> usize {
    let zero = _mm256_setzero_si256();
    let nibble_mask = _mm256_set1_epi8(0x0f);
    let low16 = _mm256_set1_epi32(0xffff);
    let ones16 = _mm256_set1_epi16(1);
    let bpt = act.blocks_per_token;
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        // SAFETY: as in `avx512::group`.
        unsafe {
            let blk = w.add(b * F::BLOCK_BYTES);
            if !next.is_null() {
                prefetch_slice(next, b, GROUP * F::BLOCK_BYTES);
            }
            // d and m of the 8 rows: the first dword of each row's block (loads and shuffles
            // rather than a gather, which is slow on many CPUs).
            let head = |k: usize| load2(blk.add(k * row_bytes), blk.add((4 + k) * row_bytes));
            let dm = first_dwords([head(0), head(1), head(2), head(3)]);
            // [d0..3 m0..3 | d4..7 m4..7] as u16, then [d0..7 | m0..7].
            let packed =
                _mm256_packus_epi32(_mm256_and_si256(dm, low16), _mm256_srli_epi32::<16>(dm));
            let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
            let dw = _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
            let m = if F::HAS_MIN {
                _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(packed))
            } else {
                _mm256_setzero_ps()
            };
            // Quad k holds rows k and 4+k, so `transpose_sum` puts row i in lane i.
            let qs = blk.add(F::QS_OFFSET);
            let row = |k: usize, l: usize| qs.add((4 * l + k) * row_bytes);
            let mut low = [zero; 4];
            let mut high = [zero; 4];
            for k in 0..4 {
                if F::NIBBLES {
                    let v = load2(row(k, 0), row(k, 1));
                    low[k] = _mm256_and_si256(v, nibble_mask);
                    high[k] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble_mask);
                } else {
                    // Signed codes; made unsigned per token with the sign trick below.
                    low[k] = load2(row(k, 0), row(k, 1));
                    high[k] = load2(row(k, 0).add(16), row(k, 1).add(16));
                }
            }
            for (t, acc_t) in acc.iter_mut().enumerate() {
                let i = (t0 + t) * bpt + b;
                let a = act.qs.as_ptr().add(i * QK) as *const __m128i;
                let a_low = _mm256_broadcastsi128_si256(_mm_loadu_si128(a));
                let a_high = _mm256_broadcastsi128_si256(_mm_loadu_si128(a.add(1)));
                let mut partial = [zero; 4];
                for k in 0..4 {
                    partial[k] = if F::NIBBLES {
                        let p = _mm256_add_epi16(
                            _mm256_maddubs_epi16(low[k], a_low),
                            _mm256_maddubs_epi16(high[k], a_high),
                        );
                        _mm256_madd_epi16(p, ones16)
                    } else {
                        // |w| × (a with w's sign): pair sums ≤ 2·128·127 fit i16.
                        let pl = _mm256_maddubs_epi16(
                            _mm256_sign_epi8(low[k], low[k]),
                            _mm256_sign_epi8(a_low, low[k]),
                        );
                        let ph = _mm256_maddubs_epi16(
                            _mm256_sign_epi8(high[k], high[k]),
                            _mm256_sign_epi8(a_high, high[k]),
                        );
                        _mm256_add_epi32(
                            _mm256_madd_epi16(pl, ones16),
                            _mm256_madd_epi16(ph, ones16),
                        )
                    };
                }
                let mut isum = transpose_sum(partial);
                if F::NIBBLES && F::ZERO != 0 {
                    let offset = F::ZERO * *act.qsum.get_unchecked(i);
                    isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(offset));
                }
                let da = _mm256_set1_ps(*act.scale.get_unchecked(i));
                let mut term = _mm256_mul_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(isum));
                if F::HAS_MIN {
                    let s = _mm256_set1_ps(*act.scaled_sum.get_unchecked(i));
                    term = _mm256_add_ps(term, _mm256_mul_ps(m, s));
                }
                *acc_t = _mm256_add_ps(*acc_t, term);
            }
        }
    }
    for (t, acc_t) in acc.iter().enumerate() {
        // SAFETY: 8 writable floats at each token stride (caller).
        unsafe { _mm256_storeu_ps(out.add(t * out_stride), *acc_t) };
    }
    T
}

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

/// Canonical 16-lane float dot product with two 8-lane accumulators (lanes 0..7, 8..15).
#[inline(always)]
unsafe fn float_dot(f16: bool, w: *const u8, x: *const f32, cols: usize) -> f32 {
    let load_w = |p: *const u8| {
        // SAFETY: 8 elements readable at p (callers below).
        unsafe {
            if f16 {
                _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
            } else {
                _mm256_loadu_ps(p as *const f32)
            }
        }
    };
    let elem = if f16 { 2 } else { 4 };
    let full = cols / 16 * 16;
    let mut acc_low = _mm256_setzero_ps();
    let mut acc_high = _mm256_setzero_ps();
    // SAFETY: as in `avx512::float_dot`.
    unsafe {
        let mut step = |w16: *const u8, x16: *const f32| {
            acc_low = _mm256_add_ps(acc_low, _mm256_mul_ps(load_w(w16), _mm256_loadu_ps(x16)));
            let (w8, x8) = (w16.add(8 * elem), x16.add(8));
            acc_high = _mm256_add_ps(acc_high, _mm256_mul_ps(load_w(w8), _mm256_loadu_ps(x8)));
        };
        for i in (0..full).step_by(16) {
            step(w.add(i * elem), x.add(i));
        }
        if full < cols {
            let n = cols - full;
            let mut wt = [0u8; 64];
            let mut xt = [0.0f32; 16];
            std::ptr::copy_nonoverlapping(w.add(full * elem), wt.as_mut_ptr(), n * elem);
            std::ptr::copy_nonoverlapping(x.add(full), xt.as_mut_ptr(), n);
            step(wt.as_ptr(), xt.as_ptr());
        }
        let s8 = _mm256_add_ps(acc_low, acc_high);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }
}

/// AVX2 version of `activation::quantize_blocks` (same operations, same bits).
///
/// # Safety
/// The CPU supports AVX2; lengths as for `avx512::quantize_blocks`.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn quantize_blocks(
    x: &[f32],
    qs: &mut [i8],
    scale: &mut [f32],
    scaled_sum: &mut [f32],
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
        let (xb, qb) = (&x[b * QK..(b + 1) * QK], &mut qs[b * QK..(b + 1) * QK]);
        // SAFETY: 32 floats readable in `xb`, 32 bytes writable in `qb`.
        unsafe {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xb.as_ptr().add(8 * i)));
            let bits = |i: usize| _mm256_and_si256(_mm256_castps_si256(v[i]), abs_mask);
            let amax = _mm256_max_epu32(
                _mm256_max_epu32(bits(0), bits(1)),
                _mm256_max_epu32(bits(2), bits(3)),
            );
            let Some((d, id)) = block_scale(hmax(amax)) else {
                (scale[b], scaled_sum[b], qsum[b]) = quantize_block(xb, qb);
                continue;
            };
            let id = _mm256_set1_ps(id);
            let r: [__m256i; 4] = std::array::from_fn(|i| {
                let m = _mm256_add_ps(_mm256_mul_ps(v[i], id), magic);
                _mm256_sub_epi32(_mm256_castps_si256(m), magic_bits)
            });
            let packed = _mm256_packs_epi16(
                _mm256_packs_epi32(r[0], r[1]),
                _mm256_packs_epi32(r[2], r[3]),
            );
            let packed = _mm256_permutevar8x32_epi32(packed, order);
            _mm256_storeu_si256(qb.as_mut_ptr() as *mut __m256i, packed);
            let sum = hsum(_mm256_add_epi32(
                _mm256_add_epi32(r[0], r[1]),
                _mm256_add_epi32(r[2], r[3]),
            ));
            (scale[b], scaled_sum[b], qsum[b]) = (d, d * sum as f32, sum);
        }
    }
}
