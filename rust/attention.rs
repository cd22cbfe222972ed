//! Causal GQA attention of one query row over the ring's active slots, plus a chunk helper
//! that runs every row of a pending append in parallel.
//!
//! # Key sequence
//!
//! A row attends to, in this order: the **fixed** segment (ring rows via
//! [`DynamicRingBuffer::fixed_slots`]: recall then anchors, scored with `q_fixed`), the
//! **window** segment (ring rows via a window slot slice, scored with `q_window`), and the
//! **local** rows (the chunk's own K/V rows, contiguous, scored with `q_window`). Query head `h`
//! uses KV head `h / (n_q_heads / n_kv_heads)`.
//!
//! # One fixed reduction order (bit-exact across ISAs, chunkings and thread counts)
//!
//! The arithmetic is written once, generically over a 16-lane vector type (`Lanes`), and
//! instantiated for AVX-512F (one `__m512`), AVX2+FMA (two `__m256`) and a portable scalar
//! fallback (`[f32; 16]` with `f32::mul_add`). Every path performs the same IEEE operations in
//! the same order, so their outputs are identical bit for bit:
//!
//! - score `s_j = hsum(Σ_b fma(q[16b..], k[16b..], acc)) · scale`: one 16-lane accumulator
//!   over `head_dim` in blocks of 16 (a partial last block is zero-padded), then the fixed
//!   tree `l + l⊕8`, `l + l⊕4`, `l + l⊕2`, `l + l⊕1`;
//! - `m = max_j s_j` in 16 lanes by key index (`a > b ? a : b`), the same tree;
//! - `p_j = exp(s_j − m)` with a Cephes-style polynomial (fma range reduction, degree-5
//!   polynomial, exponent-bit scaling, flush to 0 below −87.34), summed in 16 lanes by key
//!   index, the same tree; `inv = 1 / Σ`;
//! - `out[d] = (Σ_j fma(p_j, v_j[d], acc)) · inv`, keys in sequence order.
//!
//! Nothing in a row's arithmetic depends on other rows, on how rows were grouped into chunks,
//! or on the thread that ran it, so a query's output depends only on its key sequence — and
//! the ring makes that sequence the same however the prompt was chunked.

use std::sync::OnceLock;

use crate::ring::DynamicRingBuffer;
use std::fmt;

/// Head counts and head dimension of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// Query heads.
    pub n_q_heads: usize,
    /// KV heads (must divide `n_q_heads`).
    pub n_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

impl AttnDims {
    /// f32 per K (or V) row: `n_kv_heads × head_dim`.
    pub fn kv_row(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// f32 per query row (and output row): `n_q_heads × head_dim`.
    pub fn q_row(&self) -> usize {
        self.n_q_heads * self.head_dim
    }

    fn validate(&self) -> Result<(), AttnError> {
        if self.n_q_heads == 0
            || self.n_kv_heads == 0
            || self.head_dim == 0
            || !self.n_q_heads.is_multiple_of(self.n_kv_heads)
        {
            return Err(AttnError::BadDims(*self));
        }
        Ok(())
    }
}

/// Everything one query row attends over. Slices are f32 row-major.
#[derive(Clone, Copy, Debug)]
pub struct AttnInputs<'a> {
    /// Query rotated at its cache position, `(n_q_heads, head_dim)`: scores the fixed segment.
    pub q_fixed: &'a [f32],
    /// Query rotated at its clock, `(n_q_heads, head_dim)`: scores window and local rows.
    pub q_window: &'a [f32],
    /// Ring keys of the layer, `(slots, n_kv_heads, head_dim)`.
    pub ring_k: &'a [f32],
    /// Ring values of the layer, same layout.
    pub ring_v: &'a [f32],
    /// Fixed segment: physical slots (recall then anchors).
    pub fixed_slots: &'a [u32],
    /// Window segment: physical slots in clock order.
    pub window_slots: &'a [u32],
    /// Local keys, `(n_local, n_kv_heads, head_dim)`, attended after the window.
    pub local_k: &'a [f32],
    /// Local values, same layout.
    pub local_v: &'a [f32],
}

/// Everything that can go wrong with an attention call (nothing is written on error).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttnError {
    /// Zero sizes, or `n_kv_heads` does not divide `n_q_heads`.
    BadDims(AttnDims),
    /// A buffer of the wrong length.
    ShapeMismatch {
        /// Which argument.
        what: &'static str,
        /// Expected length (f32, or a multiple of it for ring buffers).
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// A slot index beyond the ring.
    SlotOutOfRange {
        /// The offending slot.
        slot: u32,
        /// Slots in the ring.
        slots: usize,
    },
    /// No key at all: softmax over an empty set.
    NoKeys,
    /// Scratch smaller than [`scratch_len`].
    ScratchTooSmall {
        /// f32 needed.
        need: usize,
        /// f32 given.
        got: usize,
    },
    /// The ISA was requested but this CPU lacks it.
    IsaUnavailable(Isa),
    /// [`attend_chunk`] needs a pending append on the ring.
    NoPendingAppend,
    /// A layer index outside the ring.
    LayerOutOfRange {
        /// The layer.
        layer: usize,
        /// Layers the ring holds.
        n_layers: usize,
    },
}

impl fmt::Display for AttnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttnError::BadDims(d) => write!(
                f,
                "bad attention dims: n_q_heads = {}, n_kv_heads = {}, head_dim = {} (all positive, \
                 n_kv_heads dividing n_q_heads)",
                d.n_q_heads, d.n_kv_heads, d.head_dim
            ),
            AttnError::ShapeMismatch {
                what,
                expected,
                got,
            } => write!(f, "{what}: expected {expected} f32, got {got}"),
            AttnError::SlotOutOfRange { slot, slots } => {
                write!(f, "slot {slot} out of range: the ring has {slots} slots")
            }
            AttnError::NoKeys => write!(f, "no keys to attend to"),
            AttnError::ScratchTooSmall { need, got } => {
                write!(f, "scratch too small: need {need} f32, got {got}")
            }
            AttnError::IsaUnavailable(isa) => write!(f, "{isa:?} is not available on this CPU"),
            AttnError::NoPendingAppend => write!(f, "the ring has no pending append"),
            AttnError::LayerOutOfRange { layer, n_layers } => {
                write!(
                    f,
                    "layer {layer} out of range: the ring holds {n_layers} layers"
                )
            }
        }
    }
}

impl std::error::Error for AttnError {}

/// An instruction-set path of the kernel. All paths give bit-identical results.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable `[f32; 16]` lanes with `f32::mul_add`.
    Scalar,
    /// Two `__m256` per 16 lanes (x86-64 AVX2 + FMA).
    Avx2Fma,
    /// One `__m512` (x86-64 AVX-512F).
    Avx512,
}

impl Isa {
    /// Every path, widest last.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2Fma, Isa::Avx512];

    /// Whether this CPU can run the path.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The widest available path (detected once, cached).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            Isa::ALL
                .into_iter()
                .rev()
                .find(|isa| isa.is_available())
                .unwrap_or(Isa::Scalar)
        })
    }
}

/// Key rows of one row's sequence: fixed + window + local.
fn n_keys(inputs: &AttnInputs<'_>, dims: AttnDims) -> usize {
    inputs.fixed_slots.len() + inputs.window_slots.len() + inputs.local_k.len() / dims.kv_row()
}

/// Scores are stored per query head with a stride padded to 16 lanes.
fn score_stride(n_keys: usize) -> usize {
    n_keys.div_ceil(LANES) * LANES
}

/// Scratch f32 one row needs for `n_keys` keys: padded scores per query head plus one
/// normaliser per head.
pub fn scratch_len(dims: AttnDims, n_keys: usize) -> usize {
    dims.n_q_heads * (score_stride(n_keys) + 1)
}

/// Attention of one query row, on the widest available ISA. Writes `out`
/// `(n_q_heads, head_dim)`; `scratch` needs [`scratch_len`] f32.
pub fn attend(
    inputs: &AttnInputs<'_>,
    dims: AttnDims,
    scale: f32,
    scratch: &mut [f32],
    out: &mut [f32],
) -> Result<(), AttnError> {
    attend_with(Isa::best(), inputs, dims, scale, scratch, out)
}

/// [`attend`] on a chosen ISA (for tests and benches; results are identical on every ISA).
pub fn attend_with(
    isa: Isa,
    inputs: &AttnInputs<'_>,
    dims: AttnDims,
    scale: f32,
    scratch: &mut [f32],
    out: &mut [f32],
) -> Result<(), AttnError> {
    validate(inputs, dims, scratch.len(), out.len())?;
    if !isa.is_available() {
        return Err(AttnError::IsaUnavailable(isa));
    }
    run_row(isa, inputs, dims, scale, scratch, out);
    Ok(())
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), AttnError> {
    if expected == got {
        Ok(())
    } else {
        Err(AttnError::ShapeMismatch {
            what,
            expected,
            got,
        })
    }
}

fn validate(
    inputs: &AttnInputs<'_>,
    dims: AttnDims,
    scratch: usize,
    out: usize,
) -> Result<(), AttnError> {
    dims.validate()?;
    let kv_row = dims.kv_row();
    check_len("q_fixed", dims.q_row(), inputs.q_fixed.len())?;
    check_len("q_window", dims.q_row(), inputs.q_window.len())?;
    check_len("out", dims.q_row(), out)?;
    check_len("ring_v", inputs.ring_k.len(), inputs.ring_v.len())?;
    check_len("local_v", inputs.local_k.len(), inputs.local_v.len())?;
    for (what, len) in [
        ("ring_k", inputs.ring_k.len()),
        ("local_k", inputs.local_k.len()),
    ] {
        if len % kv_row != 0 {
            return Err(AttnError::ShapeMismatch {
                what,
                expected: len.next_multiple_of(kv_row),
                got: len,
            });
        }
    }
    let slots = inputs.ring_k.len() / kv_row;
    let max_slot = inputs
        .fixed_slots
        .iter()
        .chain(inputs.window_slots)
        .copied()
        .max();
    if let Some(slot) = max_slot.filter(|&s| s as usize >= slots) {
        return Err(AttnError::SlotOutOfRange { slot, slots });
    }
    let keys = n_keys(inputs, dims);
    if keys == 0 {
        return Err(AttnError::NoKeys);
    }
    let need = scratch_len(dims, keys);
    if scratch < need {
        return Err(AttnError::ScratchTooSmall { need, got: scratch });
    }
    Ok(())
}

/// Dispatches one validated row to its ISA.
fn run_row(
    isa: Isa,
    inputs: &AttnInputs<'_>,
    dims: AttnDims,
    scale: f32,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    match isa {
        Isa::Scalar => {
            // SAFETY: the scalar lanes use no CPU extension; `validate` checked every length
            // and slot index the kernel dereferences.
            unsafe { kernel::<ScalarLanes>(inputs, dims, scale, scratch, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => {
            // SAFETY: callers reach here only after `Isa::is_available` (AVX2 and FMA present);
            // inputs validated as above.
            unsafe { x86::attend_avx2(inputs, dims, scale, scratch, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            // SAFETY: only after `Isa::is_available` (AVX-512F present); inputs validated.
            unsafe { x86::attend_avx512(inputs, dims, scale, scratch, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("non-x86 ISAs are never available"),
    }
}

// ----- the one generic kernel ------------------------------------------------------------

/// Lanes per vector of the canonical reduction order.
const LANES: usize = 16;

/// 16 f32 lanes. Implementations must perform exactly the IEEE operation each method names,
/// lane by lane, so every implementation gives identical bits.
///
/// All methods are `unsafe`: the SIMD implementations require their CPU features, and the
/// pointer methods read/write 16 (or `n`) f32.
trait Lanes: Copy {
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(ptr: *const f32) -> Self;
    unsafe fn store(self, ptr: *mut f32);
    /// `a · b + c`, rounded once.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn sub(a: Self, b: Self) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    /// `a > b ? a : b` (the x86 `maxps` rule).
    unsafe fn max(a: Self, b: Self) -> Self;
    /// Round to nearest, ties to even.
    unsafe fn round_even(a: Self) -> Self;
    /// `2^a` for integral `a` in `[-126, 127]`, built from exponent bits.
    unsafe fn pow2_int(a: Self) -> Self;
    /// `x < threshold ? 0 : y`.
    unsafe fn zero_below(x: Self, threshold: f32, y: Self) -> Self;
    /// `[x0 + x8, …]`, `[… + x4]`, `[… + x2]`, `x0 + x1`.
    unsafe fn hsum(self) -> f32;
    /// The same tree with `max`.
    unsafe fn hmax(self) -> f32;

    /// `n < 16` values then `fill`.
    #[inline(always)]
    unsafe fn load_partial(ptr: *const f32, n: usize, fill: f32) -> Self {
        let mut buf = [fill; LANES];
        std::ptr::copy_nonoverlapping(ptr, buf.as_mut_ptr(), n);
        Self::load(buf.as_ptr())
    }

    /// Stores the first `n < 16` lanes.
    #[inline(always)]
    unsafe fn store_partial(self, ptr: *mut f32, n: usize) {
        let mut buf = [0.0; LANES];
        self.store(buf.as_mut_ptr());
        std::ptr::copy_nonoverlapping(buf.as_ptr(), ptr, n);
    }

    /// `e^x` for `x ≤ 0` (Cephes `expf` polynomial; 0 below −87.34).
    #[inline(always)]
    unsafe fn exp_nonpositive(x: Self) -> Self {
        const THRESHOLD: f32 = -87.336_55;
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        const LN2_HI: f32 = 0.693_359_4;
        const LN2_LO: f32 = -2.121_944_4e-4;
        let xc = Self::max(x, Self::splat(THRESHOLD));
        let n = Self::round_even(Self::mul(xc, Self::splat(LOG2E)));
        let r = Self::fma(n, Self::splat(-LN2_HI), xc);
        let r = Self::fma(n, Self::splat(-LN2_LO), r);
        let mut p = Self::splat(1.987_569_2e-4);
        p = Self::fma(p, r, Self::splat(1.398_199_9e-3));
        p = Self::fma(p, r, Self::splat(8.333_452e-3));
        p = Self::fma(p, r, Self::splat(4.166_579_6e-2));
        p = Self::fma(p, r, Self::splat(0.166_666_65));
        p = Self::fma(p, r, Self::splat(0.5));
        let y = Self::fma(p, Self::mul(r, r), r);
        let y = Self::add(y, Self::splat(1.0));
        Self::zero_below(x, THRESHOLD, Self::mul(y, Self::pow2_int(n)))
    }
}

/// One K or V row source of the key sequence, in order.
#[derive(Clone, Copy)]
enum Segment<'a> {
    Slots { base: *const f32, slots: &'a [u32] },
    Rows { base: *const f32, count: usize },
}

impl Segment<'_> {
    fn len(&self) -> usize {
        match self {
            Segment::Slots { slots, .. } => slots.len(),
            Segment::Rows { count, .. } => *count,
        }
    }

    /// Prefetches key `i + PREFETCH_AHEAD`'s f32 `[offset, offset + len)` of its row.
    #[inline(always)]
    unsafe fn prefetch_ahead(&self, i: usize, kv_row: usize, offset: usize, len: usize) {
        if i + PREFETCH_AHEAD < self.len() {
            prefetch(self.row(i + PREFETCH_AHEAD, kv_row).add(offset), len);
        }
    }

    /// Start of key `i`'s row (`kv_row` f32).
    #[inline(always)]
    unsafe fn row(&self, i: usize, kv_row: usize) -> *const f32 {
        match self {
            Segment::Slots { base, slots } => base.add(*slots.get_unchecked(i) as usize * kv_row),
            Segment::Rows { base, .. } => base.add(i * kv_row),
        }
    }
}

/// Keys ahead to prefetch: table-driven rows are scattered, so the hardware prefetcher cannot
/// guess the next one.
const PREFETCH_AHEAD: usize = 8;

/// Hints the cache lines of `[ptr, ptr + len)` f32 into L1. Never changes a result.
#[inline(always)]
fn prefetch(ptr: *const f32, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..len).step_by(16) {
        // SAFETY: prefetch is a hint; it never faults, even on an invalid address, and the
        // pointer is not dereferenced (`wrapping_add` keeps the arithmetic defined).
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(ptr.wrapping_add(line).cast::<i8>());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ptr, len);
}

/// The row's key sequence (fixed, window, local) for K or V, with the query of each segment.
#[inline(always)]
fn segments<'a>(
    inputs: &AttnInputs<'a>,
    dims: AttnDims,
    values: bool,
) -> [(Segment<'a>, &'a [f32]); 3] {
    let (ring, local) = if values {
        (inputs.ring_v, inputs.local_v)
    } else {
        (inputs.ring_k, inputs.local_k)
    };
    [
        (
            Segment::Slots {
                base: ring.as_ptr(),
                slots: inputs.fixed_slots,
            },
            inputs.q_fixed,
        ),
        (
            Segment::Slots {
                base: ring.as_ptr(),
                slots: inputs.window_slots,
            },
            inputs.q_window,
        ),
        (
            Segment::Rows {
                base: local.as_ptr(),
                count: local.len() / dims.kv_row(),
            },
            inputs.q_window,
        ),
    ]
}

/// `Σ q·k` over `head_dim` in the canonical order.
#[inline(always)]
unsafe fn dot<V: Lanes>(q: *const f32, k: *const f32, head_dim: usize) -> f32 {
    let full = head_dim / LANES;
    let tail = head_dim % LANES;
    let mut acc = V::splat(0.0);
    for b in 0..full {
        acc = V::fma(V::load(q.add(b * LANES)), V::load(k.add(b * LANES)), acc);
    }
    if tail > 0 {
        let at = full * LANES;
        acc = V::fma(
            V::load_partial(q.add(at), tail, 0.0),
            V::load_partial(k.add(at), tail, 0.0),
            acc,
        );
    }
    acc.hsum()
}

/// The whole row: scores, softmax, weighted value sum. Inputs must be validated.
#[inline(always)]
unsafe fn kernel<V: Lanes>(
    inputs: &AttnInputs<'_>,
    dims: AttnDims,
    scale: f32,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let AttnDims {
        n_q_heads,
        n_kv_heads,
        head_dim,
    } = dims;
    let kv_row = dims.kv_row();
    let group = n_q_heads / n_kv_heads;
    let total = n_keys(inputs, dims);
    let stride = score_stride(total);
    let (scores, inv) = scratch.split_at_mut(n_q_heads * stride);
    let scores = scores.as_mut_ptr();

    // Pass 1: scores. Each key row is read once for all the query heads that share it.
    let mut j = 0;
    for (segment, q) in segments(inputs, dims, false) {
        for i in 0..segment.len() {
            segment.prefetch_ahead(i, kv_row, 0, kv_row);
            let row = segment.row(i, kv_row);
            for g in 0..n_kv_heads {
                let k = row.add(g * head_dim);
                for h in g * group..(g + 1) * group {
                    let s = dot::<V>(q.as_ptr().add(h * head_dim), k, head_dim);
                    *scores.add(h * stride + j) = s * scale;
                }
            }
            j += 1;
        }
    }

    // Pass 2: numerically stable softmax weights, per query head.
    for (h, inv_h) in inv.iter_mut().enumerate().take(n_q_heads) {
        let s = scores.add(h * stride);
        for pad in total..stride {
            *s.add(pad) = f32::NEG_INFINITY;
        }
        let mut m = V::splat(f32::NEG_INFINITY);
        for b in (0..stride).step_by(LANES) {
            m = V::max(m, V::load(s.add(b)));
        }
        let m = V::splat(m.hmax());
        let mut sum = V::splat(0.0);
        for b in (0..stride).step_by(LANES) {
            let p = V::exp_nonpositive(V::sub(V::load(s.add(b)), m));
            p.store(s.add(b));
            sum = V::add(sum, p);
        }
        *inv_h = 1.0 / sum.hsum();
    }

    // Pass 3: weighted sum of values; blocks of ≤ 4 heads × 64 dims stay in registers.
    for g in 0..n_kv_heads {
        let mut h0 = g * group;
        while h0 < (g + 1) * group {
            let heads = ((g + 1) * group - h0).min(4);
            let mut d0 = 0;
            while d0 < head_dim {
                let width = (head_dim - d0).min(4 * LANES);
                macro_rules! block {
                    ($nh:literal) => {
                        if width == 4 * LANES {
                            value_block::<V, $nh, true>(
                                inputs, dims, g, h0, d0, width, scores, stride, inv, out,
                            )
                        } else {
                            value_block::<V, $nh, false>(
                                inputs, dims, g, h0, d0, width, scores, stride, inv, out,
                            )
                        }
                    };
                }
                match heads {
                    1 => block!(1),
                    2 => block!(2),
                    3 => block!(3),
                    _ => block!(4),
                }
                d0 += width;
            }
            h0 += heads;
        }
    }
}

/// `out[h0..h0+NH][d0..d0+width] = inv · Σ_j p[h][j] · v_j[g][d0..]` (keys in sequence order).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn value_block<V: Lanes, const NH: usize, const FULL: bool>(
    inputs: &AttnInputs<'_>,
    dims: AttnDims,
    g: usize,
    h0: usize,
    d0: usize,
    width: usize,
    scores: *const f32,
    stride: usize,
    inv: &[f32],
    out: &mut [f32],
) {
    let kv_row = dims.kv_row();
    let head_dim = dims.head_dim;
    let mut acc = [[V::splat(0.0); 4]; NH];
    let mut j = 0;
    for (segment, _) in segments(inputs, dims, true) {
        for i in 0..segment.len() {
            segment.prefetch_ahead(i, kv_row, g * head_dim + d0, width);
            let v = segment.row(i, kv_row).add(g * head_dim + d0);
            let mut vv = [V::splat(0.0); 4];
            for (c, lane) in vv.iter_mut().enumerate() {
                if FULL {
                    *lane = V::load(v.add(c * LANES));
                } else {
                    let start = c * LANES;
                    if start < width {
                        *lane = V::load_partial(v.add(start), (width - start).min(LANES), 0.0);
                    }
                }
            }
            for (hh, acc_h) in acc.iter_mut().enumerate() {
                let p = V::splat(*scores.add((h0 + hh) * stride + j));
                for c in 0..4 {
                    acc_h[c] = V::fma(p, vv[c], acc_h[c]);
                }
            }
            j += 1;
        }
    }
    for (hh, acc_h) in acc.iter().enumerate() {
        let h = h0 + hh;
        let scale = V::splat(inv[h]);
        let dst = out.as_mut_ptr().add(h * head_dim + d0);
        for (c, lane) in acc_h.iter().enumerate() {
            let start = c * LANES;
            if start >= width {
                break;
            }
            let y = V::mul(*lane, scale);
            if width - start >= LANES {
                y.store(dst.add(start));
            } else {
                y.store_partial(dst.add(start), width - start);
            }
        }
    }
}

// ----- scalar lanes ------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct ScalarLanes([f32; LANES]);

impl ScalarLanes {
    #[inline(always)]
    fn map2(a: Self, b: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        ScalarLanes(std::array::from_fn(|l| f(a.0[l], b.0[l])))
    }

    #[inline(always)]
    fn tree(self, f: impl Fn(f32, f32) -> f32) -> f32 {
        let x = self.0;
        let t8: [f32; 8] = std::array::from_fn(|l| f(x[l], x[l + 8]));
        let t4: [f32; 4] = std::array::from_fn(|l| f(t8[l], t8[l + 4]));
        let t2: [f32; 2] = std::array::from_fn(|l| f(t4[l], t4[l + 2]));
        f(t2[0], t2[1])
    }
}

#[inline(always)]
fn max_rule(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

impl Lanes for ScalarLanes {
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        ScalarLanes([x; LANES])
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        ScalarLanes(ptr.cast::<[f32; LANES]>().read_unaligned())
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        ptr.cast::<[f32; LANES]>().write_unaligned(self.0)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        ScalarLanes(std::array::from_fn(|l| a.0[l].mul_add(b.0[l], c.0[l])))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Self::map2(a, b, |x, y| x + y)
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Self::map2(a, b, |x, y| x - y)
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Self::map2(a, b, |x, y| x * y)
    }
    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        Self::map2(a, b, max_rule)
    }
    #[inline(always)]
    unsafe fn round_even(a: Self) -> Self {
        ScalarLanes(a.0.map(f32::round_ties_even))
    }
    #[inline(always)]
    unsafe fn pow2_int(a: Self) -> Self {
        ScalarLanes(a.0.map(|n| f32::from_bits(((n as i32 + 127) as u32) << 23)))
    }
    #[inline(always)]
    unsafe fn zero_below(x: Self, threshold: f32, y: Self) -> Self {
        Self::map2(x, y, |x, y| if x < threshold { 0.0 } else { y })
    }
    #[inline(always)]
    unsafe fn hsum(self) -> f32 {
        self.tree(|a, b| a + b)
    }
    #[inline(always)]
    unsafe fn hmax(self) -> f32 {
        self.tree(max_rule)
    }
}

// ----- x86 lanes ---------------------------------------------------------------------------

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{kernel, AttnDims, AttnInputs, Lanes};
    use std::arch::x86_64::*;

    /// Round to nearest even, no exceptions.
    const ROUND_NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    /// Tree steps `l + l⊕4`, `l + l⊕2`, `l + l⊕1` of eight lanes (shared by both x86 paths).
    #[inline(always)]
    unsafe fn tree8_add(x: __m256) -> f32 {
        let t4 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
        _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps::<1>(t2, t2)))
    }

    /// [`tree8_add`] with `max` (`a > b ? a : b`, the lower lanes as `a`).
    #[inline(always)]
    unsafe fn tree8_max(x: __m256) -> f32 {
        let t4 = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        let t2 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
        _mm_cvtss_f32(_mm_max_ss(t2, _mm_shuffle_ps::<1>(t2, t2)))
    }

    #[derive(Clone, Copy)]
    pub(super) struct Avx2Lanes(__m256, __m256);

    impl Lanes for Avx2Lanes {
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx2Lanes(_mm256_set1_ps(x), _mm256_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(ptr: *const f32) -> Self {
            Avx2Lanes(_mm256_loadu_ps(ptr), _mm256_loadu_ps(ptr.add(8)))
        }
        #[inline(always)]
        unsafe fn store(self, ptr: *mut f32) {
            _mm256_storeu_ps(ptr, self.0);
            _mm256_storeu_ps(ptr.add(8), self.1);
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            Avx2Lanes(
                _mm256_fmadd_ps(a.0, b.0, c.0),
                _mm256_fmadd_ps(a.1, b.1, c.1),
            )
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            Avx2Lanes(_mm256_add_ps(a.0, b.0), _mm256_add_ps(a.1, b.1))
        }
        #[inline(always)]
        unsafe fn sub(a: Self, b: Self) -> Self {
            Avx2Lanes(_mm256_sub_ps(a.0, b.0), _mm256_sub_ps(a.1, b.1))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            Avx2Lanes(_mm256_mul_ps(a.0, b.0), _mm256_mul_ps(a.1, b.1))
        }
        #[inline(always)]
        unsafe fn max(a: Self, b: Self) -> Self {
            Avx2Lanes(_mm256_max_ps(a.0, b.0), _mm256_max_ps(a.1, b.1))
        }
        #[inline(always)]
        unsafe fn round_even(a: Self) -> Self {
            Avx2Lanes(
                _mm256_round_ps::<ROUND_NEAREST>(a.0),
                _mm256_round_ps::<ROUND_NEAREST>(a.1),
            )
        }
        #[inline(always)]
        unsafe fn pow2_int(a: Self) -> Self {
            let bits = |x: __m256| {
                let e = _mm256_add_epi32(_mm256_cvtps_epi32(x), _mm256_set1_epi32(127));
                _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
            };
            Avx2Lanes(bits(a.0), bits(a.1))
        }
        #[inline(always)]
        unsafe fn zero_below(x: Self, threshold: f32, y: Self) -> Self {
            let t = _mm256_set1_ps(threshold);
            let zero = _mm256_setzero_ps();
            Avx2Lanes(
                _mm256_blendv_ps(y.0, zero, _mm256_cmp_ps::<_CMP_LT_OQ>(x.0, t)),
                _mm256_blendv_ps(y.1, zero, _mm256_cmp_ps::<_CMP_LT_OQ>(x.1, t)),
            )
        }
        #[inline(always)]
        unsafe fn hsum(self) -> f32 {
            tree8_add(_mm256_add_ps(self.0, self.1))
        }
        #[inline(always)]
        unsafe fn hmax(self) -> f32 {
            tree8_max(_mm256_max_ps(self.0, self.1))
        }
    }

    #[derive(Clone, Copy)]
    pub(super) struct Avx512Lanes(__m512);

    impl Avx512Lanes {
        /// Lanes 0–7 and 8–15 as two `__m256`.
        #[inline(always)]
        unsafe fn halves(self) -> (__m256, __m256) {
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0)));
            (_mm512_castps512_ps256(self.0), hi)
        }
    }

    impl Lanes for Avx512Lanes {
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx512Lanes(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(ptr: *const f32) -> Self {
            Avx512Lanes(_mm512_loadu_ps(ptr))
        }
        #[inline(always)]
        unsafe fn store(self, ptr: *mut f32) {
            _mm512_storeu_ps(ptr, self.0)
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            Avx512Lanes(_mm512_fmadd_ps(a.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            Avx512Lanes(_mm512_add_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn sub(a: Self, b: Self) -> Self {
            Avx512Lanes(_mm512_sub_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            Avx512Lanes(_mm512_mul_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn max(a: Self, b: Self) -> Self {
            Avx512Lanes(_mm512_max_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn round_even(a: Self) -> Self {
            Avx512Lanes(_mm512_roundscale_ps::<ROUND_NEAREST>(a.0))
        }
        #[inline(always)]
        unsafe fn pow2_int(a: Self) -> Self {
            let e = _mm512_add_epi32(_mm512_cvtps_epi32(a.0), _mm512_set1_epi32(127));
            Avx512Lanes(_mm512_castsi512_ps(_mm512_slli_epi32::<23>(e)))
        }
        #[inline(always)]
        unsafe fn zero_below(x: Self, threshold: f32, y: Self) -> Self {
            let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x.0, _mm512_set1_ps(threshold));
            Avx512Lanes(_mm512_mask_blend_ps(below, y.0, _mm512_setzero_ps()))
        }
        #[inline(always)]
        unsafe fn hsum(self) -> f32 {
            let (lo, hi) = self.halves();
            tree8_add(_mm256_add_ps(lo, hi))
        }
        #[inline(always)]
        unsafe fn hmax(self) -> f32 {
            let (lo, hi) = self.halves();
            tree8_max(_mm256_max_ps(lo, hi))
        }
    }

    /// The kernel compiled for AVX2 + FMA.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; inputs must be validated.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend_avx2(
        inputs: &AttnInputs<'_>,
        dims: AttnDims,
        scale: f32,
        scratch: &mut [f32],
        out: &mut [f32],
    ) {
        kernel::<Avx2Lanes>(inputs, dims, scale, scratch, out)
    }

    /// The kernel compiled for AVX-512F.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; inputs must be validated.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn attend_avx512(
        inputs: &AttnInputs<'_>,
        dims: AttnDims,
        scale: f32,
        scratch: &mut [f32],
        out: &mut [f32],
    ) {
        kernel::<Avx512Lanes>(inputs, dims, scale, scratch, out)
    }

    /// `exp` of 16 values on AVX2 (for the cross-ISA exp test).
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_avx2(x: *const f32, out: *mut f32) {
        Avx2Lanes::exp_nonpositive(Avx2Lanes::load(x)).store(out)
    }

    /// `exp` of 16 values on AVX-512F (for the cross-ISA exp test).
    #[cfg(test)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_avx512(x: *const f32, out: *mut f32) {
        Avx512Lanes::exp_nonpositive(Avx512Lanes::load(x)).store(out)
    }
}

// ----- chunk helper ------------------------------------------------------------------------

/// Per-thread scratch for [`attend_chunk`], sized once for a ring (no allocation per call).
#[derive(Debug)]
pub struct AttnScratch {
    buf: Vec<f32>,
    per_block: usize,
}

impl AttnScratch {
    /// Scratch for `blocks` parallel row groups of up to `max_keys` keys each.
    pub fn new(blocks: usize, n_q_heads: usize, max_keys: usize) -> AttnScratch {
        let per_block = n_q_heads * (score_stride(max_keys) + 1);
        AttnScratch {
            buf: vec![0.0; blocks.max(1) * per_block],
            per_block,
        }
    }

    /// Scratch for any pending append of `ring` with `n_q_heads` query heads, one block per
    /// rayon thread.
    pub fn for_ring(ring: &DynamicRingBuffer, n_q_heads: usize) -> AttnScratch {
        let max_keys = ring.slots() + ring.config().max_chunk;
        AttnScratch::new(rayon::current_num_threads(), n_q_heads, max_keys)
    }

    /// Parallel row groups this scratch supports.
    pub fn blocks(&self) -> usize {
        self.buf.len() / self.per_block
    }
}

/// Attention for every row of the ring's pending append on layer `layer`.
///
/// `q_fixed`/`q_window`/`out` are `(n, n_q_heads, head_dim)`; `local_k`/`local_v` are the
/// chunk's rows `(n, kv_heads, head_dim)`. Row `i` sees `ring.fixed_slots()`,
/// `ring.pending_window(i)` and local rows `ring.pending_local_start(i)..=i`. Rows run in
/// parallel (rayon) over contiguous row groups; a single row runs inline. The output of each
/// row is independent of the grouping and of the thread count.
#[allow(clippy::too_many_arguments)]
pub fn attend_chunk(
    ring: &DynamicRingBuffer,
    layer: usize,
    q_fixed: &[f32],
    q_window: &[f32],
    local_k: &[f32],
    local_v: &[f32],
    n_q_heads: usize,
    scale: f32,
    scratch: &mut AttnScratch,
    out: &mut [f32],
) -> Result<(), AttnError> {
    let n = ring.pending_len();
    if n == 0 {
        return Err(AttnError::NoPendingAppend);
    }
    let cfg = ring.config();
    if layer >= cfg.n_layers {
        return Err(AttnError::LayerOutOfRange {
            layer,
            n_layers: cfg.n_layers,
        });
    }
    let dims = AttnDims {
        n_q_heads,
        n_kv_heads: cfg.kv_heads,
        head_dim: cfg.head_dim,
    };
    dims.validate()?;
    let (q_row, kv_row) = (dims.q_row(), dims.kv_row());
    check_len("q_fixed", n * q_row, q_fixed.len())?;
    check_len("q_window", n * q_row, q_window.len())?;
    check_len("out", n * q_row, out.len())?;
    check_len("local_k", n * kv_row, local_k.len())?;
    check_len("local_v", n * kv_row, local_v.len())?;
    let worst_keys = ring.fixed_slots().len() + ring.window_slots().len() + n;
    let need = scratch_len(dims, worst_keys);
    if scratch.per_block < need {
        return Err(AttnError::ScratchTooSmall {
            need,
            got: scratch.per_block,
        });
    }
    let (ring_k, ring_v) = ring.layer_kv(layer);
    let isa = Isa::best();
    let row_inputs = |i: usize| {
        let start = ring.pending_local_start(i);
        AttnInputs {
            q_fixed: &q_fixed[i * q_row..(i + 1) * q_row],
            q_window: &q_window[i * q_row..(i + 1) * q_row],
            ring_k,
            ring_v,
            fixed_slots: ring.fixed_slots(),
            window_slots: ring.pending_window(i),
            local_k: &local_k[start * kv_row..(i + 1) * kv_row],
            local_v: &local_v[start * kv_row..(i + 1) * kv_row],
        }
    };
    // The ring's own slot tables are in range and every length was checked above.
    let run = |first: usize, outs: &mut [f32], scratch: &mut [f32]| {
        for (r, out_row) in outs.chunks_exact_mut(q_row).enumerate() {
            run_row(isa, &row_inputs(first + r), dims, scale, scratch, out_row);
        }
    };
    let per_block = scratch.per_block;
    let blocks = scratch.blocks().min(n);
    if blocks == 1 {
        run(0, out, &mut scratch.buf[..per_block]);
        return Ok(());
    }
    let rows_per_block = n.div_ceil(blocks);
    use rayon::prelude::*;
    out.par_chunks_mut(rows_per_block * q_row)
        .zip(scratch.buf.par_chunks_mut(per_block))
        .enumerate()
        .for_each(|(b, (outs, scratch))| run(b * rows_per_block, outs, scratch));
    Ok(())
}

#[cfg(test)]
mod tests;
