//! The portable scalar kernels. They *define* the canonical arithmetic every SIMD path
//! reproduces bit for bit (see the module docs of `quant`):
//!
//! - quantized weights: per (row, token), `acc = 0.0; for each block b in order:
//!   acc = acc + term_b` with `term_b = (dw·da)·(isum as f32)` (+ `m·s` for Q4_1), where
//!   `isum` is the block's exact integer dot product (offset-corrected for Q4_0);
//! - float weights: 16 lane accumulators, element `i` into lane `i mod 16` with
//!   `lane = lane + w·x`, then the fixed tree `lane[i] += lane[i + h]` for h = 8, 4, 2, 1.
//!
//! No fused multiply-add anywhere: plain IEEE products and sums are the same on every ISA.

use std::ops::Range;

use super::activation::ActBlocks;
use super::format::{f16_at, QK};
use super::kernel::{BlockFormat, OutPtr};

/// Exact integer dot product of one weight block's codes with one activation block,
/// including the format's zero-point offset (`Σ (q − zero)·a = Σ q·a − zero·Σa`).
#[inline(always)]
pub(crate) fn block_isum<F: BlockFormat>(qs: &[u8], a: &[i8], a_sum: i32) -> i32 {
    let dot: i32 = if F::NIBBLES {
        let (a_low, a_high) = a.split_at(QK / 2);
        qs[..QK / 2]
            .iter()
            .zip(a_low.iter().zip(a_high))
            .map(|(&q, (&l, &h))| (q & 0x0f) as i32 * l as i32 + (q >> 4) as i32 * h as i32)
            .sum()
    } else {
        qs[..QK]
            .iter()
            .zip(a)
            .map(|(&q, &v)| q as i8 as i32 * v as i32)
            .sum()
    };
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

/// Canonical dot product of one quantized weight row with token `t` of `act`.
#[inline]
pub(crate) fn quant_row_dot<F: BlockFormat>(row: &[u8], act: &ActBlocks<'_>, t: usize) -> f32 {
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(F::BLOCK_BYTES).enumerate() {
        let i = act.index(t, b);
        let dw = f16_at(blk);
        let m = if F::HAS_MIN { f16_at(&blk[2..]) } else { 0.0 };
        let isum = block_isum::<F>(&blk[F::QS_OFFSET..], act.block(t, b), act.qsum[i]);
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
