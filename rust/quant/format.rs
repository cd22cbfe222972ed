//! ggml tensor types and their block layouts: ids and names, validation, dequantization and
//! the reference weight quantizers (used to build test and bench matrices). The 32-element
//! formats live here, the 256-element k-quants in `kquant`.

use super::kquant::{self, QK_K};
use super::QuantError;

/// Elements per block of the 32-element quantized types (ggml `QK4_0 = … = QK8_0 = 32`).
pub const QK: usize = 32;

/// Bytes of one `Q4_0` block: `{ d: f16, qs: [u8; 16] }`.
pub(crate) const Q4_0_BLOCK_BYTES: usize = 18;
/// Bytes of one `Q4_1` block: `{ d: f16, m: f16, qs: [u8; 16] }`.
pub(crate) const Q4_1_BLOCK_BYTES: usize = 20;
/// Bytes of one `Q5_0` block: `{ d: f16, qh: [u8; 4], qs: [u8; 16] }`.
pub(crate) const Q5_0_BLOCK_BYTES: usize = 22;
/// Bytes of one `Q5_1` block: `{ d: f16, m: f16, qh: [u8; 4], qs: [u8; 16] }`.
pub(crate) const Q5_1_BLOCK_BYTES: usize = 24;
/// Bytes of one `Q8_0` block: `{ d: f16, qs: [i8; 32] }`.
pub(crate) const Q8_0_BLOCK_BYTES: usize = 34;

/// A ggml tensor type this crate can compute with; the discriminant is ggml's type id and the
/// variant names are ggml's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// IEEE binary32, one element per "block".
    F32 = 0,
    /// IEEE binary16, one element per "block".
    F16 = 1,
    /// 32 elements: `{ d: f16, qs: [u8; 16] }`, value `(q − 8)·d`.
    Q4_0 = 2,
    /// 32 elements: `{ d: f16, m: f16, qs: [u8; 16] }`, value `q·d + m`.
    Q4_1 = 3,
    /// 32 elements: `{ d: f16, qh: [u8; 4], qs: [u8; 16] }`, 5-bit `q`, value `(q − 16)·d`.
    Q5_0 = 6,
    /// 32 elements: `{ d: f16, m: f16, qh: [u8; 4], qs: [u8; 16] }`, value `q·d + m`.
    Q5_1 = 7,
    /// 32 elements: `{ d: f16, qs: [i8; 32] }`, value `q·d`.
    Q8_0 = 8,
    /// 256 elements in 16 groups of 16: 2-bit `q`, 4-bit scale and min per group, value
    /// `d·s·q − dmin·m`.
    Q2_K = 10,
    /// 256 elements in 16 groups of 16: 3-bit `q`, 6-bit scale per group, value
    /// `d·(s − 32)·(q − 4)`.
    Q3_K = 11,
    /// 256 elements in 8 groups of 32: 4-bit `q`, 6-bit scale and min per group, value
    /// `d·s·q − dmin·m`.
    Q4_K = 12,
    /// 256 elements in 8 groups of 32: 5-bit `q`, 6-bit scale and min per group, value
    /// `d·s·q − dmin·m`.
    Q5_K = 13,
    /// 256 elements in 16 groups of 16: 6-bit `q`, 8-bit signed scale per group, value
    /// `d·s·(q − 32)`.
    Q6_K = 14,
}

/// Every ggml type id and its name (ggml.h), for messages about types this crate lacks.
const GGML_TYPE_NAMES: [(u32, &str); 43] = [
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (4, "Q4_2"),
    (5, "Q4_3"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (30, "BF16"),
    (31, "Q4_0_4_4"),
    (32, "Q4_0_4_8"),
    (33, "Q4_0_8_8"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (36, "IQ4_NL_4_4"),
    (37, "IQ4_NL_4_8"),
    (38, "IQ4_NL_8_8"),
    (39, "MXFP4"),
    (40, "NVFP4"),
    (41, "Q1_0"),
    (42, "Q2_0"),
];

/// ggml's name of type id `id` (`"IQ2_XS"` for 17), supported or not; `None` for an id
/// ggml does not define.
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    GGML_TYPE_NAMES
        .iter()
        .find(|&&(i, _)| i == id)
        .map(|&(_, name)| name)
}

impl GgmlType {
    /// Every supported type, in id order.
    pub const ALL: [GgmlType; 12] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// The type with ggml id `id`, or [`QuantError::UnsupportedType`].
    pub fn from_id(id: u32) -> Result<Self, QuantError> {
        Self::ALL
            .into_iter()
            .find(|t| t.id() == id)
            .ok_or(QuantError::UnsupportedType { id })
    }

    /// ggml's numeric id of this type (as stored in GGUF tensor infos).
    pub fn id(self) -> u32 {
        self as u32
    }

    /// ggml's name of this type (`"Q4_1"`, ...).
    pub fn name(self) -> &'static str {
        ggml_type_name(self.id()).expect("every supported type has a ggml name")
    }

    /// Elements per block: 1 for the float types, 32 for `Q4_0`…`Q8_0`, 256 for the
    /// k-quants.
    pub fn block_size(self) -> usize {
        if self.is_k_quant() {
            QK_K
        } else if self.is_quantized() {
            QK
        } else {
            1
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 => 2,
            GgmlType::Q4_0 => Q4_0_BLOCK_BYTES,
            GgmlType::Q4_1 => Q4_1_BLOCK_BYTES,
            GgmlType::Q5_0 => Q5_0_BLOCK_BYTES,
            GgmlType::Q5_1 => Q5_1_BLOCK_BYTES,
            GgmlType::Q8_0 => Q8_0_BLOCK_BYTES,
            GgmlType::Q2_K => kquant::Q2_K_BLOCK_BYTES,
            GgmlType::Q3_K => kquant::Q3_K_BLOCK_BYTES,
            GgmlType::Q4_K => kquant::Q4_K_BLOCK_BYTES,
            GgmlType::Q5_K => kquant::Q5_K_BLOCK_BYTES,
            GgmlType::Q6_K => kquant::Q6_K_BLOCK_BYTES,
        }
    }

    /// True for the block-quantized types (everything but `F32` and `F16`).
    pub fn is_quantized(self) -> bool {
        !matches!(self, GgmlType::F32 | GgmlType::F16)
    }

    /// True for the k-quants (256-element super-blocks, multiplied with 256-element
    /// activation blocks).
    pub fn is_k_quant(self) -> bool {
        matches!(
            self,
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K
        )
    }

    /// Bytes of one row of `cols` elements; `cols` must be a multiple of the block size.
    pub fn row_bytes(self, cols: usize) -> Result<usize, QuantError> {
        if !cols.is_multiple_of(self.block_size()) {
            return Err(QuantError::ColsNotBlockMultiple {
                dtype: self,
                cols,
                block_size: self.block_size(),
            });
        }
        (cols / self.block_size())
            .checked_mul(self.block_bytes())
            .ok_or(QuantError::ShapeOverflow)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The f32 value of the little-endian binary16 at `bytes[0..2]` (exact).
#[inline(always)]
pub(crate) fn f16_at(bytes: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f32()
}

pub(crate) fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Compile-time description of a 32-element block layout, shared by every kernel. Every
/// format is read as unsigned codes `u` with value `(u − ZERO)·d (+ m)`: 4- and 5-bit codes
/// as stored, `Q8_0`'s signed `q` as `u = q + 128` (the bit pattern `q ^ 0x80`).
pub(crate) trait BlockFormat {
    /// Bytes per 32-element block.
    const BLOCK_BYTES: usize;
    /// Whether the block carries a min `m` (f16 at byte 2): value `u·d + m`.
    const HAS_MIN: bool;
    /// Offset of the 32 high bits of 5-bit codes (`qh`, bit `i` for element `i`), if any.
    const QH_OFFSET: Option<usize>;
    /// Offset of the codes: 16 bytes of nibbles (low = elements 0..15, high = 16..31), or 32
    /// bytes for `Q8_0`.
    const QS_OFFSET: usize;
    /// 4-bit codes in nibbles (with the 5th bit in `qh` for Q5) rather than whole bytes.
    const NIBBLES: bool;
    /// Zero point subtracted from the unsigned codes.
    const ZERO: i32;

    /// The 32 unsigned codes of block `blk`, in element order.
    #[inline(always)]
    fn codes(blk: &[u8]) -> [u8; QK] {
        let mut u = [0u8; QK];
        let qs = &blk[Self::QS_OFFSET..];
        if Self::NIBBLES {
            let qh = Self::QH_OFFSET.map_or(0, |o| {
                u32::from_le_bytes([blk[o], blk[o + 1], blk[o + 2], blk[o + 3]])
            });
            for j in 0..QK / 2 {
                let high = |e: usize| (((qh >> e) & 1) << 4) as u8;
                u[j] = (qs[j] & 0x0f) | high(j);
                u[j + QK / 2] = (qs[j] >> 4) | high(j + QK / 2);
            }
        } else {
            for (v, &q) in u.iter_mut().zip(&qs[..QK]) {
                *v = q ^ 0x80;
            }
        }
        u
    }
}

/// Evaluates `$body` with the type alias `$F` bound to the block layout of the 32-element
/// format `$dtype` (`Q40` … `Q80`): the one place that maps these ggml types to layouts.
macro_rules! with_small_format {
    ($dtype:expr, $F:ident => $body:expr) => {{
        use $crate::quant::format as layouts;
        match $dtype {
            $crate::quant::GgmlType::Q4_0 => {
                type $F = layouts::Q40;
                $body
            }
            $crate::quant::GgmlType::Q4_1 => {
                type $F = layouts::Q41;
                $body
            }
            $crate::quant::GgmlType::Q5_0 => {
                type $F = layouts::Q50;
                $body
            }
            $crate::quant::GgmlType::Q5_1 => {
                type $F = layouts::Q51;
                $body
            }
            $crate::quant::GgmlType::Q8_0 => {
                type $F = layouts::Q80;
                $body
            }
            other => unreachable!("{other} is not a 32-element format"),
        }
    }};
}
pub(crate) use with_small_format;

/// `Q4_0` block layout.
pub(crate) struct Q40;
/// `Q4_1` block layout.
pub(crate) struct Q41;
/// `Q5_0` block layout.
pub(crate) struct Q50;
/// `Q5_1` block layout.
pub(crate) struct Q51;
/// `Q8_0` block layout.
pub(crate) struct Q80;

impl BlockFormat for Q40 {
    const BLOCK_BYTES: usize = Q4_0_BLOCK_BYTES;
    const HAS_MIN: bool = false;
    const QH_OFFSET: Option<usize> = None;
    const QS_OFFSET: usize = 2;
    const NIBBLES: bool = true;
    const ZERO: i32 = 8;
}
impl BlockFormat for Q41 {
    const BLOCK_BYTES: usize = Q4_1_BLOCK_BYTES;
    const HAS_MIN: bool = true;
    const QH_OFFSET: Option<usize> = None;
    const QS_OFFSET: usize = 4;
    const NIBBLES: bool = true;
    const ZERO: i32 = 0;
}
impl BlockFormat for Q50 {
    const BLOCK_BYTES: usize = Q5_0_BLOCK_BYTES;
    const HAS_MIN: bool = false;
    const QH_OFFSET: Option<usize> = Some(2);
    const QS_OFFSET: usize = 6;
    const NIBBLES: bool = true;
    const ZERO: i32 = 16;
}
impl BlockFormat for Q51 {
    const BLOCK_BYTES: usize = Q5_1_BLOCK_BYTES;
    const HAS_MIN: bool = true;
    const QH_OFFSET: Option<usize> = Some(4);
    const QS_OFFSET: usize = 8;
    const NIBBLES: bool = true;
    const ZERO: i32 = 0;
}
impl BlockFormat for Q80 {
    const BLOCK_BYTES: usize = Q8_0_BLOCK_BYTES;
    const HAS_MIN: bool = false;
    const QH_OFFSET: Option<usize> = None;
    const QS_OFFSET: usize = 2;
    const NIBBLES: bool = false;
    const ZERO: i32 = 128;
}

/// Dequantizes rows of a 32-element format exactly as ggml does: `(u − zero)·d`, or
/// `u·d + m` (a product then a sum, never fused).
fn dequantize_blocks<F: BlockFormat>(row: &[u8], out: &mut [f32]) {
    for (o, blk) in out
        .chunks_exact_mut(QK)
        .zip(row.chunks_exact(F::BLOCK_BYTES))
    {
        let d = f16_at(blk);
        let codes = F::codes(blk);
        if F::HAS_MIN {
            let m = f16_at(&blk[2..]);
            for (v, &u) in o.iter_mut().zip(&codes) {
                *v = u as f32 * d + m;
            }
        } else {
            for (v, &u) in o.iter_mut().zip(&codes) {
                *v = (u as i32 - F::ZERO) as f32 * d;
            }
        }
    }
}

/// Dequantizes one row (`row.len() == row_bytes(out.len())`, checked by the caller) exactly
/// as ggml (and gguf-py) do.
pub(crate) fn dequantize_row_into(dtype: GgmlType, row: &[u8], out: &mut [f32]) {
    match dtype {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16_at(b);
            }
        }
        k if k.is_k_quant() => kquant::dequantize_row(dtype, row, out),
        _ => with_small_format!(dtype, F => dequantize_blocks::<F>(row, out)),
    }
}

/// Writes unsigned codes `u` (below `2^bits`) into `blk` in `F`'s layout.
fn pack_codes<F: BlockFormat>(u: &[u8; QK], blk: &mut [u8]) {
    if !F::NIBBLES {
        for (q, &v) in blk[F::QS_OFFSET..].iter_mut().zip(u) {
            *q = v ^ 0x80;
        }
        return;
    }
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        let (lo, hi) = (u[j], u[j + QK / 2]);
        blk[F::QS_OFFSET + j] = (lo & 0x0f) | (hi << 4);
        qh |= (((lo >> 4) & 1) as u32) << j | (((hi >> 4) & 1) as u32) << (j + QK / 2);
    }
    if let Some(o) = F::QH_OFFSET {
        blk[o..o + 4].copy_from_slice(&qh.to_le_bytes());
    }
}

/// Quantizes 32-element blocks as ggml's reference quantizers do (`quantize_row_*_ref`):
/// symmetric formats map the value of largest magnitude to the most negative code, min
/// formats spread `[min, max]` over the codes; `Q8_0` rounds `x / (amax/127)`.
fn quantize_blocks<F: BlockFormat>(src: &[f32], out: &mut [u8]) {
    let levels = if F::NIBBLES && F::QH_OFFSET.is_some() {
        32
    } else {
        16
    };
    for (blk, x) in out
        .chunks_exact_mut(F::BLOCK_BYTES)
        .zip(src.chunks_exact(QK))
    {
        let mut u = [0u8; QK];
        let top = levels as f32 - 1.0;
        if !F::NIBBLES {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            blk[..2].copy_from_slice(&f16_bytes(d));
            for (v, &xi) in u.iter_mut().zip(x) {
                *v = ((xi * id).round() as i8 as u8) ^ 0x80;
            }
        } else if F::HAS_MIN {
            let min = x.iter().copied().fold(f32::MAX, f32::min);
            let max = x.iter().copied().fold(f32::MIN, f32::max);
            let d = (max - min) / top;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            blk[..2].copy_from_slice(&f16_bytes(d));
            blk[2..4].copy_from_slice(&f16_bytes(min));
            for (v, &xi) in u.iter_mut().zip(x) {
                *v = (((xi - min) * id + 0.5) as u8).min(top as u8);
            }
        } else {
            // The signed value of largest magnitude maps to the lowest code, so the full
            // range is used on that side.
            let (mut amax, mut max) = (0.0f32, 0.0f32);
            for &v in x {
                if amax < v.abs() {
                    amax = v.abs();
                    max = v;
                }
            }
            let half = (levels / 2) as f32;
            let d = max / -half;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            blk[..2].copy_from_slice(&f16_bytes(d));
            for (v, &xi) in u.iter_mut().zip(x) {
                *v = ((xi * id + half + 0.5) as u8).min(top as u8);
            }
        }
        pack_codes::<F>(&u, blk);
    }
}

/// Quantizes one row; `out` is exactly `row_bytes(src.len())` long (checked by the caller).
pub(crate) fn quantize_row_into(dtype: GgmlType, src: &[f32], out: &mut [u8]) {
    match dtype {
        GgmlType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(src) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(src) {
                o.copy_from_slice(&f16_bytes(v));
            }
        }
        k if k.is_k_quant() => kquant::quantize_row(dtype, src, out),
        _ => with_small_format!(dtype, F => quantize_blocks::<F>(src, out)),
    }
}

/// Quantizes a row-major `(rows, cols)` f32 matrix into `dtype`'s ggml byte layout: ggml's
/// reference quantizers for the 32-element formats, a simple min/max scheme for the
/// k-quants (see `kquant`). For building test and bench weights; a real model's weights
/// come quantized in its GGUF file.
pub fn quantize_weights(dtype: GgmlType, src: &[f32], cols: usize) -> Result<Vec<u8>, QuantError> {
    let row_bytes = dtype.row_bytes(cols)?;
    if cols == 0 || !src.len().is_multiple_of(cols) {
        return Err(QuantError::NotWholeRows {
            len: src.len(),
            cols,
        });
    }
    let rows = src.len() / cols;
    let mut out = vec![0u8; rows * row_bytes];
    for (o, x) in out.chunks_exact_mut(row_bytes).zip(src.chunks_exact(cols)) {
        quantize_row_into(dtype, x, o);
    }
    Ok(out)
}
