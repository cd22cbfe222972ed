//! Activation quantization: f32 rows → 8-bit blocks, once per matmul input.
//!
//! Two block formats, both with one f32 scale per block, `d = max|x| / 127` and
//! `q = round_ties_even(x / d)` (as `x · (1/d)`, ggml's form):
//!
//! - 32-element blocks for `Q4_0`…`Q8_0` weights, with the integer sum `Σq` and the f32
//!   product `s = d · Σq` (ggml's Q8_1 `s`, kept in f32): Q8_0 weights use `d, q`; Q4_0 and
//!   Q5_0 use `d, q, Σq` (for the zero point); Q4_1 and Q5_1 use `d, q, s` (for the `m` term);
//! - 256-element super-blocks for the k-quants (ggml's Q8_K), with the integer sums of every
//!   16 and every 32 elements (for the groups' mins and zero points).
//!
//! Scales stay f32 (ggml rounds the 32-block ones to f16), which costs nothing and is more
//! accurate. A block with a non-finite element gets `d = NaN` (and zero codes), so every
//! output it touches is NaN rather than a silently wrong finite number.
//!
//! The refined precision ([`QuantizedInput::quantize_refined`]) gives the 32-element blocks
//! 16-bit codes, `a = 256·hi + lo` on a step of `d/256`: `hi` is the 8-bit code above, `lo`
//! the rounded residual `(x − hi·d)·256/d` (clamped to ±127). They are kept as two byte planes,
//! so the kernels dot each weight block with both and combine the two exact integer sums
//! before the block's single float epilogue. The k-quants' super-blocks instead get a second
//! set of 8-bit rows for the residual (their group-scaled sums would overflow an i32 with
//! 16-bit codes), multiplied as rows `n..2n` and added by [`fold_refined`].

use rayon::prelude::*;

use super::format::QK;
use super::kquant::QK_K;
use super::{GgmlType, Kernel, QuantError};

/// Reusable buffers behind [`QuantizedInput`]: sized on first use, then never reallocated
/// for inputs of the same or smaller size.
#[derive(Debug, Default, Clone)]
pub struct QuantScratch {
    pub(crate) qs: Vec<i8>,
    lo: Vec<i8>,
    pairs: Vec<i16>,
    scale: Vec<f32>,
    scaled_sum: Vec<f32>,
    qsum: Vec<i32>,
    pub(crate) k_qs: Vec<i8>,
    k_scale: Vec<f32>,
    k_sums16: Vec<i16>,
    k_sums32: Vec<i16>,
}

impl QuantScratch {
    /// Empty scratch; buffers grow on first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// Scratch already sized for inputs of up to `n_tokens × cols` (no allocation later).
    pub fn with_capacity(n_tokens: usize, cols: usize) -> Self {
        let len = n_tokens * cols;
        let (blocks, k_blocks) = (len / QK, len / QK_K);
        Self {
            qs: Vec::with_capacity(len),
            lo: Vec::with_capacity(len),
            pairs: Vec::with_capacity(len),
            scale: Vec::with_capacity(blocks),
            scaled_sum: Vec::with_capacity(blocks),
            qsum: Vec::with_capacity(blocks),
            k_qs: Vec::with_capacity(len),
            k_scale: Vec::with_capacity(k_blocks),
            k_sums16: Vec::with_capacity(len / 16),
            k_sums32: Vec::with_capacity(len / 32),
        }
    }
}

/// The 32-element 8-bit blocks of an input, `blocks_per_token` blocks per token row.
///
/// A refined ("wide") input has a second byte plane `lo` of the same layout: its codes are
/// `256·qs + lo`, and `scale`, `qsum` and `scaled_sum` are those of the 16-bit codes. `lo` is
/// empty otherwise. `pairs` holds the same 16-bit codes as whole i16s, in the order the
/// kernels without VNNI dot them with `Q8_0` weights (see [`wide_pairs`]); it is empty for a
/// narrow input and for one built without `Q8_0` among its weight types.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ActBlocks<'a> {
    pub(crate) qs: &'a [i8],
    pub(crate) lo: &'a [i8],
    pub(crate) pairs: &'a [i16],
    pub(crate) scale: &'a [f32],
    pub(crate) scaled_sum: &'a [f32],
    pub(crate) qsum: &'a [i32],
    pub(crate) blocks_per_token: usize,
}

impl ActBlocks<'_> {
    /// The 32 quantized values of block `b` of token `t` (the high bytes of a wide input).
    #[inline(always)]
    pub(crate) fn block(&self, t: usize, b: usize) -> &[i8] {
        let i = (t * self.blocks_per_token + b) * QK;
        &self.qs[i..i + QK]
    }

    /// The low bytes of block `b` of token `t` of a wide input.
    #[inline(always)]
    pub(crate) fn lo_block(&self, t: usize, b: usize) -> &[i8] {
        let i = (t * self.blocks_per_token + b) * QK;
        &self.lo[i..i + QK]
    }

    /// Whether the codes are 16-bit (`256·qs + lo`): a refined input.
    #[inline(always)]
    pub(crate) fn is_wide(&self) -> bool {
        !self.lo.is_empty()
    }

    /// Whether the 16-bit codes are also laid out as i16 pairs ([`wide_pairs`]).
    #[inline(always)]
    pub(crate) fn has_pairs(&self) -> bool {
        !self.pairs.is_empty()
    }

    /// Index of block `b` of token `t` in the per-block arrays.
    #[inline(always)]
    pub(crate) fn index(&self, t: usize, b: usize) -> usize {
        t * self.blocks_per_token + b
    }
}

/// The 256-element 8-bit super-blocks of an input (for k-quant weights).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SuperActBlocks<'a> {
    pub(crate) qs: &'a [i8],
    pub(crate) scale: &'a [f32],
    /// `Σq` of every 16 elements.
    pub(crate) sums16: &'a [i16],
    /// `Σq` of every 32 elements.
    pub(crate) sums32: &'a [i16],
    pub(crate) blocks_per_token: usize,
}

impl SuperActBlocks<'_> {
    /// Index of super-block `b` of token `t` in `scale` (and, times 256, in `qs`).
    #[inline(always)]
    pub(crate) fn index(&self, t: usize, b: usize) -> usize {
        t * self.blocks_per_token + b
    }
}

/// An `(n_tokens, cols)` f32 input together with its 8-bit quantizations, ready to be
/// multiplied by any number of weight matrices with `cols` columns (q/k/v share one,
/// gate/up share one). Float (F32/F16) weights use the f32 rows; 32-element formats use the
/// 32-element blocks, which exist when `cols` is a multiple of 32; k-quants use the
/// super-blocks, which exist when `cols` is a multiple of 256.
#[derive(Debug, Clone, Copy)]
pub struct QuantizedInput<'a> {
    x: &'a [f32],
    n_tokens: usize,
    cols: usize,
    refined: bool,
    blocks: Option<ActBlocks<'a>>,
    super_blocks: Option<SuperActBlocks<'a>>,
}

/// Below this many elements the input is quantized on the calling thread.
const PARALLEL_QUANTIZE_MIN_ELEMENTS: usize = 1 << 16;

/// Checks the shape of an input of `n_tokens × cols` floats.
fn check_input(x: &[f32], n_tokens: usize, cols: usize) -> Result<(), QuantError> {
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
    Ok(())
}

/// Quantizes `x` (whole 32-blocks) into the given slices, on the pool for large inputs.
fn quantize_rows(
    x: &[f32],
    qs: &mut [i8],
    scale: &mut [f32],
    scaled_sum: &mut [f32],
    qsum: &mut [i32],
) {
    let kernel = Kernel::detect();
    if x.len() >= PARALLEL_QUANTIZE_MIN_ELEMENTS {
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
}

/// Quantizes `x` (whole 32-blocks) into wide 16-bit codes (`256·hi + lo`, see the module
/// docs), on the pool for large inputs.
fn quantize_wide_rows(
    x: &[f32],
    hi: &mut [i8],
    lo: &mut [i8],
    scale: &mut [f32],
    scaled_sum: &mut [f32],
    qsum: &mut [i32],
) {
    if x.len() >= PARALLEL_QUANTIZE_MIN_ELEMENTS {
        const CHUNK: usize = 64;
        x.par_chunks(CHUNK * QK)
            .zip(
                hi.par_chunks_mut(CHUNK * QK)
                    .zip(lo.par_chunks_mut(CHUNK * QK)),
            )
            .zip(scale.par_chunks_mut(CHUNK))
            .zip(
                scaled_sum
                    .par_chunks_mut(CHUNK)
                    .zip(qsum.par_chunks_mut(CHUNK)),
            )
            .for_each(|(((x, (hi, lo)), scale), (scaled_sum, qsum))| {
                quantize_wide_blocks(x, hi, lo, scale, scaled_sum, qsum)
            });
    } else {
        quantize_wide_blocks(x, hi, lo, scale, scaled_sum, qsum);
    }
}

/// Quantizes whole 32-element blocks into wide codes: per block the step `d/256` (NaN for a
/// non-finite block), `Σ(256·hi + lo)` and `s = (d/256)·Σ`. The widest vectors this CPU has
/// run the same IEEE operations as the scalar code, so every ISA gives identical bits.
pub(crate) fn quantize_wide_blocks(
    x: &[f32],
    hi: &mut [i8],
    lo: &mut [i8],
    scale: &mut [f32],
    scaled_sum: &mut [f32],
    qsum: &mut [i32],
) {
    assert!(
        x.len() == scale.len() * QK
            && hi.len() == x.len()
            && lo.len() == x.len()
            && scaled_sum.len() == scale.len()
            && qsum.len() == scale.len()
    );
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
        // SAFETY: the CPU has AVX-512 F + BW (checked above).
        return unsafe { quantize_wide_avx512(x, hi, lo, scale, scaled_sum, qsum) };
    }
    quantize_wide_body(x, hi, lo, scale, scaled_sum, qsum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_wide_avx512(
    x: &[f32],
    hi: &mut [i8],
    lo: &mut [i8],
    scale: &mut [f32],
    scaled_sum: &mut [f32],
    qsum: &mut [i32],
) {
    quantize_wide_body(x, hi, lo, scale, scaled_sum, qsum)
}

#[inline(always)]
fn quantize_wide_body(
    x: &[f32],
    hi: &mut [i8],
    lo: &mut [i8],
    scale: &mut [f32],
    scaled_sum: &mut [f32],
    qsum: &mut [i32],
) {
    for ((((xb, hb), lb), (d, s)), sum) in x
        .chunks_exact(QK)
        .zip(hi.chunks_exact_mut(QK))
        .zip(lo.chunks_exact_mut(QK))
        .zip(scale.iter_mut().zip(scaled_sum.iter_mut()))
        .zip(qsum.iter_mut())
    {
        let (step, total) = quantize_wide_span(xb, hb, lb);
        (*d, *sum, *s) = (step, total, step * total as f32);
    }
}

/// The canonical wide quantization of one block into `hi` and `lo`: `hi` as
/// [`quantize_span`] rounds it, then the residual `r = x − hi·d` rounded on the step `d/256`
/// (as `(r·(1/d))·256`, ties to even, clamped to ±127 — `|r| ≤ d/2` up to rounding, and the
/// kernels without VNNI negate activation bytes, which −128 would not survive).
/// Returns `(d/256, Σ(256·hi + lo))`; a non-finite block gets `(NaN, 0)` and zero codes.
#[inline(always)]
pub(crate) fn quantize_wide_span(x: &[f32], hi: &mut [i8], lo: &mut [i8]) -> (f32, i32) {
    let amax_bits = x
        .iter()
        .map(|v| v.to_bits() & 0x7fff_ffff)
        .max()
        .unwrap_or(0);
    let Some((d, id)) = block_scale(amax_bits) else {
        hi.fill(0);
        lo.fill(0);
        return (f32::NAN, 0);
    };
    let magic = ROUNDING_MAGIC.to_bits() as i32;
    let mut sum = 0i32;
    for ((h, l), &v) in hi.iter_mut().zip(lo.iter_mut()).zip(x) {
        let q = (v * id + ROUNDING_MAGIC).to_bits() as i32 - magic;
        let r = v - q as f32 * d;
        let p = ((r * id) * 256.0 + ROUNDING_MAGIC).to_bits() as i32 - magic;
        let p = p.clamp(-127, 127);
        (*h, *l) = (q as i8, p as i8);
        sum += 256 * q + p;
    }
    (d / 256.0, sum)
}

/// Quantizes `x` (whole 256-blocks) into the given slices, on the pool for large inputs.
fn quantize_super_rows(
    x: &[f32],
    qs: &mut [i8],
    scale: &mut [f32],
    sums16: &mut [i16],
    sums32: &mut [i16],
) {
    let kernel = Kernel::detect();
    if x.len() >= PARALLEL_QUANTIZE_MIN_ELEMENTS {
        const CHUNK: usize = 8;
        x.par_chunks(CHUNK * QK_K)
            .zip(qs.par_chunks_mut(CHUNK * QK_K))
            .zip(scale.par_chunks_mut(CHUNK))
            .zip(
                sums16
                    .par_chunks_mut(CHUNK * 16)
                    .zip(sums32.par_chunks_mut(CHUNK * 8)),
            )
            .for_each(|(((x, qs), scale), (sums16, sums32))| {
                quantize_super_blocks(kernel, x, qs, scale, sums16, sums32)
            });
    } else {
        quantize_super_blocks(kernel, x, qs, scale, sums16, sums32);
    }
}

/// `residual = x − dequant(q, d)` for blocks of `block` elements, with the widest vectors
/// this CPU has (a product and a difference per element: the same bits on every ISA).
fn residual_into(residual: &mut [f32], x: &[f32], qs: &[i8], scale: &[f32], block: usize) {
    // Elementwise per block: large inputs are split over the pool (same bits).
    if x.len() >= PARALLEL_QUANTIZE_MIN_ELEMENTS && rayon::current_num_threads() > 1 {
        let chunk = 64 * block;
        residual
            .par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk))
            .zip(qs.par_chunks(chunk).zip(scale.par_chunks(64)))
            .for_each(|((r, x), (qs, scale))| residual_span(r, x, qs, scale, block));
    } else {
        residual_span(residual, x, qs, scale, block);
    }
}

/// [`residual_into`] on one span, with the widest vectors this CPU has.
fn residual_span(residual: &mut [f32], x: &[f32], qs: &[i8], scale: &[f32], block: usize) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512 F (checked above).
        return unsafe { residual_into_avx512(residual, x, qs, scale, block) };
    }
    residual_into_body(residual, x, qs, scale, block)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn residual_into_avx512(
    residual: &mut [f32],
    x: &[f32],
    qs: &[i8],
    scale: &[f32],
    block: usize,
) {
    residual_into_body(residual, x, qs, scale, block)
}

#[inline(always)]
fn residual_into_body(residual: &mut [f32], x: &[f32], qs: &[i8], scale: &[f32], block: usize) {
    for (((r, v), q), d) in residual
        .chunks_exact_mut(block)
        .zip(x.chunks_exact(block))
        .zip(qs.chunks_exact(block))
        .zip(scale)
    {
        for ((ri, &xi), &qi) in r.iter_mut().zip(v).zip(q) {
            *ri = xi - qi as f32 * d;
        }
    }
}

impl<'a> QuantizedInput<'a> {
    /// Quantizes `x` (row-major `(n_tokens, cols)`) into `scratch`: 32-element blocks when
    /// `cols` is a multiple of 32, and 256-element super-blocks too when it is a multiple of
    /// 256.
    ///
    /// Errors if `x.len() != n_tokens · cols` or either is zero.
    pub fn quantize(
        x: &'a [f32],
        n_tokens: usize,
        cols: usize,
        scratch: &'a mut QuantScratch,
    ) -> Result<Self, QuantError> {
        Self::build(x, n_tokens, cols, None, scratch)
    }

    /// Two-level ("refined") quantization for near-f32 accuracy on the exact integer
    /// kernels: the 32-element blocks get 16-bit codes (`256·hi + lo` on a step of `d/256`,
    /// see the module docs), and the k-quants' super-blocks get the residual
    /// `r = x − dequant(quant(x))` quantized as `n_tokens` more rows (`stacked` holds it),
    /// whose product [`fold_refined`] adds to the value rows' ([`Self::product_tokens`]). The
    /// activation error is ~1/256 of the single pass — about 14 bits — at twice the integer
    /// work but the same weight traffic (the kernels dot each unpacked weight block with both
    /// byte planes of a token). Float weights use `x` itself. Deterministic and
    /// batch-invariant like `quantize`.
    pub fn quantize_refined(
        x: &'a [f32],
        n_tokens: usize,
        cols: usize,
        stacked: &'a mut Vec<f32>,
        scratch: &'a mut QuantScratch,
    ) -> Result<Self, QuantError> {
        Self::build(x, n_tokens, cols, Some(stacked), scratch)
    }

    /// [`QuantizedInput::quantize`] (`residual: None`) or
    /// [`QuantizedInput::quantize_refined`] (`Some(stacked)`) for the given weight types
    /// only: builds the 32-element blocks only if a 32-element format is among `dtypes` and
    /// the super-blocks only if a k-quant is (a 1536- or 2048-column input feeding only
    /// Q4_1, or only k-quants, skips the other half of the work). The blocks it builds are
    /// bit-identical to those of the full constructors; multiplying by a weight type whose
    /// blocks were not built is an error ([`QuantError::MissingBlocks`]).
    pub fn quantize_for(
        x: &'a [f32],
        n_tokens: usize,
        cols: usize,
        dtypes: &[GgmlType],
        residual: Option<&'a mut Vec<f32>>,
        scratch: &'a mut QuantScratch,
    ) -> Result<Self, QuantError> {
        let wants = BlockWants {
            blocks: dtypes.iter().any(|d| d.is_quantized() && !d.is_k_quant()),
            super_blocks: dtypes.iter().any(|d| d.is_k_quant()),
            pairs: dtypes.contains(&GgmlType::Q8_0),
        };
        Self::build_some(x, n_tokens, cols, residual, scratch, wants)
    }

    /// Quantizes `x`, and with `residual` scratch refined (wide 32-element blocks, and the
    /// residual of the super-blocks as rows `n_tokens..2·n_tokens`).
    fn build(
        x: &'a [f32],
        n_tokens: usize,
        cols: usize,
        residual: Option<&mut Vec<f32>>,
        scratch: &'a mut QuantScratch,
    ) -> Result<Self, QuantError> {
        let wants = BlockWants {
            blocks: true,
            super_blocks: true,
            pairs: true,
        };
        Self::build_some(x, n_tokens, cols, residual, scratch, wants)
    }

    /// [`QuantizedInput::build`] of the blocks `wants` names only.
    fn build_some(
        x: &'a [f32],
        n_tokens: usize,
        cols: usize,
        residual: Option<&mut Vec<f32>>,
        scratch: &'a mut QuantScratch,
        wants: BlockWants,
    ) -> Result<Self, QuantError> {
        check_input(x, n_tokens, cols)?;
        let refined = residual.is_some();
        let len = x.len();
        let has_blocks = wants.blocks && cols.is_multiple_of(QK);
        let has_super = wants.super_blocks && cols.is_multiple_of(QK_K);
        let has_pairs = refined && has_blocks && wants.pairs;
        let QuantScratch {
            qs,
            lo,
            pairs,
            scale,
            scaled_sum,
            qsum,
            k_qs,
            k_scale,
            k_sums16,
            k_sums32,
        } = scratch;
        // The buffers only grow (zero-filled once), and are used through slices of the exact
        // length: an input narrower than the last one pays no fill.
        let blocks_len = if has_blocks { len } else { 0 };
        let qs = grown(qs, blocks_len);
        let lo = grown(lo, if refined { blocks_len } else { 0 });
        let pairs = grown(pairs, if has_pairs { blocks_len } else { 0 });
        let scale = grown(scale, blocks_len / QK);
        let scaled_sum = grown(scaled_sum, blocks_len / QK);
        let qsum = grown(qsum, blocks_len / QK);
        if has_blocks {
            if refined {
                quantize_wide_rows(x, qs, lo, scale, scaled_sum, qsum);
                if has_pairs {
                    wide_pairs(qs, lo, pairs);
                }
            } else {
                quantize_rows(x, qs, scale, scaled_sum, qsum);
            }
        }
        let super_len = if !has_super {
            0
        } else if refined {
            2 * len
        } else {
            len
        };
        let k_qs = grown(k_qs, super_len);
        let k_scale = grown(k_scale, super_len / QK_K);
        let k_sums16 = grown(k_sums16, super_len / 16);
        let k_sums32 = grown(k_sums32, super_len / 32);
        if has_super {
            let b0 = len / QK_K;
            quantize_super_rows(
                x,
                &mut k_qs[..len],
                &mut k_scale[..b0],
                &mut k_sums16[..len / 16],
                &mut k_sums32[..len / 32],
            );
            if let Some(r) = residual {
                let r = resize_residual(r, len);
                residual_into(r, x, &k_qs[..len], &k_scale[..b0], QK_K);
                quantize_super_rows(
                    r,
                    &mut k_qs[len..],
                    &mut k_scale[b0..],
                    &mut k_sums16[len / 16..],
                    &mut k_sums32[len / 32..],
                );
            }
        }
        Ok(Self {
            x,
            n_tokens,
            cols,
            refined,
            blocks: has_blocks.then_some(ActBlocks {
                qs,
                lo,
                pairs,
                scale,
                scaled_sum,
                qsum,
                blocks_per_token: cols / QK,
            }),
            super_blocks: has_super.then_some(SuperActBlocks {
                qs: k_qs,
                scale: k_scale,
                sums16: k_sums16,
                sums32: k_sums32,
                blocks_per_token: cols / QK_K,
            }),
        })
    }

    /// Number of token rows of the input.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// Token rows of its product with a `dtype` matrix: `2·n` (value rows, then residual
    /// rows, for [`fold_refined`]) for a k-quant and a refined input, else `n`.
    pub fn product_tokens(&self, dtype: GgmlType) -> usize {
        if self.refined && dtype.is_k_quant() {
            2 * self.n_tokens
        } else {
            self.n_tokens
        }
    }

    /// Elements per token row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Whether this is a refined input (16-bit codes for the 32-element formats, a residual
    /// pass for the k-quants).
    pub fn is_refined(&self) -> bool {
        self.refined
    }

    /// The f32 input rows, row-major (`n_tokens` rows).
    pub fn f32_rows(&self) -> &'a [f32] {
        self.x
    }

    /// Dequantizes the 32-element blocks back to f32 (`q·d`), row-major `(n_tokens, cols)`:
    /// exactly what 32-element weight formats are multiplied by. `None` when `cols` is not a
    /// multiple of 32.
    pub fn dequantized(&self) -> Option<Vec<f32>> {
        let blocks = self.blocks?;
        if blocks.is_wide() {
            let wide: Vec<i32> = (blocks.qs.iter().zip(blocks.lo))
                .map(|(&hi, &lo)| 256 * hi as i32 + lo as i32)
                .collect();
            return Some(
                wide.chunks_exact(QK)
                    .zip(blocks.scale)
                    .flat_map(|(q, d)| q.iter().map(move |&v| v as f32 * d))
                    .collect(),
            );
        }
        Some(dequantize_codes(blocks.qs, blocks.scale, QK))
    }

    /// Dequantizes the 256-element super-blocks (what k-quant weights are multiplied by);
    /// `None` when `cols` is not a multiple of 256.
    pub fn dequantized_super(&self) -> Option<Vec<f32>> {
        let blocks = self.super_blocks?;
        Some(dequantize_codes(blocks.qs, blocks.scale, QK_K))
    }

    pub(crate) fn blocks(&self) -> Option<ActBlocks<'a>> {
        self.blocks
    }

    pub(crate) fn super_blocks(&self) -> Option<SuperActBlocks<'a>> {
        self.super_blocks
    }
}

/// Which blocks [`QuantizedInput::build_some`] builds: the 32-element ones, the
/// super-blocks, and (refined 32-element blocks only) their i16 pairs.
#[derive(Debug, Clone, Copy)]
struct BlockWants {
    blocks: bool,
    super_blocks: bool,
    pairs: bool,
}

/// Lays the wide codes `a = 256·hi + lo` out as whole i16s, every 4 elements as
/// `[a0, a2, a1, a3]`: without VNNI a `Q8_0` weight word's bytes split into the i16 pairs
/// `(q0, q2)` and `(q1, q3)` with two shifts, and one `vpmaddwd` each against these pairs
/// gives the 4 products exactly — half the multiplies of dotting the two byte planes
/// (`|a| ≤ 256·127 + 127`, so no pair reaches the instruction's one overflow, −2¹⁵·−2¹⁵).
fn wide_pairs(hi: &[i8], lo: &[i8], pairs: &mut [i16]) {
    for ((h, l), p) in hi
        .chunks_exact(4)
        .zip(lo.chunks_exact(4))
        .zip(pairs.chunks_exact_mut(4))
    {
        let a = |e: usize| 256 * h[e] as i16 + l[e] as i16;
        p.copy_from_slice(&[a(0), a(2), a(1), a(3)]);
    }
}

/// The residual scratch as exactly `len` floats.
fn resize_residual(r: &mut Vec<f32>, len: usize) -> &mut [f32] {
    grown(r, len)
}

/// The first `len` elements of `v`, growing it (zero-filled) only when it is shorter.
fn grown<T: Copy + Default>(v: &mut Vec<T>, len: usize) -> &mut [T] {
    if v.len() < len {
        v.resize(len, T::default());
    }
    &mut v[..len]
}

fn dequantize_codes(qs: &[i8], scale: &[f32], block: usize) -> Vec<f32> {
    qs.chunks_exact(block)
        .zip(scale)
        .flat_map(|(q, d)| q.iter().map(move |&v| v as f32 * d))
        .collect()
}

/// Quantizes whole blocks of `block` elements (32 or 256): `x` is `scale.len()` blocks, into
/// codes `qs`, scales and `Σq`. The SIMD variants perform the same exact IEEE operations as
/// [`quantize_span`], so every ISA gives identical bits.
pub(crate) fn quantize_spans(
    kernel: Kernel,
    x: &[f32],
    qs: &mut [i8],
    block: usize,
    scale: &mut [f32],
    qsum: &mut [i32],
) {
    assert!(
        block.is_multiple_of(QK)
            && x.len() == scale.len() * block
            && qs.len() == x.len()
            && qsum.len() == scale.len()
    );
    #[cfg(target_arch = "x86_64")]
    if kernel.is_available() {
        match kernel {
            // SAFETY: `is_available` checked the CPU features; the lengths are checked above.
            Kernel::Avx512 | Kernel::Avx512Vnni | Kernel::Amx => unsafe {
                return super::avx512::quantize_spans(x, qs, block, scale, qsum);
            },
            // SAFETY: as above.
            Kernel::Avx2 => unsafe {
                return super::avx2::quantize_spans(x, qs, block, scale, qsum);
            },
            Kernel::Scalar => {}
        }
    }
    let _ = kernel;
    for (((xb, qb), d), sum) in x
        .chunks_exact(block)
        .zip(qs.chunks_exact_mut(block))
        .zip(scale.iter_mut())
        .zip(qsum.iter_mut())
    {
        (*d, *sum) = quantize_span(xb, qb);
    }
}

/// Quantizes whole 32-element blocks, with `s = d·Σq` (NaN for a non-finite block).
pub(crate) fn quantize_blocks(
    kernel: Kernel,
    x: &[f32],
    qs: &mut [i8],
    scale: &mut [f32],
    scaled_sum: &mut [f32],
    qsum: &mut [i32],
) {
    quantize_spans(kernel, x, qs, QK, scale, qsum);
    for ((s, &d), &sum) in scaled_sum.iter_mut().zip(scale.iter()).zip(qsum.iter()) {
        *s = d * sum as f32;
    }
}

/// Quantizes whole 256-element super-blocks: `x` is `scale.len()` super-blocks, into the
/// matching slices (16 and 8 sums per super-block). Same bits under every ISA.
pub(crate) fn quantize_super_blocks(
    kernel: Kernel,
    x: &[f32],
    qs: &mut [i8],
    scale: &mut [f32],
    sums16: &mut [i16],
    sums32: &mut [i16],
) {
    assert!(sums16.len() == scale.len() * 16 && sums32.len() == scale.len() * 8);
    let mut totals = [0i32; 8];
    for (((xc, qc), dc), (s16, s32)) in x
        .chunks(8 * QK_K)
        .zip(qs.chunks_mut(8 * QK_K))
        .zip(scale.chunks_mut(8))
        .zip(sums16.chunks_mut(8 * 16).zip(sums32.chunks_mut(8 * 8)))
    {
        quantize_spans(kernel, xc, qc, QK_K, dc, &mut totals[..dc.len()]);
        for (s, q) in s16.iter_mut().zip(qc.chunks_exact(16)) {
            *s = q.iter().map(|&v| v as i16).sum();
        }
        for (s, pair) in s32.iter_mut().zip(s16.chunks_exact(2)) {
            *s = pair[0] + pair[1];
        }
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

/// The canonical quantization of one block (any length) into `q`; returns `(d, Σq)`.
/// Rounding is `x·(1/d)` to nearest, ties to even, by the magic-number addition (exact for
/// |x·(1/d)| ≤ 127.5). A non-finite block gets `d = NaN` and zero codes.
#[inline(always)]
pub(crate) fn quantize_span(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax_bits = x
        .iter()
        .map(|v| v.to_bits() & 0x7fff_ffff)
        .max()
        .unwrap_or(0);
    let Some((d, id)) = block_scale(amax_bits) else {
        q.fill(0);
        return (f32::NAN, 0);
    };
    let mut sum = 0i32;
    for (qv, &v) in q.iter_mut().zip(x) {
        let r = (v * id + ROUNDING_MAGIC).to_bits() as i32 - ROUNDING_MAGIC.to_bits() as i32;
        *qv = r as i8;
        sum += r;
    }
    (d, sum)
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
    let (value, residual) = full.split_at(half);
    // Elementwise: large outputs are split over the pool (same bits).
    if half >= PARALLEL_QUANTIZE_MIN_ELEMENTS && rayon::current_num_threads() > 1 {
        const CHUNK: usize = 1 << 14;
        out.par_chunks_mut(CHUNK)
            .zip(value.par_chunks(CHUNK).zip(residual.par_chunks(CHUNK)))
            .for_each(|(o, (a, b))| fold_span(a, b, o));
    } else {
        fold_span(value, residual, out);
    }
}

/// `out = a + b` with the widest vectors this CPU has.
fn fold_span(a: &[f32], b: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512 F (checked above).
        return unsafe { fold_avx512(a, b, out) };
    }
    fold_body(a, b, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fold_avx512(a: &[f32], b: &[f32], out: &mut [f32]) {
    fold_body(a, b, out)
}

#[inline(always)]
fn fold_body(a: &[f32], b: &[f32], out: &mut [f32]) {
    for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
        *o = a + b;
    }
}
