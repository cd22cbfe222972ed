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
//!
//! # How the passes are organised (speed only; the arithmetic above is unchanged)
//!
//! - **Scores** go 8 keys at a time. Each loaded block of a key row feeds every query head of
//!   its KV head (3 at once on AVX-512), so K is streamed once; then each head's 8 horizontal
//!   sums run together in a transposing shuffle network (`Lanes::hsum8`) that adds exactly the
//!   lane pairs of the tree above, instead of 8 separate trees. This pass does not prefetch:
//!   measured, software prefetches only slowed it, scattered or not.
//! - **Values** sweep the keys once per KV head, ≤ 4 heads × 64 dims of accumulators in
//!   registers; for a slot table, each sweep prefetches the rows `PREFETCH_AHEAD` keys ahead
//!   (sequential local rows are left to the hardware prefetcher).

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
    /// A sliding window of zero keys, or over a ring holding anchor or recall rows.
    BadWindow {
        /// The window asked for.
        window: usize,
        /// Anchor + recall rows the ring holds.
        fixed: usize,
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
            AttnError::BadWindow { window, fixed } => write!(
                f,
                "a sliding window needs at least one key and a ring without anchor or recall \
                 rows (window {window}, {fixed} such rows)"
            ),
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

/// Keys per score block of pass 1 (one transposing reduction per query head).
const BLOCK_KEYS: usize = 8;

/// 16 f32 lanes. Implementations must perform exactly the IEEE operation each method names,
/// lane by lane, so every implementation gives identical bits.
///
/// All methods are `unsafe`: the SIMD implementations require their CPU features, and the
/// pointer methods read/write 16 (or `n`) f32.
trait Lanes: Copy {
    /// Keys whose score accumulators are live at once (4 or 8; sized to the registers).
    const KEY_GROUP: usize;
    /// Query heads (1 to 3) scored together against each loaded key block.
    const SCORE_HEADS: usize;

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

    /// `[xs[0].hsum(), …, xs[7].hsum(), ?…]`: every vector's sum by exactly the
    /// [`Lanes::hsum`] tree, one per lane in lanes 0–7 (lanes 8–15 unspecified).
    ///
    /// The default runs each tree on its own; SIMD paths override it with a transposing
    /// shuffle network that performs the same additions.
    #[inline(always)]
    unsafe fn hsum8(xs: &[Self; BLOCK_KEYS]) -> Self {
        let mut sums = [0.0; LANES];
        for (sum, x) in sums.iter_mut().zip(xs) {
            *sum = x.hsum();
        }
        Self::load(sums.as_ptr())
    }

    /// Stores lanes 0–7.
    #[inline(always)]
    unsafe fn store8(self, ptr: *mut f32) {
        self.store_partial(ptr, 8)
    }

    /// `n ≤ 16` values then zeros; reads only the `n` values. (SIMD paths override both
    /// partial accesses with masked loads and stores: no `memcpy` call, around which every
    /// live vector register would be spilled.)
    #[inline(always)]
    unsafe fn load_partial(ptr: *const f32, n: usize) -> Self {
        let mut buf = [0.0; LANES];
        std::ptr::copy_nonoverlapping(ptr, buf.as_mut_ptr(), n);
        Self::load(buf.as_ptr())
    }

    /// Stores the first `n ≤ 16` lanes; writes nothing else.
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

    /// Prefetches key `i + PREFETCH_AHEAD`'s f32 `[offset, offset + len)` of its row, for a
    /// slot table only: sequential rows are the hardware prefetcher's job, and there the
    /// hints would be pure overhead.
    #[inline(always)]
    unsafe fn prefetch_ahead(&self, i: usize, kv_row: usize, offset: usize, len: usize) {
        if let Segment::Slots { base, slots } = self {
            if let Some(&slot) = slots.get(i + PREFETCH_AHEAD) {
                prefetch(base.add(slot as usize * kv_row + offset), len);
            }
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

/// Keys ahead the value pass prefetches: table-driven rows are scattered, so the hardware
/// prefetcher cannot guess the next one. (The score pass does not prefetch: its 8 row streams
/// per key group already keep the miss buffers busy, and measured, extra prefetches there
/// only slowed it down.)
const PREFETCH_AHEAD: usize = 12;

/// Hints every cache line of `[ptr, ptr + len)` f32 into L1: one hint per 64 bytes from
/// `ptr`, plus one at the last byte (the line a misaligned range ends in). Straight-line code
/// when `len` is a constant. Never changes a result.
#[inline(always)]
fn prefetch(ptr: *const f32, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = len * 4;
        let at = |offset: usize| {
            // SAFETY: prefetch is a hint; it never faults, even on an invalid address, and the
            // pointer is not dereferenced (`wrapping_add` keeps the arithmetic defined).
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch::<_MM_HINT_T0>(ptr.cast::<i8>().wrapping_add(offset));
            }
        };
        for offset in (0..bytes).step_by(64) {
            at(offset);
        }
        if bytes > 0 {
            at(bytes - 1);
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

/// Scores of 8 keys (`rows`, all valid pointers) for the `NH` query heads at `q` (consecutive
/// heads sharing the KV head at `offset` of each row), times `scale`, in lanes 0–7 of one
/// vector per head.
///
/// Each (head, key) accumulates `Σ fma(q[16b..], k[16b..], acc)` over `head_dim` exactly as
/// the canonical order says; each loaded key block feeds all `NH` heads, so the K stream is
/// read once per KV head. Keys go `KG` at a time so that `NH × KG` accumulators stay in
/// registers; then each head's 8 horizontal sums run together in one transposing reduction
/// ([`Lanes::hsum8`], the same tree per key as [`Lanes::hsum`]).
#[inline(always)]
unsafe fn score_block<V: Lanes, const NH: usize, const KG: usize>(
    q: *const f32,
    rows: &[*const f32; BLOCK_KEYS],
    offset: usize,
    head_dim: usize,
    scale: f32,
) -> [V; NH] {
    let full = head_dim / LANES;
    let tail = head_dim % LANES;
    // (Loops, not closures: a closure would not inherit the caller's target features.)
    let mut sums = [[V::splat(0.0); BLOCK_KEYS]; NH];
    for first in (0..BLOCK_KEYS).step_by(KG) {
        let group: &[*const f32; KG] = &*rows.as_ptr().add(first).cast();
        let mut acc = [[V::splat(0.0); KG]; NH];
        for b in 0..full {
            let mut qb = [V::splat(0.0); NH];
            for (hh, qb) in qb.iter_mut().enumerate() {
                *qb = V::load(q.add(hh * head_dim + b * LANES));
            }
            let at = offset + b * LANES;
            for (n, row) in group.iter().enumerate() {
                let k = V::load(row.add(at));
                for hh in 0..NH {
                    acc[hh][n] = V::fma(qb[hh], k, acc[hh][n]);
                }
            }
        }
        if tail > 0 {
            let mut qb = [V::splat(0.0); NH];
            for (hh, qb) in qb.iter_mut().enumerate() {
                *qb = V::load_partial(q.add(hh * head_dim + full * LANES), tail);
            }
            let at = offset + full * LANES;
            for (n, row) in group.iter().enumerate() {
                let k = V::load_partial(row.add(at), tail);
                for hh in 0..NH {
                    acc[hh][n] = V::fma(qb[hh], k, acc[hh][n]);
                }
            }
        }
        for hh in 0..NH {
            sums[hh][first..first + KG].copy_from_slice(&acc[hh]);
        }
    }
    let mut out = [V::splat(0.0); NH];
    for (out, sums) in out.iter_mut().zip(&sums) {
        *out = V::mul(V::hsum8(sums), V::splat(scale));
    }
    out
}

/// Pass 1 for query heads `h0..h0 + NH` (sharing KV head `g`) over one 8-key block whose
/// scores go to column 0 of `dst` (row stride `stride`); `count ≤ 8` of the keys are real.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn store_scores<V: Lanes, const NH: usize>(
    q: &[f32],
    rows: &[*const f32; BLOCK_KEYS],
    dims: AttnDims,
    g: usize,
    h0: usize,
    scale: f32,
    dst: *mut f32,
    stride: usize,
    count: usize,
) {
    let head_dim = dims.head_dim;
    let (q, offset) = (q.as_ptr().add(h0 * head_dim), g * head_dim);
    // (A constant per `V`: the match compiles to a single arm.)
    let s = match V::KEY_GROUP {
        4 => score_block::<V, NH, 4>(q, rows, offset, head_dim, scale),
        _ => score_block::<V, NH, 8>(q, rows, offset, head_dim, scale),
    };
    for (hh, s) in s.into_iter().enumerate() {
        let dst = dst.add((h0 + hh) * stride);
        if count == BLOCK_KEYS {
            s.store8(dst);
        } else {
            s.store_partial(dst, count);
        }
    }
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

    // Pass 1: scores, 8 keys of a segment at a time (a short last block repeats its last
    // row and stores only its own lanes); each loaded key block feeds every query head of its
    // KV head (up to `V::SCORE_HEADS` at once).
    let mut j = 0;
    for (segment, q) in segments(inputs, dims, false) {
        let n = segment.len();
        let mut i = 0;
        while i < n {
            let count = (n - i).min(BLOCK_KEYS);
            let mut rows = [std::ptr::null(); BLOCK_KEYS];
            for (r, row) in rows.iter_mut().enumerate() {
                *row = segment.row(i + r.min(count - 1), kv_row);
            }
            for g in 0..n_kv_heads {
                let mut h0 = g * group;
                while h0 < (g + 1) * group {
                    let heads = ((g + 1) * group - h0).min(V::SCORE_HEADS);
                    let dst = scores.add(j + i);
                    match heads {
                        1 => store_scores::<V, 1>(q, &rows, dims, g, h0, scale, dst, stride, count),
                        2 => store_scores::<V, 2>(q, &rows, dims, g, h0, scale, dst, stride, count),
                        _ => store_scores::<V, 3>(q, &rows, dims, g, h0, scale, dst, stride, count),
                    }
                    h0 += heads;
                }
            }
            i += count;
        }
        j += n;
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
            let prefetch_len = if FULL { 4 * LANES } else { width };
            segment.prefetch_ahead(i, kv_row, g * head_dim + d0, prefetch_len);
            let v = segment.row(i, kv_row).add(g * head_dim + d0);
            let mut vv = [V::splat(0.0); 4];
            for (c, lane) in vv.iter_mut().enumerate() {
                if FULL {
                    *lane = V::load(v.add(c * LANES));
                } else {
                    let start = c * LANES;
                    if start < width {
                        *lane = V::load_partial(v.add(start), (width - start).min(LANES));
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
    const KEY_GROUP: usize = 8;
    const SCORE_HEADS: usize = 3;

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

    /// Lane masks (all bits set = on) of the first `n ≤ 16` lanes, as two halves of 8.
    #[inline(always)]
    unsafe fn lane_masks(n: usize) -> (__m256i, __m256i) {
        let n = _mm256_set1_epi32(n as i32);
        (
            _mm256_cmpgt_epi32(n, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
            _mm256_cmpgt_epi32(n, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)),
        )
    }

    #[derive(Clone, Copy)]
    pub(super) struct Avx2Lanes(__m256, __m256);

    impl Lanes for Avx2Lanes {
        /// 4 keys × 2 `__m256` accumulators of one head (16 ymm registers in all).
        const KEY_GROUP: usize = 4;
        const SCORE_HEADS: usize = 1;

        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx2Lanes(_mm256_set1_ps(x), _mm256_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(ptr: *const f32) -> Self {
            Avx2Lanes(_mm256_loadu_ps(ptr), _mm256_loadu_ps(ptr.add(8)))
        }
        #[inline(always)]
        unsafe fn load_partial(ptr: *const f32, n: usize) -> Self {
            let (lo, hi) = lane_masks(n);
            // Masked-off lanes are never read (no fault), so the high half may point past
            // the data; `wrapping_add` keeps that arithmetic defined.
            Avx2Lanes(
                _mm256_maskload_ps(ptr, lo),
                _mm256_maskload_ps(ptr.wrapping_add(8), hi),
            )
        }
        #[inline(always)]
        unsafe fn store_partial(self, ptr: *mut f32, n: usize) {
            let (lo, hi) = lane_masks(n);
            _mm256_maskstore_ps(ptr, lo, self.0);
            _mm256_maskstore_ps(ptr.wrapping_add(8), hi, self.1);
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

        /// The [`Lanes::hsum`] trees of 8 vectors at once (see the AVX-512 version): after
        /// `l⊕8` (one `__m256` per key), key `k`'s bit 1 picks its partner at `l⊕4`, bit 0
        /// at `l⊕2`, bit 2 its `__m256` until the last step.
        #[inline(always)]
        unsafe fn hsum8(xs: &[Self; 8]) -> Self {
            // (Loops, not closures: a closure would not inherit the target features.)
            // l + l⊕8: one __m256 per key.
            let mut t8 = [_mm256_setzero_ps(); 8];
            for (t, x) in t8.iter_mut().zip(xs) {
                *t = _mm256_add_ps(x.0, x.1);
            }
            // l + l⊕4: 128-bit halves [a0+a1, b0+b1] of keys a = k, b = k + 2 (bit 1 clear).
            let mut t4 = [_mm256_setzero_ps(); 4];
            for (m, t) in t4.iter_mut().enumerate() {
                let k = (m & 1) | ((m >> 1) << 2);
                let (a, b) = (t8[k], t8[k + 2]);
                *t = _mm256_add_ps(
                    _mm256_permute2f128_ps::<0x20>(a, b),
                    _mm256_permute2f128_ps::<0x31>(a, b),
                );
            }
            // l + l⊕2 within each half: [r0+r2, r1+r3, s0+s2, s1+s3], bit 0 = s; w0 holds
            // the keys with bit 2 clear.
            let w0 = _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(t4[0], t4[1]),
                _mm256_shuffle_ps::<0b11_10_11_10>(t4[0], t4[1]),
            );
            let w1 = _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(t4[2], t4[3]),
                _mm256_shuffle_ps::<0b11_10_11_10>(t4[2], t4[3]),
            );
            // l + l⊕1: half `k1` holds keys [k0 + 2·k2] = [0, 1, 4, 5] | [2, 3, 6, 7]; the
            // 64-bit permute puts them in order.
            let sums = _mm256_add_ps(
                _mm256_shuffle_ps::<0b10_00_10_00>(w0, w1),
                _mm256_shuffle_ps::<0b11_01_11_01>(w0, w1),
            );
            let ordered = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(
                _mm256_castps_pd(sums),
            ));
            Avx2Lanes(ordered, _mm256_setzero_ps())
        }

        #[inline(always)]
        unsafe fn store8(self, ptr: *mut f32) {
            _mm256_storeu_ps(ptr, self.0)
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
        /// 4 keys × 3 heads = 12 `__m512` accumulators, plus 3 query and 1 key vector: half
        /// the register file, so the allocator never spills in the FMA loop (8 keys × 3
        /// heads did, and ran slower).
        const KEY_GROUP: usize = 4;
        const SCORE_HEADS: usize = 3;

        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx512Lanes(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(ptr: *const f32) -> Self {
            Avx512Lanes(_mm512_loadu_ps(ptr))
        }
        #[inline(always)]
        unsafe fn load_partial(ptr: *const f32, n: usize) -> Self {
            Avx512Lanes(_mm512_maskz_loadu_ps(((1u32 << n) - 1) as __mmask16, ptr))
        }
        #[inline(always)]
        unsafe fn store_partial(self, ptr: *mut f32, n: usize) {
            _mm512_mask_storeu_ps(ptr, ((1u32 << n) - 1) as __mmask16, self.0)
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

        /// The [`Lanes::hsum`] trees of 8 vectors at once: each step adds the same lane
        /// pairs as the tree, for two vectors per instruction. Each step blends the two
        /// inputs so that one operand is in place and moves only the other (one shuffle
        /// instead of two: the shuffle units are the ones the FMAs compete with).
        #[inline(always)]
        unsafe fn hsum8(xs: &[Self; 8]) -> Self {
            // (Loops, not closures: a closure would not inherit the target features.)
            // l + l⊕8 of keys a = m, b = m + 4: 128-bit blocks [a0+a2, a1+a3, b2+b0, b3+b1].
            let mut t8 = [_mm512_setzero_ps(); 4];
            for (m, t) in t8.iter_mut().enumerate() {
                let (a, b) = (xs[m].0, xs[m + 4].0);
                let x = _mm512_mask_blend_ps(0xFF00, a, b);
                let y = _mm512_shuffle_f32x4::<0b01_00_11_10>(a, b);
                *t = _mm512_add_ps(x, y);
            }
            // l + l⊕4 of vectors p, q: blocks [p0+p1, q1+q0, p2+p3, q3+q2]; so u0 holds keys
            // [0, 1, 4, 5] and u1 keys [2, 3, 6, 7], one per block.
            let mut t4 = [_mm512_setzero_ps(); 2];
            for (m, t) in t4.iter_mut().enumerate() {
                let (p, q) = (t8[2 * m], t8[2 * m + 1]);
                let x = _mm512_mask_blend_ps(0xF0F0, p, q);
                let z = _mm512_mask_blend_ps(0x0F0F, p, q);
                let y = _mm512_shuffle_f32x4::<0b10_11_00_01>(z, z);
                *t = _mm512_add_ps(x, y);
            }
            // l + l⊕2 within each 128-bit block of r = u0, s = u1: [r0+r2, r1+r3, s2+s0,
            // s3+s1]; block i then holds key [0, 1, 4, 5][i] in lanes 0-1, [2, 3, 6, 7][i] in
            // lanes 2-3.
            let (r, s) = (t4[0], t4[1]);
            let x = _mm512_mask_blend_ps(0xCCCC, r, s);
            let z = _mm512_mask_blend_ps(0x3333, r, s);
            let t2 = _mm512_add_ps(x, _mm512_permute_ps::<0b01_00_11_10>(z));
            // l + l⊕1: each lane pair's sum (in both lanes), then keys gathered in order.
            let sums = _mm512_add_ps(t2, _mm512_permute_ps::<0b10_11_00_01>(t2));
            let order = _mm512_setr_epi32(0, 4, 2, 6, 8, 12, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
            Avx512Lanes(_mm512_permutexvar_ps(order, sums))
        }

        #[inline(always)]
        unsafe fn store8(self, ptr: *mut f32) {
            _mm256_storeu_ps(ptr, _mm512_castps512_ps256(self.0))
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

    /// [`super::probe_lanes`] on AVX2 + FMA.
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn probe_avx2(probe: &mut super::LanesProbe) {
        super::probe_lanes::<Avx2Lanes>(probe)
    }

    /// [`super::probe_lanes`] on AVX-512F.
    #[cfg(test)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn probe_avx512(probe: &mut super::LanesProbe) {
        super::probe_lanes::<Avx512Lanes>(probe)
    }
}

/// Inputs and outputs of [`probe_lanes`]: the reduction and partial-access primitives, run
/// once on one ISA (for the cross-ISA tests).
#[cfg(test)]
#[derive(Clone, Debug, PartialEq)]
struct LanesProbe {
    /// 8 vectors of 16 lanes for [`Lanes::hsum8`].
    sums_in: [[f32; LANES]; BLOCK_KEYS],
    /// Lanes 0–7 of `hsum8(sums_in)`.
    sums_out: [f32; BLOCK_KEYS],
    /// Lanes for [`Lanes::load_partial`]; `partial_n` of them are read.
    partial_in: [f32; LANES],
    partial_n: usize,
    /// `load_partial(partial_in, n)`, stored whole.
    loaded: [f32; LANES],
    /// Prefilled by the caller; `store_partial(partial_in, n)` writes into it.
    stored: [f32; LANES],
    /// Prefilled by the caller; `store8(load(sums_out lanes…))` writes into it.
    stored8: [f32; LANES],
}

/// Runs the probe's primitives on lanes `V`.
///
/// # Safety
/// `V`'s CPU features must be present.
#[cfg(test)]
#[inline(always)]
unsafe fn probe_lanes<V: Lanes>(probe: &mut LanesProbe) {
    let mut xs = [V::splat(0.0); BLOCK_KEYS];
    for (x, lanes) in xs.iter_mut().zip(&probe.sums_in) {
        *x = V::load(lanes.as_ptr());
    }
    let mut sums = [0.0; LANES];
    V::hsum8(&xs).store(sums.as_mut_ptr());
    probe.sums_out.copy_from_slice(&sums[..BLOCK_KEYS]);
    let n = probe.partial_n;
    V::load_partial(probe.partial_in.as_ptr(), n).store(probe.loaded.as_mut_ptr());
    V::load(probe.partial_in.as_ptr()).store_partial(probe.stored.as_mut_ptr(), n);
    V::load(probe.partial_in.as_ptr()).store8(probe.stored8.as_mut_ptr());
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

    /// Grows the scratch (never shrinks it) to `blocks` row groups of up to `max_keys` keys,
    /// so one scratch serves batches of rings of any size without allocating per call.
    pub fn reserve(&mut self, blocks: usize, n_q_heads: usize, max_keys: usize) {
        let per_block = self.per_block.max(n_q_heads * (score_stride(max_keys) + 1));
        let blocks = blocks.max(1).max(self.blocks());
        if per_block != self.per_block || blocks * per_block != self.buf.len() {
            *self = AttnScratch {
                buf: vec![0.0; blocks * per_block],
                per_block,
            };
        }
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
    let chunk = PendingChunk {
        ring,
        q_fixed,
        q_window,
        local_k,
        local_v,
        window: None,
    };
    attend_batch(&[chunk], layer, n_q_heads, scale, scratch, out)
}

/// One sequence's pending append in a batched attention call (see [`attend_batch`]).
#[derive(Clone, Copy, Debug)]
pub struct PendingChunk<'a> {
    /// The sequence's ring, with an append pending.
    pub ring: &'a DynamicRingBuffer,
    /// Queries rotated at their cache positions, `(n, n_q_heads, head_dim)`.
    pub q_fixed: &'a [f32],
    /// Queries rotated at their clocks, same layout.
    pub q_window: &'a [f32],
    /// The chunk's own keys, `(n, kv_heads, head_dim)`.
    pub local_k: &'a [f32],
    /// The chunk's own values, same layout.
    pub local_v: &'a [f32],
    /// A sliding-window layer (llama.cpp's standard SWA): a row at position `p` sees only
    /// the keys at `p − window + 1 ..= p`, whatever else the ring still holds. Such a ring
    /// has no anchor or recall rows (a sliding layer keeps only its window).
    pub window: Option<usize>,
}

/// Attention of several sequences' pending appends on layer `layer`, each over its own ring
/// ([`attend_chunk`] per chunk, with the rows of every chunk spread over one set of
/// threads). `out` holds the chunks' rows one after another. A row's result depends only on
/// its own chunk's ring and rows — never on the other chunks, the grouping or the thread
/// count — which is what keeps a batched step bit-identical to each sequence run alone.
pub fn attend_batch(
    chunks: &[PendingChunk<'_>],
    layer: usize,
    n_q_heads: usize,
    scale: f32,
    scratch: &mut AttnScratch,
    out: &mut [f32],
) -> Result<(), AttnError> {
    let mut need = 0;
    let mut total = 0;
    let mut dims = None;
    for chunk in chunks {
        let ring = chunk.ring;
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
        let d = AttnDims {
            n_q_heads,
            n_kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
        };
        d.validate()?;
        if dims.is_some_and(|first| first != d) {
            return Err(AttnError::BadDims(d));
        }
        dims = Some(d);
        let (q_row, kv_row) = (d.q_row(), d.kv_row());
        check_len("q_fixed", n * q_row, chunk.q_fixed.len())?;
        check_len("q_window", n * q_row, chunk.q_window.len())?;
        check_len("local_k", n * kv_row, chunk.local_k.len())?;
        check_len("local_v", n * kv_row, chunk.local_v.len())?;
        if let Some(window) = chunk.window {
            if window == 0 || !ring.fixed_slots().is_empty() {
                return Err(AttnError::BadWindow {
                    window,
                    fixed: ring.fixed_slots().len(),
                });
            }
        }
        let worst_keys = ring.fixed_slots().len() + ring.window_slots().len() + n;
        need = need.max(scratch_len(d, worst_keys));
        total += n;
    }
    let Some(dims) = dims else {
        return Err(AttnError::NoPendingAppend);
    };
    let q_row = dims.q_row();
    check_len("out", total * q_row, out.len())?;
    if scratch.per_block < need {
        return Err(AttnError::ScratchTooSmall {
            need,
            got: scratch.per_block,
        });
    }
    let isa = Isa::best();
    let kv_row = dims.kv_row();
    let row_inputs = |r: usize| {
        // Chunks are few: a linear scan finds row `r`'s chunk and its row `i` in it.
        let (mut chunk, mut i) = (&chunks[0], r);
        for c in chunks {
            chunk = c;
            if i < c.ring.pending_len() {
                break;
            }
            i -= c.ring.pending_len();
        }
        let ring = chunk.ring;
        let (ring_k, ring_v) = ring.layer_kv(layer);
        let mut start = ring.pending_local_start(i);
        let mut window_slots = ring.pending_window(i);
        if let Some(w) = chunk.window {
            // The window entries are the contiguous clocks just below the chunk's first row,
            // so the keys older than the sliding window are a prefix of them (and then of
            // the chunk's own rows).
            let clock0 = ring.pending_clock(0);
            let oldest_visible = (ring.pending_clock(i) + 1).saturating_sub(w as u64);
            let first_window_clock = clock0 - window_slots.len() as u64;
            let skip = oldest_visible.saturating_sub(first_window_clock) as usize;
            window_slots = &window_slots[skip.min(window_slots.len())..];
            start = start.max(oldest_visible.saturating_sub(clock0) as usize);
        }
        AttnInputs {
            q_fixed: &chunk.q_fixed[i * q_row..(i + 1) * q_row],
            q_window: &chunk.q_window[i * q_row..(i + 1) * q_row],
            ring_k,
            ring_v,
            fixed_slots: ring.fixed_slots(),
            window_slots,
            local_k: &chunk.local_k[start * kv_row..(i + 1) * kv_row],
            local_v: &chunk.local_v[start * kv_row..(i + 1) * kv_row],
        }
    };
    // The rings' own slot tables are in range and every length was checked above.
    let run = |first: usize, outs: &mut [f32], scratch: &mut [f32]| {
        for (r, out_row) in outs.chunks_exact_mut(q_row).enumerate() {
            run_row(isa, &row_inputs(first + r), dims, scale, scratch, out_row);
        }
    };
    let per_block = scratch.per_block;
    let blocks = scratch.blocks().min(total);
    if blocks == 1 {
        run(0, out, &mut scratch.buf[..per_block]);
        return Ok(());
    }
    let rows_per_block = total.div_ceil(blocks);
    use rayon::prelude::*;
    out.par_chunks_mut(rows_per_block * q_row)
        .zip(scratch.buf.par_chunks_mut(per_block))
        .enumerate()
        .for_each(|(b, (outs, scratch))| run(b * rows_per_block, outs, scratch));
    Ok(())
}

#[cfg(test)]
mod tests;
