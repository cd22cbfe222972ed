//! Activation quantization: f32 rows → 8-bit blocks, once per matmul input.
//!
//! Every 32-element block `x` of a token row becomes `d = max|x| / 127`,
//! `q = round_ties_even(x / d)` (as `x · (1/d)`, ggml's form), the integer sum `Σq`, and the
//! f32 product `s = d · Σq` (ggml's Q8_1 `s`, kept in f32). The same blocks serve all three
//! quantized weight types: Q8_0 weights use `d, q`; Q4_0 weights use `d, q, Σq` (for the −8
//! offset); Q4_1 weights use `d, q, s` (for the `m` term). Scales stay f32 (ggml rounds them
//! to f16), which costs nothing and is more accurate.
//!
//! A block with a non-finite element gets `d = NaN` (and zero codes), so every output it
//! touches is NaN rather than a silently wrong finite number.

use rayon::prelude::*;

use super::format::QK;
use super::{Kernel, QuantError};

/// Reusable buffers behind [`QuantizedInput`]: sized on first use, then never reallocated
/// for inputs of the same or smaller size.
#[derive(Debug, Default, Clone)]
pub struct QuantScratch {
    pub(crate) qs: Vec<i8>,
    scale: Vec<f32>,
    scaled_sum: Vec<f32>,
    qsum: Vec<i32>,
}

impl QuantScratch {
    /// Empty scratch; buffers grow on first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// Scratch already sized for inputs of up to `n_tokens × cols` (no allocation later).
    pub fn with_capacity(n_tokens: usize, cols: usize) -> Self {
        let blocks = n_tokens * cols / QK;
        Self {
            qs: Vec::with_capacity(blocks * QK),
            scale: Vec::with_capacity(blocks),
            scaled_sum: Vec::with_capacity(blocks),
            qsum: Vec::with_capacity(blocks),
        }
    }
}

/// The 8-bit blocks of an input, `blocks_per_token` blocks per token row.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ActBlocks<'a> {
    pub(crate) qs: &'a [i8],
    pub(crate) scale: &'a [f32],
    pub(crate) scaled_sum: &'a [f32],
    pub(crate) qsum: &'a [i32],
    pub(crate) blocks_per_token: usize,
}

impl ActBlocks<'_> {
    /// The 32 quantized values of block `b` of token `t`.
    #[inline(always)]
    pub(crate) fn block(&self, t: usize, b: usize) -> &[i8] {
        let i = (t * self.blocks_per_token + b) * QK;
        &self.qs[i..i + QK]
    }

    /// Index of block `b` of token `t` in the per-block arrays.
    #[inline(always)]
    pub(crate) fn index(&self, t: usize, b: usize) -> usize {
        t * self.blocks_per_token + b
    }
}

/// An `(n_tokens, cols)` f32 input together with its 8-bit quantization, ready to be
/// multiplied by any number of weight matrices with `cols` columns (q/k/v share one,
/// gate/up share one). Float (F32/F16) weights use the f32 rows; quantized weights use the
/// blocks, which exist when `cols` is a multiple of 32.
#[derive(Debug, Clone, Copy)]
pub struct QuantizedInput<'a> {
    x: &'a [f32],
    n_tokens: usize,
    cols: usize,
    blocks: Option<ActBlocks<'a>>,
}

/// Below this many elements the input is quantized on the calling thread.
const PARALLEL_QUANTIZE_MIN_ELEMENTS: usize = 1 << 16;

impl<'a> QuantizedInput<'a> {
    /// Quantizes `x` (row-major `(n_tokens, cols)`) into `scratch`.
    ///
    /// Errors if `x.len() != n_tokens · cols` or either is zero.
    pub fn quantize(
        x: &'a [f32],
        n_tokens: usize,
        cols: usize,
        scratch: &'a mut QuantScratch,
    ) -> Result<Self, QuantError> {
        if n_tokens == 0 || cols == 0 {
            return Err(QuantError::EmptyShape {
                rows: n_tokens,
                cols,
            });
        }
        let expected = n_tokens
            .checked_mul(cols)
            .ok_or(QuantError::ShapeOverflow)?;
        if x.len() != expected {
            return Err(QuantError::InputLength {
                n_tokens,
                cols,
                expected,
                actual: x.len(),
            });
        }
        if !cols.is_multiple_of(QK) {
            return Ok(Self {
                x,
                n_tokens,
                cols,
                blocks: None,
            });
        }
        let n_blocks = expected / QK;
        // `resize` sets the exact length and reuses the allocation whenever it is large
        // enough (shrinking never frees).
        scratch.qs.resize(expected, 0);
        scratch.scale.resize(n_blocks, 0.0);
        scratch.scaled_sum.resize(n_blocks, 0.0);
        scratch.qsum.resize(n_blocks, 0);
        let QuantScratch {
            qs,
            scale,
            scaled_sum,
            qsum,
        } = scratch;
        let kernel = Kernel::detect();
        if expected >= PARALLEL_QUANTIZE_MIN_ELEMENTS {
            const CHUNK: usize = 64;
            x.par_chunks(CHUNK * QK)
                .zip(qs.par_chunks_mut(CHUNK * QK))
                .zip(scale.par_chunks_mut(CHUNK))
                .zip(
                    scaled_sum
                        .par_chunks_mut(CHUNK)
                        .zip(qsum.par_chunks_mut(CHUNK)),
                )
                .for_each(|(((x, qs), scale), (scaled_sum, qsum))| {
                    quantize_blocks(kernel, x, qs, scale, scaled_sum, qsum)
                });
        } else {
            quantize_blocks(kernel, x, qs, scale, scaled_sum, qsum);
        }
        Ok(Self {
            x,
            n_tokens,
            cols,
            blocks: Some(ActBlocks {
                qs,
                scale,
                scaled_sum,
                qsum,
                blocks_per_token: cols / QK,
            }),
        })
    }

    /// Two-level ("refined") quantization for near-f32 accuracy on the exact integer
    /// kernels: writes `[x; r]` to `stacked`, where `r = x − dequant(quant(x))` is what the
    /// first 8-bit pass loses, and quantizes both as `2·n_tokens` rows. Multiplying by a
    /// matrix and adding output rows `t` and `n_tokens + t` ([`fold_refined`]) gives
    /// `W·(dq(x) + dq(r))`, whose activation error is ~1/254 of the single pass — about 14
    /// bits — at twice the arithmetic but the same weight traffic (a kernel tile shares the
    /// unpacked weights among its tokens). Deterministic and batch-invariant like `quantize`.
    pub fn quantize_refined(
        x: &[f32],
        n_tokens: usize,
        cols: usize,
        stacked: &'a mut Vec<f32>,
        scratch: &'a mut QuantScratch,
    ) -> Result<Self, QuantError> {
        stacked.clear();
        stacked.extend_from_slice(x);
        stacked.resize(2 * x.len(), 0.0);
        {
            let coarse = QuantizedInput::quantize(x, n_tokens, cols, scratch)?;
            if let Some(b) = coarse.blocks {
                let residual = &mut stacked[x.len()..];
                for (((r, v), q), d) in residual
                    .chunks_exact_mut(QK)
                    .zip(x.chunks_exact(QK))
                    .zip(b.qs.chunks_exact(QK))
                    .zip(b.scale)
                {
                    for ((ri, &xi), &qi) in r.iter_mut().zip(v).zip(q) {
                        *ri = xi - qi as f32 * d;
                    }
                }
            }
        }
        QuantizedInput::quantize(stacked, 2 * n_tokens, cols, scratch)
    }

    /// Number of token rows.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// Elements per token row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The f32 input rows, row-major `(n_tokens, cols)`.
    pub fn f32_rows(&self) -> &'a [f32] {
        self.x
    }

    /// Dequantizes the 8-bit blocks back to f32 (`q·d`), row-major `(n_tokens, cols)`:
    /// exactly what quantized weights are multiplied by. `None` when `cols` is not a multiple
    /// of 32 (only float weights can use such an input).
    pub fn dequantized(&self) -> Option<Vec<f32>> {
        let blocks = self.blocks?;
        let mut out = Vec::with_capacity(self.x.len());
        for (q, d) in blocks.qs.chunks_exact(QK).zip(blocks.scale) {
            out.extend(q.iter().map(|&v| v as f32 * d));
        }
        Some(out)
    }

    pub(crate) fn blocks(&self) -> Option<ActBlocks<'a>> {
        self.blocks
    }
}

/// Quantizes whole blocks: `x` is `scale.len()` blocks of 32 floats, into the matching
/// slices. The SIMD variants perform the same exact IEEE operations as [`quantize_block`],
/// so every ISA gives identical bits.
pub(crate) fn quantize_blocks(
    kernel: Kernel,
    x: &[f32],
    qs: &mut [i8],
    scale: &mut [f32],
    scaled_sum: &mut [f32],
    qsum: &mut [i32],
) {
    assert!(
        x.len() == scale.len() * QK
            && qs.len() == x.len()
            && scaled_sum.len() == scale.len()
            && qsum.len() == scale.len()
    );
    #[cfg(target_arch = "x86_64")]
    if kernel.is_available() {
        match kernel {
            // SAFETY: `is_available` checked the CPU features; the lengths are checked above.
            Kernel::Avx512 | Kernel::Avx512Vnni => unsafe {
                return super::avx512::quantize_blocks(x, qs, scale, scaled_sum, qsum);
            },
            // SAFETY: as above.
            Kernel::Avx2 => unsafe {
                return super::avx2::quantize_blocks(x, qs, scale, scaled_sum, qsum);
            },
            Kernel::Scalar => {}
        }
    }
    let _ = kernel;
    for ((((xb, qb), d), s), sum) in x
        .chunks_exact(QK)
        .zip(qs.chunks_exact_mut(QK))
        .zip(scale.iter_mut())
        .zip(scaled_sum.iter_mut())
        .zip(qsum.iter_mut())
    {
        (*d, *s, *sum) = quantize_block(xb, qb);
    }
}

/// `1.5 · 2²³`: adding it to an f32 of magnitude below 2²² rounds that value to an integer
/// (ties to even, the default rounding mode) held in the low mantissa bits.
pub(crate) const ROUNDING_MAGIC: f32 = 12_582_912.0;

/// The block scale from the largest `|x|` bit pattern: `(d, 1/d)`, or `(NaN, _)` for a block
/// with a non-finite element (for non-negative floats the integer order of the bit patterns
/// is the numeric order, and inf/NaN sort above every finite value).
#[inline(always)]
pub(crate) fn block_scale(amax_bits: u32) -> Option<(f32, f32)> {
    if amax_bits >= f32::INFINITY.to_bits() {
        return None;
    }
    let d = f32::from_bits(amax_bits) / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    Some((d, id))
}

/// The canonical quantization of one 32-element block into `q`; returns `(d, d·Σq, Σq)`.
/// Rounding is `x·(1/d)` to nearest, ties to even, by the magic-number addition (exact for
/// |x·(1/d)| ≤ 127.5). A non-finite block gets `d = s = NaN` and zero codes.
#[inline(always)]
pub(crate) fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32, i32) {
    let amax_bits = x
        .iter()
        .map(|v| v.to_bits() & 0x7fff_ffff)
        .max()
        .unwrap_or(0);
    let Some((d, id)) = block_scale(amax_bits) else {
        q.fill(0);
        return (f32::NAN, f32::NAN, 0);
    };
    let mut sum = 0i32;
    for (qv, &v) in q.iter_mut().zip(x) {
        let r = (v * id + ROUNDING_MAGIC).to_bits() as i32 - ROUNDING_MAGIC.to_bits() as i32;
        *qv = r as i8;
        sum += r;
    }
    (d, d * sum as f32, sum)
}

/// Completes a refined matmul ([`QuantizedInput::quantize_refined`]): `out[t] = full[t] +
/// full[n + t]` for the `n = out.len() / rows` token rows of `full` (`2n × rows`).
pub fn fold_refined(full: &[f32], out: &mut [f32]) {
    let half = out.len();
    assert_eq!(
        full.len(),
        2 * half,
        "a refined product has twice the output rows"
    );
    for ((o, &a), &b) in out.iter_mut().zip(&full[..half]).zip(&full[half..]) {
        *o = a + b;
    }
}
