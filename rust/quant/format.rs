//! ggml tensor types and their block layouts: validation, dequantization and the reference
//! weight quantizers (used to build test and bench matrices).

use super::QuantError;

/// Elements per block of every quantized type (ggml `QK4_0 = QK4_1 = QK8_0 = 32`).
pub const QK: usize = 32;

/// Bytes of one `Q4_0` block: `{ d: f16, qs: [u8; 16] }`.
pub(crate) const Q4_0_BLOCK_BYTES: usize = 18;
/// Bytes of one `Q4_1` block: `{ d: f16, m: f16, qs: [u8; 16] }`.
pub(crate) const Q4_1_BLOCK_BYTES: usize = 20;
/// Bytes of one `Q8_0` block: `{ d: f16, qs: [i8; 32] }`.
pub(crate) const Q8_0_BLOCK_BYTES: usize = 34;

/// A ggml tensor type this crate can compute with; the discriminant is ggml's type id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    /// IEEE binary32, one element per "block".
    F32 = 0,
    /// IEEE binary16, one element per "block".
    F16 = 1,
    /// 32 elements: `{ d: f16, qs: [u8; 16] }`, value `(q − 8)·d`.
    Q4_0 = 2,
    /// 32 elements: `{ d: f16, m: f16, qs: [u8; 16] }`, value `q·d + m`.
    Q4_1 = 3,
    /// 32 elements: `{ d: f16, qs: [i8; 32] }`, value `q·d`.
    Q8_0 = 8,
}

impl GgmlType {
    /// Every supported type, in id order.
    pub const ALL: [GgmlType; 5] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
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
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q8_0 => "Q8_0",
        }
    }

    /// Elements per block (1 for the float types, 32 for the quantized ones).
    pub fn block_size(self) -> usize {
        if self.is_quantized() {
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
            GgmlType::Q8_0 => Q8_0_BLOCK_BYTES,
        }
    }

    /// True for the block-quantized types (`Q4_0`, `Q4_1`, `Q8_0`).
    pub fn is_quantized(self) -> bool {
        matches!(self, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
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

/// Dequantizes one row (`row.len() == row_bytes(out.len())`, checked by the caller) exactly
/// as ggml does: `(q − 8)·d`, `q·d + m` (a product then a sum, never fused) and `q·d`.
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
        GgmlType::Q4_0 => {
            for (o, blk) in out
                .chunks_exact_mut(QK)
                .zip(row.chunks_exact(Q4_0_BLOCK_BYTES))
            {
                let d = f16_at(blk);
                let (low, high) = o.split_at_mut(QK / 2);
                for ((l, h), &q) in low.iter_mut().zip(high).zip(&blk[2..]) {
                    *l = ((q & 0x0f) as i32 - 8) as f32 * d;
                    *h = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, blk) in out
                .chunks_exact_mut(QK)
                .zip(row.chunks_exact(Q4_1_BLOCK_BYTES))
            {
                let d = f16_at(blk);
                let m = f16_at(&blk[2..]);
                let (low, high) = o.split_at_mut(QK / 2);
                for ((l, h), &q) in low.iter_mut().zip(high).zip(&blk[4..]) {
                    *l = (q & 0x0f) as f32 * d + m;
                    *h = (q >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (o, blk) in out
                .chunks_exact_mut(QK)
                .zip(row.chunks_exact(Q8_0_BLOCK_BYTES))
            {
                let d = f16_at(blk);
                for (v, &q) in o.iter_mut().zip(&blk[2..]) {
                    *v = q as i8 as f32 * d;
                }
            }
        }
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Quantizes one row as ggml's reference quantizers do (`quantize_row_*_ref`); `out` is
/// exactly `row_bytes(src.len())` long (checked by the caller).
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
        GgmlType::Q4_0 => {
            for (blk, x) in out
                .chunks_exact_mut(Q4_0_BLOCK_BYTES)
                .zip(src.chunks_exact(QK))
            {
                // The signed value of largest magnitude maps to −8, so the full 4-bit range
                // is used on that side.
                let (mut amax, mut max) = (0.0f32, 0.0f32);
                for &v in x {
                    if amax < v.abs() {
                        amax = v.abs();
                        max = v;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                blk[..2].copy_from_slice(&f16_bytes(d));
                for j in 0..QK / 2 {
                    let lo = ((x[j] * id + 8.5) as i8).min(15) as u8;
                    let hi = ((x[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
                    blk[2 + j] = lo | (hi << 4);
                }
            }
        }
        GgmlType::Q4_1 => {
            for (blk, x) in out
                .chunks_exact_mut(Q4_1_BLOCK_BYTES)
                .zip(src.chunks_exact(QK))
            {
                let min = x.iter().copied().fold(f32::MAX, f32::min);
                let max = x.iter().copied().fold(f32::MIN, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                blk[..2].copy_from_slice(&f16_bytes(d));
                blk[2..4].copy_from_slice(&f16_bytes(min));
                for j in 0..QK / 2 {
                    let lo = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
                    let hi = (((x[j + QK / 2] - min) * id + 0.5) as i8).min(15) as u8;
                    blk[4 + j] = lo | (hi << 4);
                }
            }
        }
        GgmlType::Q8_0 => {
            for (blk, x) in out
                .chunks_exact_mut(Q8_0_BLOCK_BYTES)
                .zip(src.chunks_exact(QK))
            {
                let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                blk[..2].copy_from_slice(&f16_bytes(d));
                for (q, &v) in blk[2..].iter_mut().zip(x) {
                    *q = (v * id).round() as i8 as u8;
                }
            }
        }
    }
}

/// Quantizes a row-major `(rows, cols)` f32 matrix into `dtype`'s ggml byte layout with
/// ggml's reference quantizers. For building test and bench weights; a real model's weights
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
