//! The portable scalar kernels. They *define* the canonical arithmetic every SIMD path
//! reproduces bit for bit (see the module docs of `quant`):
//!
//! - 32-element formats: per (row, token), `acc = 0.0; for each block b in order:
//!   acc = acc + term_b` with `term_b = (dw·da)·(isum as f32)` (+ `m·s` for Q4_1/Q5_1), where
//!   `isum = Σ u·a − zero·Σa` is the block's exact integer dot product (for a refined input's
//!   16-bit codes `a = 256·hi + lo`: `256·Σ u·hi + Σ u·lo − zero·Σa`);
//! - k-quants: per (row, token), `acc = acc + term_b` over the super-blocks with
//!   `term_b = (d·da)·(isum as f32)` (− `(dmin·da)·(msum as f32)` for the min formats), where
//!   `isum = Σ_g s_g·(Σ_{i∈g} u_i·a_i − zero·Σ_{i∈g} a_i)` and `msum = Σ_g m_g·Σ_{i∈g} a_i`
//!   are exact integers over the groups `g`;
//! - float weights: 16 lane accumulators, element `i` into lane `i mod 16` with
//!   `lane = lane + w·x`, then the fixed tree `lane[i] += lane[i + h]` for h = 8, 4, 2, 1.
//!
//! No fused multiply-add anywhere: plain IEEE products and sums are the same on every ISA.

use std::ops::Range;

use super::activation::{ActBlocks, SuperActBlocks};
use super::format::{f16_at, BlockFormat};
use super::kernel::OutPtr;
use super::kquant::{SuperBlockFormat, QK_K};

/// Exact integer dot product of one weight block with one activation block, including the
/// format's zero point (`Σ (u − zero)·a = Σ u·a − zero·Σa`).
#[inline(always)]
pub(crate) fn block_isum<F: BlockFormat>(blk: &[u8], a: &[i8], a_sum: i32) -> i32 {
    let dot: i32 = F::codes(blk)
        .iter()
        .zip(a)
        .map(|(&u, &v)| u as i32 * v as i32)
        .sum();
    dot - F::ZERO * a_sum
}

/// The canonical f32 contribution of one block: `(dw·da)·isum (+ m·s)`.
#[inline(always)]
pub(crate) fn block_term<F: BlockFormat>(dw: f32, m: f32, da: f32, s: f32, isum: i32) -> f32 {
    let t = (dw * da) * isum as f32;
    if F::HAS_MIN {
        t + m * s
    } else {
        t
    }
}

/// Exact integer dot product of one weight block with the wide codes `256·hi + lo` of one
/// activation block, including the zero point (`a_sum` is `Σ(256·hi + lo)`).
#[inline(always)]
pub(crate) fn wide_block_isum<F: BlockFormat>(blk: &[u8], hi: &[i8], lo: &[i8], a_sum: i32) -> i32 {
    let codes = F::codes(blk);
    let dot = |a: &[i8]| -> i32 {
        codes
            .iter()
            .zip(a)
            .map(|(&u, &v)| u as i32 * v as i32)
            .sum()
    };
    256 * dot(hi) + dot(lo) - F::ZERO * a_sum
}

/// Canonical dot product of one quantized weight row with token `t` of `act`.
#[inline]
pub(crate) fn quant_row_dot<F: BlockFormat>(row: &[u8], act: &ActBlocks<'_>, t: usize) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(F::BLOCK_BYTES).enumerate() {
        let i = act.index(t, b);
        let dw = f16_at(blk);
        let m = if F::HAS_MIN { f16_at(&blk[2..]) } else { 0.0 };
        let isum = if act.is_wide() {
            wide_block_isum::<F>(blk, act.block(t, b), act.lo_block(t, b), act.qsum[i])
        } else {
            block_isum::<F>(blk, act.block(t, b), act.qsum[i])
        };
        acc += block_term::<F>(dw, m, act.scale[i], act.scaled_sum[i], isum);
    }
    acc
}

/// Scalar computation of `out[t, r]` for a rectangle of rows × tokens.
///
/// # Safety
/// `out` must be valid for writes at `t·stride + r` for every `r` in `rows`, `t` in
/// `tokens`, and no other thread may access those elements meanwhile.
pub(crate) unsafe fn quant_rect<F: BlockFormat>(
    data: &[u8],
    row_bytes: usize,
    act: &ActBlocks<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    for r in rows {
        let row = &data[r * row_bytes..(r + 1) * row_bytes];
        for t in tokens.clone() {
            // SAFETY: (t, r) lies in the rectangle the caller owns.
            unsafe { out.write(t, r, quant_row_dot::<F>(row, act, t)) };
        }
    }
}

/// The canonical f32 contribution of one super-block: `(d·da)·isum (− (dmin·da)·msum)`.
#[inline(always)]
pub(crate) fn super_block_term<F: SuperBlockFormat>(
    d: f32,
    dmin: f32,
    da: f32,
    isum: i32,
    msum: i32,
) -> f32 {
    let t = (d * da) * isum as f32;
    if F::HAS_MIN {
        t - (dmin * da) * msum as f32
    } else {
        t
    }
}

/// The activation sums of super-block `i` per group of `F` (16 or 32 elements).
#[inline(always)]
pub(crate) fn group_sums<'a, F: SuperBlockFormat>(act: &SuperActBlocks<'a>, i: usize) -> &'a [i16] {
    if F::GROUP == 16 {
        &act.sums16[i * 16..(i + 1) * 16]
    } else {
        &act.sums32[i * 8..(i + 1) * 8]
    }
}

/// Canonical dot product of one k-quant weight row with token `t` of `act`.
#[inline]
pub(crate) fn super_row_dot<F: SuperBlockFormat>(
    row: &[u8],
    act: &SuperActBlocks<'_>,
    t: usize,
) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(F::BLOCK_BYTES).enumerate() {
        let i = act.index(t, b);
        let a = &act.qs[i * QK_K..(i + 1) * QK_K];
        let sums = group_sums::<F>(act, i);
        let codes = F::codes(blk);
        let (scales, mins) = F::scales_mins(blk);
        let (mut isum, mut msum) = (0i32, 0i32);
        for g in 0..F::GROUPS {
            let span = g * F::GROUP..(g + 1) * F::GROUP;
            let dot: i32 = codes[span.clone()]
                .iter()
                .zip(&a[span])
                .map(|(&u, &v)| u as i32 * v as i32)
                .sum();
            let a_sum = sums[g] as i32;
            isum += scales[g] * (dot - F::ZERO * a_sum);
            msum += mins[g] * a_sum;
        }
        let d = f16_at(&blk[F::D_OFFSET..]);
        let dmin = if F::HAS_MIN {
            f16_at(&blk[F::D_OFFSET + 2..])
        } else {
            0.0
        };
        acc += super_block_term::<F>(d, dmin, act.scale[i], isum, msum);
    }
    acc
}

/// Scalar k-quant rectangle (same contract as [`quant_rect`]).
///
/// # Safety
/// As for [`quant_rect`].
pub(crate) unsafe fn super_rect<F: SuperBlockFormat>(
    data: &[u8],
    row_bytes: usize,
    act: &SuperActBlocks<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    for r in rows {
        let row = &data[r * row_bytes..(r + 1) * row_bytes];
        for t in tokens.clone() {
            // SAFETY: (t, r) lies in the rectangle the caller owns.
            unsafe { out.write(t, r, super_row_dot::<F>(row, act, t)) };
        }
    }
}

/// Lanes of the canonical float dot product.
pub(crate) const FLOAT_LANES: usize = 16;

/// The canonical lane-tree reduction of the float dot product.
#[inline(always)]
pub(crate) fn reduce_lanes(mut lanes: [f32; FLOAT_LANES]) -> f32 {
    let mut half = FLOAT_LANES / 2;
    while half > 0 {
        for i in 0..half {
            lanes[i] += lanes[i + half];
        }
        half /= 2;
    }
    lanes[0]
}

/// Canonical dot product of a float weight row (F32 or F16 bytes) with `x`.
#[inline]
pub(crate) fn float_row_dot(f16: bool, row: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; FLOAT_LANES];
    if f16 {
        for (i, (w, &v)) in row.chunks_exact(2).zip(x).enumerate() {
            lanes[i % FLOAT_LANES] += f16_at(w) * v;
        }
    } else {
        for (i, (w, &v)) in row.chunks_exact(4).zip(x).enumerate() {
            lanes[i % FLOAT_LANES] += f32::from_le_bytes([w[0], w[1], w[2], w[3]]) * v;
        }
    }
    reduce_lanes(lanes)
}

/// Scalar float-weight rectangle (same contract as [`quant_rect`]).
///
/// # Safety
/// As for [`quant_rect`].
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
        let row = &data[r * row_bytes..(r + 1) * row_bytes];
        for t in tokens.clone() {
            let v = float_row_dot(f16, row, &x[t * cols..(t + 1) * cols]);
            // SAFETY: (t, r) lies in the rectangle the caller owns.
            unsafe { out.write(t, r, v) };
        }
    }
}
