//! Quantized weight formats (ggml's block layouts) and fast, batch-invariant matmul kernels.
//!
//! A weight matrix is a borrowed view of ggml bytes ([`QMatrix`]): `rows` rows of `cols`
//! elements, each row a sequence of blocks (a GGUF tensor with dims `[cols, rows]`). The
//! types are F32, F16, the 32-element formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the k-quants
//! Q2_K…Q6_K (256-element super-blocks of 16 or 8 groups with their own 4-, 6- or 8-bit
//! scales). Every other ggml type is refused by name ([`unsupported_type_message`]). The
//! input of a matmul is quantized once ([`QuantizedInput`]) into 8-bit blocks with f32
//! scales — 32-element blocks for the 32-element formats, 256-element super-blocks with
//! per-16 and per-32 sums (llama.cpp's Q8_K) for the k-quants — and can then be multiplied by
//! several matrices ([`matmul`]); the output is `(n_tokens, rows)` row-major.
//!
//! # Bit-exactness
//! Every output element `out[t, r]` is computed with one canonical sequence of f32
//! operations, defined by the scalar kernel: exact integer block dot products, then per
//! block `term = (dw·da)·isum (+ m·s)` (32-element formats) or per super-block
//! `term = (d·da)·isum (− (dmin·da)·msum)` (k-quants, with the group scales and mins applied
//! in the exact integers `isum` and `msum`), and `acc = acc + term` in block order, starting
//! from `0.0`; float weights use 16 lane accumulators and a fixed reduction tree. The SIMD
//! kernels put *rows* in vector lanes, so each lane performs exactly that sequence.
//! Consequently the result does not depend on the kernel (scalar, AVX2, AVX-512, AVX-512
//! VNNI, AMX-INT8 tiles), on how many tokens are computed together or where a token sits in the batch, nor
//! on the rayon thread count: decode, chunked prefill and unchunked prefill agree bit for
//! bit.
//!
//! # Accuracy
//! Quantized weights are used exactly (the integer dot products are exact); the only
//! approximation is the 8-bit activation: each element moves by at most half a step
//! `d_b = max|x_b| / 127` of its activation block `b` (32 elements, or 256 for k-quant
//! weights), so `|out − x·wᵀ| ≤ Σ_b (d_b/2)·Σ_{i∈b} |w_i|` plus f32 rounding (a few ulps of
//! `Σ|w_i|·|x_i|` per block). The 256-element blocks of the k-quants are coarser where the
//! input has outliers (one large value sets the step of 256 elements, not 32): that is
//! llama.cpp's trade too. Its block scales are f16 (32-element) or f32 (Q8_K); ours are f32.
//! The refined precision ([`QuantizedInput::quantize_refined`]) also quantizes the residual
//! `x − dq(q(x))`, on a step of `d_b/256`: the activation error becomes ~1/256 of the bound
//! above (about 14 bits), at twice the integer work but the same weight traffic. For the
//! 32-element formats the two are one 16-bit code `256·hi + lo` per element, in two byte
//! planes: a block's two exact integer dots combine into one (`isum = 256·isum_hi +
//! isum_lo`) before its single float epilogue, so the canonical sequence above holds with
//! `da = d_b/256`. The k-quants multiply the residual as `n` more token rows, added by
//! [`fold_refined`] ([`QuantizedInput::product_tokens`]). Float (F32/F16) weights use the f32
//! input as is.
//!
//! # Speed
//! Rows sit in vector lanes (16 for AVX-512, 8 for AVX2). Each block of a row group is
//! unpacked once into dword-interleaved code vectors (lane = row, four codes per lane), so a
//! token's dot product is one `vpdpbusd` per four elements with the activation word
//! broadcast, straight into the row lanes (`lanes`). Up to 8 activation rows (4 with AVX2;
//! a refined token dots both of its byte planes) consume each block as it is unpacked, with their
//! accumulators in registers; more rows share the unpacked blocks of a column chunk from an
//! L1 buffer, 8 (4) at a time.
//! The next row group is prefetched into L2; `matmul` splits rows (and tokens for large
//! batches) over the current rayon pool. Run a forward pass inside `ThreadPool::install` so
//! the calling thread takes part.
//! The kernel helpers are `#[inline(always)]` functions without target features of their
//! own; they get them by being inlined into a `#[target_feature]` entry point. A closure in
//! such a helper is a separate function that does not get them, so its intrinsics would be
//! compiled as calls (once a third of the AVX-512 time): the helpers use no closures around
//! intrinsics, and `test_no_simd_intrinsic_is_an_out_of_line_call` reads the extension's
//! symbols to keep it so.

mod activation;
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod format;
mod interleave;
mod kernel;
mod kquant;
#[cfg(target_arch = "x86_64")]
mod lanes;
mod scalar;
mod side;
#[cfg(test)]
mod tests;

pub use activation::{fold_refined, QuantScratch, QuantizedInput};
pub use format::{ggml_type_name, quantize_weights, GgmlType, QK};
pub use interleave::{interleave_rows, interleave_rows_into};
pub use kernel::Kernel;
pub use kquant::QK_K;
pub use side::SidePrefetch;

/// The supported ggml types and their ids, for error messages (in [`GgmlType::ALL`] order).
pub const SUPPORTED_TYPES: &str =
    "F32=0, F16=1, Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q2_K=10, Q3_K=11, Q4_K=12, Q5_K=13, Q6_K=14";

/// The message refusing ggml type id `id` (of tensor `tensor`, when known): names the type,
/// e.g. `unsupported tensor type IQ2_XS in blk.3.ffn_down.weight (ggml type id 17; …)`.
pub fn unsupported_type_message(id: u32, tensor: Option<&str>) -> String {
    let place = tensor.map(|t| format!(" in {t}")).unwrap_or_default();
    match ggml_type_name(id) {
        Some(name) => format!(
            "unsupported tensor type {name}{place} (ggml type id {id}; supported: {SUPPORTED_TYPES})"
        ),
        None => format!(
            "unknown ggml type id {id}{place} (supported: {SUPPORTED_TYPES})"
        ),
    }
}

/// Errors of the quantized formats and kernels. Every check happens before any output is
/// written, so a failed call leaves its output buffer untouched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// The ggml type id is not one this crate computes with.
    UnsupportedType {
        /// The rejected ggml type id.
        id: u32,
    },
    /// A matrix or input with zero rows or zero columns.
    EmptyShape {
        /// Rows (or tokens) given.
        rows: usize,
        /// Columns given.
        cols: usize,
    },
    /// `cols` is not a multiple of the type's block size.
    ColsNotBlockMultiple {
        /// The weight type.
        dtype: GgmlType,
        /// Columns given.
        cols: usize,
        /// Elements per block of `dtype`.
        block_size: usize,
    },
    /// The weight bytes do not have the exact length `rows · row_bytes`.
    DataLength {
        /// The weight type.
        dtype: GgmlType,
        /// Rows given.
        rows: usize,
        /// Columns given.
        cols: usize,
        /// Bytes a `(rows, cols)` matrix of `dtype` has.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// A shape whose element or byte count overflows `usize`.
    ShapeOverflow,
    /// An f32 matrix whose length is not a multiple of its row length.
    NotWholeRows {
        /// Elements given.
        len: usize,
        /// Elements per row.
        cols: usize,
    },
    /// Input length is not `n_tokens · cols`.
    InputLength {
        /// Tokens given.
        n_tokens: usize,
        /// Columns given.
        cols: usize,
        /// `n_tokens · cols`.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// The input's row length differs from the weight matrix's.
    ColsMismatch {
        /// Columns of the weight matrix.
        weight_cols: usize,
        /// Columns of the input.
        input_cols: usize,
    },
    /// The output buffer does not have `n_tokens · rows` elements.
    OutputLength {
        /// `n_tokens · rows`.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// A row index (token id, for embeddings) beyond the matrix.
    RowOutOfRange {
        /// The index given.
        row: usize,
        /// Rows of the matrix.
        rows: usize,
    },
    /// The input was quantized for other weight types and lacks the blocks this one needs
    /// (see [`QuantizedInput::quantize_for`]).
    MissingBlocks {
        /// The weight type whose activation blocks are missing.
        dtype: GgmlType,
    },
    /// The requested kernel needs CPU features this machine lacks.
    KernelUnavailable {
        /// The requested kernel.
        kernel: Kernel,
    },
}

impl std::fmt::Display for QuantError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuantError::UnsupportedType { id } => {
                f.write_str(&unsupported_type_message(*id, None))
            }
            QuantError::EmptyShape { rows, cols } => {
                write!(f, "empty shape ({rows}, {cols}): rows and columns must be positive")
            }
            QuantError::ColsNotBlockMultiple {
                dtype,
                cols,
                block_size,
            } => write!(
                f,
                "{dtype} rows have blocks of {block_size} elements, but cols = {cols} is not a multiple of {block_size}"
            ),
            QuantError::DataLength {
                dtype,
                rows,
                cols,
                expected,
                actual,
            } => write!(
                f,
                "a ({rows}, {cols}) {dtype} matrix has {expected} bytes, got {actual}"
            ),
            QuantError::ShapeOverflow => f.write_str("shape too large: size overflows usize"),
            QuantError::NotWholeRows { len, cols } => write!(
                f,
                "{len} elements is not a whole number of rows of {cols} elements"
            ),
            QuantError::InputLength {
                n_tokens,
                cols,
                expected,
                actual,
            } => write!(
                f,
                "input of {n_tokens} tokens × {cols} columns needs {expected} floats, got {actual}"
            ),
            QuantError::ColsMismatch {
                weight_cols,
                input_cols,
            } => write!(
                f,
                "input rows have {input_cols} columns but the weight matrix has {weight_cols}"
            ),
            QuantError::OutputLength { expected, actual } => write!(
                f,
                "output needs n_tokens × rows = {expected} floats, got {actual}"
            ),
            QuantError::RowOutOfRange { row, rows } => {
                write!(f, "row {row} out of range for a matrix of {rows} rows")
            }
            QuantError::MissingBlocks { dtype } => write!(
                f,
                "the input was quantized without the activation blocks {dtype} weights need"
            ),
            QuantError::KernelUnavailable { kernel } => {
                write!(f, "kernel {kernel} needs CPU features this machine lacks")
            }
        }
    }
}

impl std::error::Error for QuantError {}

/// A validated, borrowed weight matrix in ggml byte layout: `rows` rows of `cols` elements,
/// each row `cols / block_size` blocks of `dtype`.
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: &'a [u8],
    /// Whole groups of 16 rows are in the interleaved layout (`interleave`).
    interleaved: bool,
}

impl<'a> QMatrix<'a> {
    /// Views `data` as a `(rows, cols)` matrix of `dtype`.
    ///
    /// Errors if a dimension is zero, `cols` is not a multiple of the block size, or
    /// `data.len()` is not exactly `rows · row_bytes`.
    pub fn new(
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, QuantError> {
        if rows == 0 || cols == 0 {
            return Err(QuantError::EmptyShape { rows, cols });
        }
        let row_bytes = dtype.row_bytes(cols)?;
        let expected = rows
            .checked_mul(row_bytes)
            .ok_or(QuantError::ShapeOverflow)?;
        if data.len() != expected {
            return Err(QuantError::DataLength {
                dtype,
                rows,
                cols,
                expected,
                actual: data.len(),
            });
        }
        Ok(Self {
            dtype,
            rows,
            cols,
            row_bytes,
            data,
            interleaved: false,
        })
    }

    /// Views `data`, made by [`interleave_rows`], as a `(rows, cols)` matrix of `dtype` in the
    /// interleaved layout (the SIMD kernels load 16 rows of a block without transposing).
    /// Every product and dequantization equals that of the ggml-layout matrix, bit for bit.
    ///
    /// Errors as [`QMatrix::new`], and for a type without an interleaved layout (the
    /// 32-element formats have one).
    pub fn new_interleaved(
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, QuantError> {
        if !Self::interleavable(dtype) {
            return Err(QuantError::UnsupportedType { id: dtype.id() });
        }
        Ok(Self {
            interleaved: true,
            ..Self::new(dtype, rows, cols, data)?
        })
    }

    /// Whether `dtype` has an interleaved layout (the 32-element formats).
    pub fn interleavable(dtype: GgmlType) -> bool {
        interleave::supports(dtype)
    }

    /// Whether the matrix is in the interleaved layout ([`QMatrix::new_interleaved`]).
    pub fn is_interleaved(&self) -> bool {
        self.interleaved
    }

    /// `f` of row `r`'s bytes in ggml layout (copied out of an interleaved group).
    fn with_row<R>(&self, r: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        let plain = &self.data[r * self.row_bytes..(r + 1) * self.row_bytes];
        if !self.interleaved {
            return f(plain);
        }
        let mut row = vec![0u8; self.row_bytes];
        interleave::row_into(self.dtype, self.data, self.row_bytes, r, &mut row);
        f(&row)
    }

    /// Views a GGUF tensor: ggml type id `type_id`, dims `[cols, rows, ...]` (ggml's `ne`,
    /// innermost first; trailing dims multiply into rows), bytes `data`.
    pub fn from_gguf(type_id: u32, dims: &[u64], data: &'a [u8]) -> Result<Self, QuantError> {
        let dtype = GgmlType::from_id(type_id)?;
        let as_usize = |v: u64| usize::try_from(v).map_err(|_| QuantError::ShapeOverflow);
        let cols = as_usize(*dims.first().unwrap_or(&0))?;
        let rows = dims[1.min(dims.len())..]
            .iter()
            .try_fold(1usize, |acc, &d| {
                acc.checked_mul(as_usize(d)?)
                    .ok_or(QuantError::ShapeOverflow)
            })?;
        Self::new(dtype, rows, cols, data)
    }

    /// Element type.
    pub fn dtype(&self) -> GgmlType {
        self.dtype
    }

    /// Number of rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Elements per row (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The raw ggml bytes.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// Dequantizes row `row` into `out` (`cols` floats), bit-exactly as ggml does.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), QuantError> {
        if row >= self.rows {
            return Err(QuantError::RowOutOfRange {
                row,
                rows: self.rows,
            });
        }
        if out.len() != self.cols {
            return Err(QuantError::OutputLength {
                expected: self.cols,
                actual: out.len(),
            });
        }
        self.with_row(row, |bytes| {
            format::dequantize_row_into(self.dtype, bytes, out)
        });
        Ok(())
    }

    /// The whole matrix as row-major f32 (for tests and references; a model never needs it).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            self.with_row(r, |bytes| format::dequantize_row_into(self.dtype, bytes, o));
        }
        out
    }

    /// Embedding lookup: dequantizes row `ids[i]` into `out[i·cols .. (i+1)·cols]`.
    ///
    /// Errors (writing nothing) if an id is out of range or `out.len() != ids.len() · cols`.
    pub fn embed(&self, ids: &[u32], out: &mut [f32]) -> Result<(), QuantError> {
        let expected = ids
            .len()
            .checked_mul(self.cols)
            .ok_or(QuantError::ShapeOverflow)?;
        if out.len() != expected {
            return Err(QuantError::OutputLength {
                expected,
                actual: out.len(),
            });
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.rows) {
            return Err(QuantError::RowOutOfRange {
                row: bad as usize,
                rows: self.rows,
            });
        }
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(self.cols)) {
            self.with_row(id as usize, |bytes| {
                format::dequantize_row_into(self.dtype, bytes, o)
            });
        }
        Ok(())
    }
}

/// `out[t, r] = Σ_c input[t, c] · w[r, c]` for every token `t` and row `r`, with the fastest
/// kernel this CPU has, split over the current rayon pool. `out` is `(tokens, rows)`
/// row-major, `tokens` being [`QuantizedInput::product_tokens`] (the input's `n_tokens`, or
/// twice that for a k-quant and a refined input: fold it with [`fold_refined`]). Bit-identical to [`matmul_with_kernel`] with any other kernel and to computing
/// any subset of the tokens separately.
pub fn matmul(
    w: &QMatrix<'_>,
    input: &QuantizedInput<'_>,
    out: &mut [f32],
) -> Result<(), QuantError> {
    kernel::matmul_with(Kernel::detect(), w, input, out)
}

/// [`matmul`] of several matrices with one input, as one parallel region (q/k/v, gate/up):
/// each output equals what [`matmul`] writes for its matrix. Every shape is checked before
/// anything is computed; on error no output is written.
pub fn matmul_many(
    products: &mut [(&QMatrix<'_>, &mut [f32])],
    input: &QuantizedInput<'_>,
) -> Result<(), QuantError> {
    kernel::matmul_many_with(Kernel::detect(), products, input, None)
}

/// [`matmul_many`] that also brings `side`'s cache lines into L2, a share per row group, so
/// the next stage's reads overlap this one's arithmetic. The outputs are those of
/// [`matmul_many`].
pub fn matmul_many_prefetching(
    products: &mut [(&QMatrix<'_>, &mut [f32])],
    input: &QuantizedInput<'_>,
    side: &SidePrefetch,
) -> Result<(), QuantError> {
    kernel::matmul_many_with(Kernel::detect(), products, input, Some(side))
}

/// [`matmul`] with an explicit kernel (errors if this CPU cannot run it).
pub fn matmul_with_kernel(
    kernel: Kernel,
    w: &QMatrix<'_>,
    input: &QuantizedInput<'_>,
    out: &mut [f32],
) -> Result<(), QuantError> {
    kernel::matmul_with(kernel, w, input, out)
}

/// Convenience: quantizes `x` (`(n_tokens, cols)` row-major) into `scratch`, then
/// [`matmul`]. Use [`QuantizedInput::quantize`] directly to share one input between several
/// matrices.
pub fn matmul_f32(
    w: &QMatrix<'_>,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    scratch: &mut QuantScratch,
) -> Result<(), QuantError> {
    let input = QuantizedInput::quantize(x, n_tokens, w.cols(), scratch)?;
    matmul(w, &input, out)
}
