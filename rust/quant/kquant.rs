//! The k-quants: 256-element super-blocks of 16 or 8 groups, each group with its own
//! integer scale (and min), under one or two f16 super-block scales (ggml-common.h).
//!
//! Every format is read as unsigned codes `u` per element and integer scales per group:
//! value `(d·s_g)·(u − ZERO)` for the symmetric formats (`Q3_K`: `s_g` = 6-bit − 32, `Q6_K`:
//! `s_g` = i8), `(d·s_g)·u − dmin·m_g` for the min formats (`Q2_K`, `Q4_K`, `Q5_K`), exactly
//! the products ggml and gguf-py dequantize with.

use super::format::{f16_at, f16_bytes, GgmlType};

/// Elements per super-block (ggml `QK_K`).
pub const QK_K: usize = 256;

/// `Q2_K`: `{ scales: [u8; 16] (scale | min << 4), qs: [u8; 64], d: f16, dmin: f16 }`.
pub(crate) const Q2_K_BLOCK_BYTES: usize = 84;
/// `Q3_K`: `{ hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16 }`.
pub(crate) const Q3_K_BLOCK_BYTES: usize = 110;
/// `Q4_K`: `{ d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128] }`.
pub(crate) const Q4_K_BLOCK_BYTES: usize = 144;
/// `Q5_K`: `{ d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128] }`.
pub(crate) const Q5_K_BLOCK_BYTES: usize = 176;
/// `Q6_K`: `{ ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16 }`.
pub(crate) const Q6_K_BLOCK_BYTES: usize = 210;

/// Compile-time description of a k-quant layout, shared by every kernel.
pub(crate) trait SuperBlockFormat {
    /// The ggml type.
    const DTYPE: GgmlType;
    /// Bytes per super-block.
    const BLOCK_BYTES: usize;
    /// Elements per group (16 or 32); every group has its own scale (and min).
    const GROUP: usize;
    /// Whether the groups carry mins: value `(d·s)·u − dmin·m`.
    const HAS_MIN: bool;
    /// Zero point subtracted from the unsigned codes (symmetric formats).
    const ZERO: i32;
    /// Offset of the f16 `d` (and `dmin` right after it, for the min formats).
    const D_OFFSET: usize;

    /// Groups per super-block.
    const GROUPS: usize = QK_K / Self::GROUP;

    /// The unsigned codes of super-block `blk`, in element order.
    fn codes(blk: &[u8]) -> [u8; QK_K];

    /// The integer scales and mins (zero for symmetric formats) of the groups; only the
    /// first [`Self::GROUPS`] entries are used.
    fn scales_mins(blk: &[u8]) -> ([i32; 16], [i32; 16]);

    /// Writes codes, scales and mins into `blk` (the inverse of the two above).
    fn pack(u: &[u8; QK_K], scales: &[i32], mins: &[i32], blk: &mut [u8]);
}

/// Evaluates `$body` with the type alias `$F` bound to the layout of the k-quant `$dtype`
/// (`Q2K` … `Q6K`): the one place that maps these ggml types to layouts.
macro_rules! with_k_format {
    ($dtype:expr, $F:ident => $body:expr) => {{
        use $crate::quant::kquant as layouts;
        match $dtype {
            $crate::quant::GgmlType::Q2_K => {
                type $F = layouts::Q2K;
                $body
            }
            $crate::quant::GgmlType::Q3_K => {
                type $F = layouts::Q3K;
                $body
            }
            $crate::quant::GgmlType::Q4_K => {
                type $F = layouts::Q4K;
                $body
            }
            $crate::quant::GgmlType::Q5_K => {
                type $F = layouts::Q5K;
                $body
            }
            $crate::quant::GgmlType::Q6_K => {
                type $F = layouts::Q6K;
                $body
            }
            other => unreachable!("{other} is not a k-quant"),
        }
    }};
}
pub(crate) use with_k_format;

/// `Q2_K` layout.
pub(crate) struct Q2K;
/// `Q3_K` layout.
pub(crate) struct Q3K;
/// `Q4_K` layout.
pub(crate) struct Q4K;
/// `Q5_K` layout.
pub(crate) struct Q5K;
/// `Q6_K` layout.
pub(crate) struct Q6K;

/// The 2-bit fields of `Q2_K`/`Q3_K` (and the low nibbles of `Q6_K`'s 4+2 split): element
/// `e` sits in byte `32·(e / 128) + e % 32` of its 64-byte field, at bit `2·((e % 128) / 32)`.
#[inline(always)]
fn crumb_position(e: usize) -> (usize, u32) {
    (32 * (e / 128) + e % 32, 2 * ((e % 128) / 32) as u32)
}

/// 4-bit codes of `Q4_K`/`Q5_K`: element `e` sits in byte `32·(e / 64) + e % 32`, in the low
/// nibble for the first 32 of each 64, the high nibble for the second.
#[inline(always)]
fn nibble_position(e: usize) -> (usize, u32) {
    (32 * (e / 64) + e % 32, 4 * ((e % 64) / 32) as u32)
}

/// Group `j`'s 6-bit scale and min of `Q4_K`/`Q5_K` (ggml's `get_scale_min_k4`): groups 0..3
/// in the low 6 bits of bytes 0..3 and 4..7, groups 4..7 as nibbles of bytes 8..11 with their
/// top two bits in the top bits of bytes 0..7.
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (i32, i32) {
    if j < 4 {
        ((q[j] & 63) as i32, (q[j + 4] & 63) as i32)
    } else {
        (
            ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4)) as i32,
            ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as i32,
        )
    }
}

fn pack_scale_min_k4(scales: &[i32], mins: &[i32], q: &mut [u8]) {
    q[..12].fill(0);
    for j in 0..8 {
        let (s, m) = (scales[j] as u8, mins[j] as u8);
        if j < 4 {
            q[j] |= s & 63;
            q[j + 4] |= m & 63;
        } else {
            q[j + 4] = (s & 0x0f) | ((m & 0x0f) << 4);
            q[j - 4] |= (s >> 4) << 6;
            q[j] |= (m >> 4) << 6;
        }
    }
}

impl SuperBlockFormat for Q2K {
    const DTYPE: GgmlType = GgmlType::Q2_K;
    const BLOCK_BYTES: usize = Q2_K_BLOCK_BYTES;
    const GROUP: usize = 16;
    const HAS_MIN: bool = true;
    const ZERO: i32 = 0;
    const D_OFFSET: usize = 80;

    fn codes(blk: &[u8]) -> [u8; QK_K] {
        let qs = &blk[16..80];
        std::array::from_fn(|e| {
            let (byte, shift) = crumb_position(e);
            (qs[byte] >> shift) & 3
        })
    }

    fn scales_mins(blk: &[u8]) -> ([i32; 16], [i32; 16]) {
        (
            std::array::from_fn(|g| (blk[g] & 0x0f) as i32),
            std::array::from_fn(|g| (blk[g] >> 4) as i32),
        )
    }

    fn pack(u: &[u8; QK_K], scales: &[i32], mins: &[i32], blk: &mut [u8]) {
        for g in 0..16 {
            blk[g] = scales[g] as u8 | ((mins[g] as u8) << 4);
        }
        blk[16..80].fill(0);
        for (e, &v) in u.iter().enumerate() {
            let (byte, shift) = crumb_position(e);
            blk[16 + byte] |= v << shift;
        }
    }
}

impl SuperBlockFormat for Q3K {
    const DTYPE: GgmlType = GgmlType::Q3_K;
    const BLOCK_BYTES: usize = Q3_K_BLOCK_BYTES;
    const GROUP: usize = 16;
    const HAS_MIN: bool = false;
    // ggml stores `q = low2 − (hbit ? 0 : 4)`, that is `u − 4` with `u = low2 + 4·hbit`.
    const ZERO: i32 = 4;
    const D_OFFSET: usize = 108;

    fn codes(blk: &[u8]) -> [u8; QK_K] {
        let (hmask, qs) = (&blk[..32], &blk[32..96]);
        std::array::from_fn(|e| {
            let (byte, shift) = crumb_position(e);
            let high = (hmask[e % 32] >> (e / 32)) & 1;
            ((qs[byte] >> shift) & 3) | (high << 2)
        })
    }

    /// Scale `g` is 6 bits: its low nibble in byte `g % 8` (low nibble for g < 8, high
    /// otherwise), its top two bits in byte `8 + g % 4` at bit `2·(g / 4)`; the value is −32.
    fn scales_mins(blk: &[u8]) -> ([i32; 16], [i32; 16]) {
        let s = &blk[96..108];
        let scales = std::array::from_fn(|g| {
            let low = (s[g % 8] >> (4 * (g / 8))) & 0x0f;
            let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
            (low | (high << 4)) as i32 - 32
        });
        (scales, [0; 16])
    }

    fn pack(u: &[u8; QK_K], scales: &[i32], _mins: &[i32], blk: &mut [u8]) {
        blk[..108].fill(0);
        for (e, &v) in u.iter().enumerate() {
            let (byte, shift) = crumb_position(e);
            blk[32 + byte] |= (v & 3) << shift;
            blk[e % 32] |= (v >> 2) << (e / 32);
        }
        for (g, &sc) in scales.iter().enumerate() {
            let s6 = (sc + 32) as u8;
            blk[96 + g % 8] |= (s6 & 0x0f) << (4 * (g / 8));
            blk[96 + 8 + g % 4] |= (s6 >> 4) << (2 * (g / 4));
        }
    }
}

impl SuperBlockFormat for Q4K {
    const DTYPE: GgmlType = GgmlType::Q4_K;
    const BLOCK_BYTES: usize = Q4_K_BLOCK_BYTES;
    const GROUP: usize = 32;
    const HAS_MIN: bool = true;
    const ZERO: i32 = 0;
    const D_OFFSET: usize = 0;

    fn codes(blk: &[u8]) -> [u8; QK_K] {
        let qs = &blk[16..144];
        std::array::from_fn(|e| {
            let (byte, shift) = nibble_position(e);
            (qs[byte] >> shift) & 0x0f
        })
    }

    fn scales_mins(blk: &[u8]) -> ([i32; 16], [i32; 16]) {
        let (mut scales, mut mins) = ([0; 16], [0; 16]);
        for j in 0..8 {
            (scales[j], mins[j]) = scale_min_k4(j, &blk[4..16]);
        }
        (scales, mins)
    }

    fn pack(u: &[u8; QK_K], scales: &[i32], mins: &[i32], blk: &mut [u8]) {
        pack_scale_min_k4(scales, mins, &mut blk[4..16]);
        blk[16..144].fill(0);
        for (e, &v) in u.iter().enumerate() {
            let (byte, shift) = nibble_position(e);
            blk[16 + byte] |= v << shift;
        }
    }
}

impl SuperBlockFormat for Q5K {
    const DTYPE: GgmlType = GgmlType::Q5_K;
    const BLOCK_BYTES: usize = Q5_K_BLOCK_BYTES;
    const GROUP: usize = 32;
    const HAS_MIN: bool = true;
    const ZERO: i32 = 0;
    const D_OFFSET: usize = 0;

    fn codes(blk: &[u8]) -> [u8; QK_K] {
        let (qh, qs) = (&blk[16..48], &blk[48..176]);
        std::array::from_fn(|e| {
            let (byte, shift) = nibble_position(e);
            ((qs[byte] >> shift) & 0x0f) | (((qh[e % 32] >> (e / 32)) & 1) << 4)
        })
    }

    fn scales_mins(blk: &[u8]) -> ([i32; 16], [i32; 16]) {
        Q4K::scales_mins(blk)
    }

    fn pack(u: &[u8; QK_K], scales: &[i32], mins: &[i32], blk: &mut [u8]) {
        pack_scale_min_k4(scales, mins, &mut blk[4..16]);
        blk[16..176].fill(0);
        for (e, &v) in u.iter().enumerate() {
            let (byte, shift) = nibble_position(e);
            blk[48 + byte] |= (v & 0x0f) << shift;
            blk[16 + e % 32] |= (v >> 4) << (e / 32);
        }
    }
}

/// `Q6_K` element `e`: its low nibble in `ql[64·(e / 128) + 32·(q % 2) + e % 32]` (high
/// nibble when `q = (e % 128) / 32` is 2 or 3), its top two bits in `qh[32·(e / 128) + e % 32]`
/// at bit `2q`.
#[inline(always)]
fn q6k_position(e: usize) -> (usize, u32, usize, u32) {
    let q = (e % 128) / 32;
    let (h, l) = (e / 128, e % 32);
    (
        64 * h + 32 * (q % 2) + l,
        4 * (q / 2) as u32,
        32 * h + l,
        2 * q as u32,
    )
}

impl SuperBlockFormat for Q6K {
    const DTYPE: GgmlType = GgmlType::Q6_K;
    const BLOCK_BYTES: usize = Q6_K_BLOCK_BYTES;
    const GROUP: usize = 16;
    const HAS_MIN: bool = false;
    const ZERO: i32 = 32;
    const D_OFFSET: usize = 208;

    fn codes(blk: &[u8]) -> [u8; QK_K] {
        let (ql, qh) = (&blk[..128], &blk[128..192]);
        std::array::from_fn(|e| {
            let (lo_byte, lo_shift, hi_byte, hi_shift) = q6k_position(e);
            ((ql[lo_byte] >> lo_shift) & 0x0f) | (((qh[hi_byte] >> hi_shift) & 3) << 4)
        })
    }

    fn scales_mins(blk: &[u8]) -> ([i32; 16], [i32; 16]) {
        (std::array::from_fn(|g| blk[192 + g] as i8 as i32), [0; 16])
    }

    fn pack(u: &[u8; QK_K], scales: &[i32], _mins: &[i32], blk: &mut [u8]) {
        blk[..192].fill(0);
        for (e, &v) in u.iter().enumerate() {
            let (lo_byte, lo_shift, hi_byte, hi_shift) = q6k_position(e);
            blk[lo_byte] |= (v & 0x0f) << lo_shift;
            blk[128 + hi_byte] |= (v >> 4) << hi_shift;
        }
        for (g, &sc) in scales.iter().enumerate() {
            blk[192 + g] = sc as i8 as u8;
        }
    }
}

/// Dequantizes one row of `F` exactly as ggml does: `(d·s)·(u − zero)` or `(d·s)·u − dmin·m`
/// (products, then a difference; never fused).
fn dequantize_blocks<F: SuperBlockFormat>(row: &[u8], out: &mut [f32]) {
    for (o, blk) in out
        .chunks_exact_mut(QK_K)
        .zip(row.chunks_exact(F::BLOCK_BYTES))
    {
        let d = f16_at(&blk[F::D_OFFSET..]);
        let codes = F::codes(blk);
        let (scales, mins) = F::scales_mins(blk);
        for (g, (og, ug)) in o
            .chunks_exact_mut(F::GROUP)
            .zip(codes.chunks_exact(F::GROUP))
            .enumerate()
        {
            let dl = d * scales[g] as f32;
            if F::HAS_MIN {
                let ml = f16_at(&blk[F::D_OFFSET + 2..]) * mins[g] as f32;
                for (v, &u) in og.iter_mut().zip(ug) {
                    *v = dl * u as f32 - ml;
                }
            } else {
                for (v, &u) in og.iter_mut().zip(ug) {
                    *v = dl * (u as i32 - F::ZERO) as f32;
                }
            }
        }
    }
}

pub(crate) fn dequantize_row(dtype: GgmlType, row: &[u8], out: &mut [f32]) {
    with_k_format!(dtype, F => dequantize_blocks::<F>(row, out))
}

/// `round(v / step)` clamped to `lo..=hi`, or `lo.max(0)` … `fallback` when `step` is 0.
fn quantize_value(v: f32, step: f32, lo: i32, hi: i32, fallback: i32) -> i32 {
    if step == 0.0 {
        fallback
    } else {
        ((v / step).round() as i32).clamp(lo, hi)
    }
}

/// A simple k-quant quantizer, good for synthetic weights (ggml's search over candidate
/// scales is more accurate; this one is a plain min/max fit). Min formats: each group's range
/// `[min(0, lo), hi]` over the codes, group scales and mins quantized against the largest.
/// Symmetric formats: each group's value of largest magnitude on the most negative code, the
/// signed group scales quantized against the largest magnitude.
fn quantize_blocks<F: SuperBlockFormat>(src: &[f32], out: &mut [u8]) {
    let (code_max, scale_max) = match F::DTYPE {
        GgmlType::Q2_K => (3, 15),
        GgmlType::Q3_K => (7, 31),
        GgmlType::Q4_K => (15, 63),
        GgmlType::Q5_K => (31, 63),
        _ => (63, 127),
    };
    for (blk, x) in out
        .chunks_exact_mut(F::BLOCK_BYTES)
        .zip(src.chunks_exact(QK_K))
    {
        let groups = F::GROUPS;
        let mut step = [0.0f32; 16];
        let mut offset = [0.0f32; 16];
        for (g, xg) in x.chunks_exact(F::GROUP).enumerate() {
            if F::HAS_MIN {
                let lo = xg.iter().copied().fold(0.0f32, f32::min);
                let hi = xg.iter().copied().fold(lo, f32::max);
                step[g] = (hi - lo) / code_max as f32;
                offset[g] = -lo;
            } else {
                let extreme =
                    xg.iter()
                        .copied()
                        .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
                step[g] = extreme / -(F::ZERO as f32);
            }
        }
        let largest = |v: &[f32]| v.iter().fold(0.0f32, |m, s| m.max(s.abs()));
        let d = half::f16::from_f32(largest(&step[..groups]) / scale_max as f32).to_f32();
        let dmin = half::f16::from_f32(largest(&offset[..groups]) / scale_max as f32).to_f32();
        let lowest_scale = if F::HAS_MIN { 0 } else { -scale_max };
        let scales: Vec<i32> = step[..groups]
            .iter()
            .map(|&s| quantize_value(s, d, lowest_scale, scale_max, 0))
            .collect();
        let mins: Vec<i32> = offset[..groups]
            .iter()
            .map(|&m| quantize_value(m, dmin, 0, scale_max, 0))
            .collect();
        let mut u = [0u8; QK_K];
        for (e, (v, &xe)) in u.iter_mut().zip(x).enumerate() {
            let g = e / F::GROUP;
            let group_step = d * scales[g] as f32;
            let shifted = xe + dmin * mins[g] as f32;
            let q = quantize_value(shifted, group_step, -F::ZERO, code_max - F::ZERO, 0);
            *v = (q + F::ZERO) as u8;
        }
        F::pack(&u, &scales, &mins, blk);
        blk[F::D_OFFSET..F::D_OFFSET + 2].copy_from_slice(&f16_bytes(d));
        if F::HAS_MIN {
            blk[F::D_OFFSET + 2..F::D_OFFSET + 4].copy_from_slice(&f16_bytes(dmin));
        }
    }
}

pub(crate) fn quantize_row(dtype: GgmlType, src: &[f32], out: &mut [u8]) {
    with_k_format!(dtype, F => quantize_blocks::<F>(src, out))
}
