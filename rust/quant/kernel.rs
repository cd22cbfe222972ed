//! Kernel selection and the work split: which ISA computes, and which thread computes
//! which rectangle of the output. Neither choice can change a single output bit, because
//! every output element is computed by exactly one kernel call with the canonical per-element
//! arithmetic (see `scalar`).

use std::ops::Range;
use std::sync::OnceLock;

use rayon::prelude::*;

use super::activation::{ActBlocks, QuantizedInput, SuperActBlocks};
use super::format::{with_small_format, GgmlType};
use super::kquant::with_k_format;
use super::side::{with_current, SidePrefetch};
#[cfg(target_arch = "x86_64")]
use super::{amx, avx2, avx512};
use super::{interleave, scalar, QMatrix, QuantError};

/// Raw output pointer shared by the tasks of one matmul; each task writes a disjoint
/// rectangle of `(token, row)` elements of the `(n_tokens, rows)` output.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr {
    ptr: *mut f32,
    /// Row stride of the output (= rows of the weight matrix).
    pub(crate) stride: usize,
}

// SAFETY: tasks write disjoint elements only (each rectangle has exactly one owner), and the
// matmul's `&mut [f32]` borrow outlives every task (rayon joins them before returning).
unsafe impl Send for OutPtr {}
// SAFETY: as above; no element is ever read or written by two tasks.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Writes `out[t, r]`.
    ///
    /// # Safety
    /// `t·stride + r` must be inside the output and owned by the calling task.
    #[inline(always)]
    pub(crate) unsafe fn write(self, t: usize, r: usize, v: f32) {
        // SAFETY: forwarded to the caller.
        unsafe { *self.ptr.add(t * self.stride + r) = v };
    }

    /// The same output with its columns shifted by `r`: column 0 is column `r`.
    #[inline(always)]
    pub(crate) fn shifted(self, r: usize) -> OutPtr {
        OutPtr {
            ptr: self.ptr.wrapping_add(r),
            stride: self.stride,
        }
    }

    /// Pointer to `out[t, r]`.
    ///
    /// # Safety
    /// As for [`OutPtr::write`], for every element the caller then writes through it.
    #[inline(always)]
    pub(crate) unsafe fn at(self, t: usize, r: usize) -> *mut f32 {
        // SAFETY: forwarded to the caller.
        unsafe { self.ptr.add(t * self.stride + r) }
    }
}

/// An implementation of the matmul kernels. All of them give bit-identical results.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Portable scalar code: the canonical reference.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (8 rows per step, `vpmaddubsw`).
    Avx2,
    /// x86-64 AVX-512 F + BW without VNNI (16 rows per step, `vpmaddubsw`).
    Avx512,
    /// x86-64 AVX-512 F + BW + VNNI (16 rows per step, `vpdpbusd`).
    Avx512Vnni,
    /// AVX-512 VNNI plus AMX-INT8 tiles for the 32-element formats from 2 tokens on
    /// (16 rows × 16 tokens per tile product); otherwise as [`Kernel::Avx512Vnni`].
    Amx,
}

impl Kernel {
    /// Every kernel, slowest first.
    pub const ALL: [Kernel; 5] = [
        Kernel::Scalar,
        Kernel::Avx2,
        Kernel::Avx512,
        Kernel::Avx512Vnni,
        Kernel::Amx,
    ];

    /// Short name (`"scalar"`, `"avx2"`, `"avx512"`, `"avx512-vnni"`, `"amx"`).
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512 => "avx512",
            Kernel::Avx512Vnni => "avx512-vnni",
            Kernel::Amx => "amx",
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => {
                Kernel::Avx512.is_available() && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => Kernel::Avx512Vnni.is_available() && super::amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Output rows per vector lane group: 16 for the AVX-512 kernels, 8 for AVX2, 1 for the
    /// scalar kernel (the interleaved layout gains only where it is 16).
    pub fn lanes(self) -> usize {
        match self {
            Kernel::Scalar => 1,
            Kernel::Avx2 => 8,
            Kernel::Avx512 | Kernel::Avx512Vnni | Kernel::Amx => 16,
        }
    }

    /// The kernels this CPU can run, slowest first.
    pub fn available() -> Vec<Kernel> {
        Self::ALL.into_iter().filter(|k| k.is_available()).collect()
    }

    /// The fastest available kernel (detected once, then cached). The environment variable
    /// `AMPLITUHEDRON_KERNEL` (a [`Kernel::name`]) caps it: the fastest available kernel no
    /// faster than the one named, e.g. `avx512-vnni` on an AMX machine, for A/B measurements.
    /// Every kernel gives the same bits, so the cap changes speed only. An unknown name is
    /// ignored (with a warning on stderr).
    pub fn detect() -> Kernel {
        static BEST: OnceLock<Kernel> = OnceLock::new();
        *BEST.get_or_init(|| {
            let cap = std::env::var("AMPLITUHEDRON_KERNEL").ok().and_then(|name| {
                let found = Self::from_name(name.trim());
                if found.is_none() {
                    eprintln!(
                        "amplituhedron: AMPLITUHEDRON_KERNEL={name:?} is not a kernel (one of {}); ignored",
                        Self::ALL.map(Kernel::name).join(", ")
                    );
                }
                found
            });
            Self::best_up_to(cap.unwrap_or(Kernel::Amx))
        })
    }

    /// The fastest available kernel no faster than `cap` (in [`Kernel::ALL`] order).
    pub fn best_up_to(cap: Kernel) -> Kernel {
        Self::ALL
            .into_iter()
            .rev()
            .skip_while(|&k| k != cap)
            .find(|k| k.is_available())
            .unwrap_or(Kernel::Scalar)
    }

    /// The kernel named `name` ([`Kernel::name`]).
    pub fn from_name(name: &str) -> Option<Kernel> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Row-split unit: a multiple of every kernel's row group (16 for AVX-512, 8 for AVX2).
const ROW_UNIT: usize = 16;
/// Token-split unit: the largest token tile of the kernels.
const TOKEN_UNIT: usize = 8;
/// Tasks per rayon thread, for load balance.
const TASKS_PER_THREAD: usize = 2;
/// Below this many weight bytes × tokens a matmul runs on the calling thread: handing work
/// to another thread costs a few microseconds, about what one thread needs to stream this
/// much (k/v projections of a decode step stay on one thread).
const PARALLEL_MIN_WORK: usize = 96 * 1024;

/// Checks shapes, then computes `out = input · wᵀ` with `kernel` on the current rayon pool.
pub(crate) fn matmul_with(
    kernel: Kernel,
    w: &QMatrix<'_>,
    input: &QuantizedInput<'_>,
    out: &mut [f32],
) -> Result<(), QuantError> {
    let job = Job::new(kernel, w, input, out)?;
    run_jobs(&[job], None);
    Ok(())
}

/// [`matmul_with`] for several matrices applied to one input (q/k/v, gate/up), as one
/// parallel region: one hand-off to the pool instead of one per matrix, and the small
/// matrices of a decode step no longer leave a thread idle. Every output is what
/// [`matmul_with`] would write (each element's arithmetic is the same). Shapes are all
/// checked before anything is computed. The kernels prefetch `side`, if given, as they go.
pub(crate) fn matmul_many_with(
    kernel: Kernel,
    products: &mut [(&QMatrix<'_>, &mut [f32])],
    input: &QuantizedInput<'_>,
    side: Option<&SidePrefetch>,
) -> Result<(), QuantError> {
    let jobs = products
        .iter_mut()
        .map(|(w, out)| Job::new(kernel, w, input, out))
        .collect::<Result<Vec<_>, _>>()?;
    run_jobs(&jobs, side);
    Ok(())
}

/// Runs every job's whole rectangle: on the calling thread when the total work is small,
/// else as one set of pool tasks (rows split first — each thread then streams only its share
/// of the weights — tokens only when a matrix has too few row units for its share of tasks).
fn run_jobs(jobs: &[Job<'_>], side: Option<&SidePrefetch>) {
    let threads = rayon::current_num_threads();
    let work = |job: &Job<'_>| job.w.data().len().saturating_mul(job.tokens);
    let total: usize = jobs.iter().map(work).sum();
    if threads == 1 || total < PARALLEL_MIN_WORK {
        with_current(side, || {
            for job in jobs {
                // SAFETY: each job's whole output, owned by its caller through `out`.
                unsafe { job.run(0..job.w.rows(), 0..job.tokens) };
            }
        });
        return;
    }
    // Tasks per thread for each matrix: matrices of unequal sizes (q beside k and v) then
    // cut into tasks of similar size, which the pool balances.
    let target = threads * TASKS_PER_THREAD * jobs.len();
    // A job's (row chunks, token chunks): its share of the tasks by its share of the work (at
    // least one). Recomputed where needed — there are a few jobs — so a call allocates nothing.
    let chunks = |job: &Job<'_>| {
        let share = (target * work(job)).div_ceil(total.max(1)).max(1);
        let row_chunks = job.w.rows().div_ceil(ROW_UNIT).min(share);
        let token_units = job.tokens.div_ceil(TOKEN_UNIT);
        (row_chunks, share.div_ceil(row_chunks).min(token_units))
    };
    let span = |chunk: usize, chunks: usize, units: usize, unit: usize, len: usize| {
        (chunk * units / chunks * unit).min(len)..((chunk + 1) * units / chunks * unit).min(len)
    };
    let n_tasks: usize = jobs.iter().map(|j| chunks(j).0 * chunks(j).1).sum();
    (0..n_tasks).into_par_iter().for_each(|mut task| {
        for job in jobs {
            let (row_chunks, token_chunks) = chunks(job);
            if task >= row_chunks * token_chunks {
                task -= row_chunks * token_chunks;
                continue;
            }
            let row_units = job.w.rows().div_ceil(ROW_UNIT);
            let rows = span(
                task / token_chunks,
                row_chunks,
                row_units,
                ROW_UNIT,
                job.w.rows(),
            );
            let tokens = span(
                task % token_chunks,
                token_chunks,
                job.tokens.div_ceil(TOKEN_UNIT),
                TOKEN_UNIT,
                job.tokens,
            );
            // SAFETY: the tasks of a job partition its output (`span` splits rows and tokens
            // into disjoint ranges), jobs write distinct outputs, and every `out` is borrowed
            // until they all finish.
            with_current(side, || unsafe { job.run(rows, tokens) });
            return;
        }
    });
}

/// The activations a matmul multiplies by, in the form its weight type needs.
#[derive(Clone, Copy)]
pub(crate) enum Act<'a> {
    /// f32 rows for float weights.
    Float(&'a [f32]),
    /// 32-element blocks for `Q4_0`…`Q8_0`.
    Blocks(ActBlocks<'a>),
    /// 256-element super-blocks for the k-quants.
    Super(SuperActBlocks<'a>),
}

/// One validated matmul: everything a task needs to compute its rectangle.
pub(crate) struct Job<'a> {
    pub(crate) kernel: Kernel,
    pub(crate) w: &'a QMatrix<'a>,
    pub(crate) act: Act<'a>,
    /// Token rows of the product ([`QuantizedInput::product_tokens`]).
    pub(crate) tokens: usize,
    pub(crate) out: OutPtr,
}

impl<'a> Job<'a> {
    /// Checks that `w`, `input` and `out` fit together and that this CPU can run `kernel`.
    fn new(
        kernel: Kernel,
        w: &'a QMatrix<'a>,
        input: &'a QuantizedInput<'_>,
        out: &'a mut [f32],
    ) -> Result<Self, QuantError> {
        if !kernel.is_available() {
            return Err(QuantError::KernelUnavailable { kernel });
        }
        if input.cols() != w.cols() {
            return Err(QuantError::ColsMismatch {
                weight_cols: w.cols(),
                input_cols: input.cols(),
            });
        }
        // Quantized weights need the matching 8-bit blocks, which exist because cols matched
        // and a quantized matrix's cols is a multiple of its block size.
        // (An input built for other weight types only lacks them: an error, not a panic.)
        let missing = QuantError::MissingBlocks { dtype: w.dtype() };
        let act = if w.dtype().is_k_quant() {
            Act::Super(input.super_blocks().ok_or(missing)?)
        } else if w.dtype().is_quantized() {
            Act::Blocks(input.blocks().ok_or(missing)?)
        } else {
            Act::Float(input.f32_rows())
        };
        let tokens = input.product_tokens(w.dtype());
        let expected = tokens * w.rows();
        if out.len() != expected {
            return Err(QuantError::OutputLength {
                expected,
                actual: out.len(),
            });
        }
        let out = OutPtr {
            ptr: out.as_mut_ptr(),
            stride: w.rows(),
        };
        Ok(Job {
            kernel,
            w,
            act,
            tokens,
            out,
        })
    }
}

impl Job<'_> {
    /// Computes `out[t, r]` for `r` in `rows`, `t` in `tokens`.
    ///
    /// # Safety
    /// `rows × tokens` lies inside the output and no other thread accesses those elements
    /// during the call.
    unsafe fn run(&self, rows: Range<usize>, tokens: Range<usize>) {
        if rows.is_empty() || tokens.is_empty() {
            return;
        }
        let w = self.w;
        let (data, row_bytes) = (w.data(), w.row_bytes());
        let dtype = w.dtype();
        // SAFETY: (all arms) the rectangle is in bounds and exclusively ours (caller), the
        // weights and activations hold every row and token of the matmul (`matmul_with`
        // checked the shapes), and the kernel's CPU features were checked by
        // `Kernel::is_available` in `matmul_with`.
        unsafe {
            match self.act {
                Act::Float(x) => float_rect(
                    self.kernel,
                    dtype,
                    data,
                    row_bytes,
                    x,
                    w.cols(),
                    rows,
                    tokens,
                    self.out,
                ),
                Act::Blocks(act) => quant_rect(
                    self.kernel,
                    dtype,
                    data,
                    row_bytes,
                    w.is_interleaved(),
                    &act,
                    rows,
                    tokens,
                    self.out,
                ),
                Act::Super(act) => super_rect(
                    self.kernel,
                    dtype,
                    data,
                    row_bytes,
                    &act,
                    rows,
                    tokens,
                    self.out,
                ),
            }
        }
    }
}

/// Float-weight rectangle with `kernel`.
///
/// # Safety
/// As for [`scalar::float_rect`], plus the kernel's CPU features.
#[allow(clippy::too_many_arguments)]
unsafe fn float_rect(
    kernel: Kernel,
    dtype: GgmlType,
    data: &[u8],
    row_bytes: usize,
    x: &[f32],
    cols: usize,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    let f16 = dtype == GgmlType::F16;
    // SAFETY: forwarded to the caller.
    unsafe {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx | Kernel::Avx512Vnni | Kernel::Avx512 => {
                super::avx512::float_rect(f16, data, row_bytes, x, cols, rows, tokens, out)
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                super::avx2::float_rect(f16, data, row_bytes, x, cols, rows, tokens, out)
            }
            _ => scalar::float_rect(f16, data, row_bytes, x, cols, rows, tokens, out),
        }
    }
}

/// Rectangle of a 32-element format with `kernel`.
///
/// # Safety
/// As for [`scalar::quant_rect`], plus the kernel's CPU features.
#[allow(clippy::too_many_arguments)]
unsafe fn quant_rect(
    kernel: Kernel,
    dtype: GgmlType,
    data: &[u8],
    row_bytes: usize,
    il: bool,
    act: &ActBlocks<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => amx::small_amx(dtype, data, row_bytes, il, act, rows, tokens, out),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => {
                avx512::small_vnni(dtype, data, row_bytes, il, act, rows, tokens, out)
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => avx512::small_bw(dtype, data, row_bytes, il, act, rows, tokens, out),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => avx2::small(dtype, data, row_bytes, il, act, rows, tokens, out),
            _ if il => {
                // Each row back in ggml layout, then the canonical row dot.
                let mut row = vec![0u8; row_bytes];
                for r in rows {
                    interleave::row_into(dtype, data, row_bytes, r, &mut row);
                    with_small_format!(dtype, F => scalar::quant_rect::<F>(
                        &row, row_bytes, act, 0..1, tokens.clone(), out.shifted(r)
                    ))
                }
            }
            _ => {
                with_small_format!(dtype, F => scalar::quant_rect::<F>(data, row_bytes, act, rows, tokens, out))
            }
        }
    }
}

/// Rectangle of a k-quant with `kernel`.
///
/// # Safety
/// As for [`scalar::super_rect`], plus the kernel's CPU features.
#[allow(clippy::too_many_arguments)]
unsafe fn super_rect(
    kernel: Kernel,
    dtype: GgmlType,
    data: &[u8],
    row_bytes: usize,
    act: &SuperActBlocks<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx | Kernel::Avx512Vnni => {
                avx512::k_vnni(dtype, data, row_bytes, act, rows, tokens, out)
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => avx512::k_bw(dtype, data, row_bytes, act, rows, tokens, out),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => avx2::k(dtype, data, row_bytes, act, rows, tokens, out),
            _ => {
                with_k_format!(dtype, F => scalar::super_rect::<F>(data, row_bytes, act, rows, tokens, out))
            }
        }
    }
}
