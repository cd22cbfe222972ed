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
//! The arithmetic is written once, generically over a 16-lane vector type (`Lanes`, in
//! `kernel`), and instantiated for AVX-512F (one `__m512`, `avx512`), AVX2+FMA (two
//! `__m256`, `avx2`) and a portable scalar fallback (`[f32; 16]` with `f32::mul_add`,
//! `scalar`). Every path performs the same IEEE operations in
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

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod kernel;
mod scalar;
#[cfg(test)]
mod tests;

use std::fmt;
use std::ops::Range;
use std::sync::OnceLock;

use crate::ring::{DynamicRingBuffer, KvSlice};
use kernel::{kernel, LANES};
#[cfg(test)]
use kernel::{probe_lanes, Lanes, LanesProbe, BLOCK_KEYS};
use scalar::ScalarLanes;

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
    /// Ring keys of the layer, `(slots, n_kv_heads, head_dim)`, as the ring stores them.
    pub ring_k: KvSlice<'a>,
    /// Ring values of the layer, same layout and storage type.
    pub ring_v: KvSlice<'a>,
    /// Fixed segment: physical slots (recall then anchors).
    pub fixed_slots: &'a [u32],
    /// Window segment: physical slots in clock order.
    pub window_slots: &'a [u32],
    /// The window segment's first keys, read from another ring's storage (see
    /// [`WindowHead`]); the own `window_slots` follow them.
    pub window_head: Option<WindowHead<'a>>,
    /// Local keys, `(n_local, n_kv_heads, head_dim)`, attended after the window.
    pub local_k: &'a [f32],
    /// Local values, same layout.
    pub local_v: &'a [f32],
}

/// The first keys of a row's window segment, in another ring whose rows at those clocks are
/// bit-identical to the row's own (a prompt prefix several sequences of a batch share). The
/// key sequence, its order and so every result are unchanged; the shared rows are read
/// from one copy, which stays in the caches, instead of one DRAM copy per sequence.
#[derive(Clone, Copy, Debug)]
pub struct WindowHead<'a> {
    /// That ring's keys of the layer, laid out as [`AttnInputs::ring_k`].
    pub k: KvSlice<'a>,
    /// Its values.
    pub v: KvSlice<'a>,
    /// Its physical slots of the head's keys, in clock order.
    pub slots: &'a [u32],
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
    /// A [`PendingChunk::shared_prefix`] names no other chunk of the call.
    BadSharedPrefix {
        /// The chunk it names.
        chunk: usize,
        /// Chunks in the call.
        chunks: usize,
    },
    /// A layer index outside the ring.
    LayerOutOfRange {
        /// The layer.
        layer: usize,
        /// Layers the ring holds.
        n_layers: usize,
    },
    /// Ring keys and values stored as different types.
    MixedKvDtypes,
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
            AttnError::MixedKvDtypes => {
                write!(f, "ring keys and values must be stored as the same type")
            }
            AttnError::ScratchTooSmall { need, got } => {
                write!(f, "scratch too small: need {need} f32, got {got}")
            }
            AttnError::IsaUnavailable(isa) => write!(f, "{isa:?} is not available on this CPU"),
            AttnError::NoPendingAppend => write!(f, "the ring has no pending append"),
            AttnError::BadSharedPrefix { chunk, chunks } => write!(
                f,
                "a shared prefix names chunk {chunk}: not another of the call's {chunks} chunks"
            ),
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
    /// Two `__m256` per 16 lanes (x86-64 AVX2 + FMA, F16C for f16 rings).
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
                    && std::arch::is_x86_feature_detected!("f16c")
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
    let head = inputs.window_head.map_or(0, |h| h.slots.len());
    inputs.fixed_slots.len()
        + head
        + inputs.window_slots.len()
        + inputs.local_k.len() / dims.kv_row()
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
    if inputs.ring_k.dtype() != inputs.ring_v.dtype() {
        return Err(AttnError::MixedKvDtypes);
    }
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
    if let Some(head) = inputs.window_head {
        check_len("window_head.v", head.k.len(), head.v.len())?;
        if head.k.dtype() != inputs.ring_k.dtype() || head.v.dtype() != inputs.ring_k.dtype() {
            return Err(AttnError::MixedKvDtypes);
        }
        if head.k.len() % kv_row != 0 {
            return Err(AttnError::ShapeMismatch {
                what: "window_head.k",
                expected: head.k.len().next_multiple_of(kv_row),
                got: head.k.len(),
            });
        }
        let slots = head.k.len() / kv_row;
        if let Some(&slot) = head.slots.iter().find(|&&s| s as usize >= slots) {
            return Err(AttnError::SlotOutOfRange { slot, slots });
        }
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
    run_heads(isa, inputs, dims, scale, 0..dims.n_q_heads, scratch, out)
}

/// Query heads `heads` of one validated row (`out`: those heads' `heads.len() × head_dim`).
fn run_heads(
    isa: Isa,
    inputs: &AttnInputs<'_>,
    dims: AttnDims,
    scale: f32,
    heads: Range<usize>,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    debug_assert!(heads.end <= dims.n_q_heads && out.len() == heads.len() * dims.head_dim);
    match isa {
        Isa::Scalar => {
            // SAFETY: the scalar lanes use no CPU extension; `validate` checked every length
            // and slot index the kernel dereferences.
            unsafe { kernel::<ScalarLanes>(inputs, dims, scale, heads, scratch, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => {
            // SAFETY: callers reach here only after `Isa::is_available` (AVX2, FMA, F16C
            // present); inputs validated as above.
            unsafe { avx2::attend_avx2(inputs, dims, scale, heads, scratch, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            // SAFETY: only after `Isa::is_available` (AVX-512F present); inputs validated.
            unsafe { avx512::attend_avx512(inputs, dims, scale, heads, scratch, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("non-x86 ISAs are never available"),
    }
}

/// `out[i] = e^(values[i] − shift)` for values at most `shift` (a softmax's numerators; below
/// −87.34 they are 0), with the attention kernel's exp on the widest ISA: the same bits on
/// every ISA ([`exp_shifted_with`]). Panics if the lengths differ.
pub fn exp_shifted(values: &[f32], shift: f32, out: &mut [f32]) {
    exp_shifted_with(Isa::best(), values, shift, out)
}

/// [`exp_shifted`] on a chosen, available ISA (for tests).
pub fn exp_shifted_with(isa: Isa, values: &[f32], shift: f32, out: &mut [f32]) {
    assert_eq!(values.len(), out.len(), "exp_shifted: lengths differ");
    assert!(
        isa.is_available(),
        "exp_shifted: {isa:?} is not available on this CPU"
    );
    match isa {
        // SAFETY: the scalar lanes use no CPU extension; the lengths are equal.
        Isa::Scalar => unsafe { kernel::exp_shifted_lanes::<ScalarLanes>(values, shift, out) },
        // SAFETY: AVX2, FMA and F16C are present (checked above); the lengths are equal.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { avx2::exp_shifted_avx2(values, shift, out) },
        // SAFETY: AVX-512F is present (checked above); the lengths are equal.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::exp_shifted_avx512(values, shift, out) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("non-x86 ISAs are never available"),
    }
}

// ----- chunk helper ------------------------------------------------------------------------

/// Keys a row must attend to before [`attend_batch`] splits its heads over threads when its
/// rows do not divide evenly over them: below this, handing work to another thread costs
/// more than it saves.
const SPLIT_HEADS_MIN_KEYS: usize = 128;

/// Ranges each row's query heads are cut into so that `rows × parts` units divide evenly over
/// `threads` (1: whole rows, when they already do, when there is one thread, or when the rows
/// are too short to be worth splitting).
fn head_parts(rows: usize, threads: usize, n_q_heads: usize, worst_keys: usize) -> usize {
    if threads <= 1 || rows.is_multiple_of(threads) || worst_keys < SPLIT_HEADS_MIN_KEYS {
        return 1;
    }
    let (mut a, mut b) = (rows, threads);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    (threads / a).min(n_q_heads)
}

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
        shared_prefix: None,
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
    /// Another chunk of the call whose sequence has the same tokens at the first clocks
    /// (the caller's promise): see [`SharedPrefix`].
    pub shared_prefix: Option<SharedPrefix>,
}

/// Clocks `0..clocks` whose K/V rows chunk `chunk`'s ring holds bit-identically: the same
/// tokens at the same positions give the same rows (the batch invariance every path keeps,
/// replayed or computed). Attention reads them from that ring ([`WindowHead`]) as far as both
/// rings still hold every clock from 0 in their windows ([`shareable_window`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedPrefix {
    /// The chunk (index in the call) whose ring is read.
    pub chunk: usize,
    /// Leading clocks with the same tokens in both sequences.
    pub clocks: usize,
}

/// How many leading window keys of `ring`'s pending append (row 0's window) `leader`'s
/// ring holds at the same clocks, given that their first `clocks` tokens are the same: both
/// windows must still start at clock 0 (nothing pruned or overwritten), with no fixed
/// (recall or anchor) rows before them.
pub fn shareable_window(
    ring: &DynamicRingBuffer,
    leader: &DynamicRingBuffer,
    clocks: usize,
) -> usize {
    if !ring.has_pending() || !leader.has_pending() {
        return 0;
    }
    if !ring.fixed_slots().is_empty()
        || !leader.fixed_slots().is_empty()
        || !ring_window_from_zero(ring, 0)
        || !ring_window_from_zero(leader, 0)
    {
        return 0;
    }
    let (own, theirs) = (ring.pending_window(0), leader.pending_window(0));
    clocks.min(own.len()).min(theirs.len())
}

/// Pending row `row` of `ring` sees every clock from 0 in its window.
fn ring_window_from_zero(ring: &DynamicRingBuffer, row: usize) -> bool {
    ring.pending_clock(0) == ring.pending_window(row).len() as u64
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
    let mut worst_keys_seen = 0;
    let mut dims = None;
    for (me, chunk) in chunks.iter().enumerate() {
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
        if let Some(sp) = chunk.shared_prefix {
            if sp.chunk >= chunks.len() || sp.chunk == me {
                return Err(AttnError::BadSharedPrefix {
                    chunk: sp.chunk,
                    chunks: chunks.len(),
                });
            }
        }
        let worst_keys = ring.fixed_slots().len() + ring.window_slots().len() + n;
        worst_keys_seen = worst_keys_seen.max(worst_keys);
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
        // Keys of the window the row does not see (a sliding layer's older ones).
        let mut skip = 0;
        if let Some(w) = chunk.window {
            // The window entries are the contiguous clocks just below the chunk's first row,
            // so the keys older than the sliding window are a prefix of them (and then of
            // the chunk's own rows).
            let clock0 = ring.pending_clock(0);
            let oldest_visible = (ring.pending_clock(i) + 1).saturating_sub(w as u64);
            let first_window_clock = clock0 - window_slots.len() as u64;
            skip = (oldest_visible.saturating_sub(first_window_clock) as usize)
                .min(window_slots.len());
            window_slots = &window_slots[skip..];
            start = start.max(oldest_visible.saturating_sub(clock0) as usize);
        }
        // With a shared prefix the row reads the leader's clocks `skip..n` (its window then
        // starts at clock 0, so `skip` is the first clock it sees) and its own after them.
        let shared = chunk.shared_prefix.and_then(|sp| {
            let leader = chunks[sp.chunk].ring;
            // Row i's window must start at clock 0 too (it could have slid in the chunk).
            let n = if ring_window_from_zero(ring, i) {
                shareable_window(ring, leader, sp.clocks)
            } else {
                0
            };
            let (k, v) = leader.layer_kv(layer);
            (n > skip && k.dtype() == ring_k.dtype()).then(|| {
                let slots = &leader.pending_window(0)[skip..n];
                (WindowHead { k, v, slots }, n - skip)
            })
        });
        AttnInputs {
            q_fixed: &chunk.q_fixed[i * q_row..(i + 1) * q_row],
            q_window: &chunk.q_window[i * q_row..(i + 1) * q_row],
            ring_k,
            ring_v,
            fixed_slots: ring.fixed_slots(),
            window_slots: &window_slots[shared.map_or(0, |(_, n)| n)..],
            window_head: shared.map(|(head, _)| head),
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
    let threads = scratch.blocks();
    let parts = head_parts(total, threads, dims.n_q_heads, worst_keys_seen);
    use rayon::prelude::*;
    if parts > 1 {
        // Rows do not divide evenly over the threads (one row decoding alone, an odd batch,
        // a verify step of k + 1 rows): each row's query heads are cut into `parts` ranges
        // and the threads take equal runs of those units, in order. A head's arithmetic is
        // the same whichever heads share its call, so the output is too.
        let hd = dims.head_dim;
        let units = total * parts;
        let heads_of = |u: usize| {
            let p = u % parts;
            p * dims.n_q_heads / parts..(p + 1) * dims.n_q_heads / parts
        };
        let mut groups = Vec::with_capacity(threads);
        let mut rest = out;
        for g in 0..threads {
            let (u0, u1) = (g * units / threads, (g + 1) * units / threads);
            let len: usize = (u0..u1).map(|u| heads_of(u).len() * hd).sum();
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(len);
            groups.push((u0..u1, mine));
            rest = tail;
        }
        groups
            .into_par_iter()
            .zip(scratch.buf.par_chunks_mut(per_block))
            .for_each(|((units, out), scratch)| {
                let mut at = 0;
                for u in units {
                    let heads = heads_of(u);
                    let len = heads.len() * hd;
                    let inputs = row_inputs(u / parts);
                    run_heads(
                        isa,
                        &inputs,
                        dims,
                        scale,
                        heads,
                        scratch,
                        &mut out[at..at + len],
                    );
                    at += len;
                }
            });
        return Ok(());
    }
    let blocks = threads.min(total);
    if blocks == 1 {
        run(0, out, &mut scratch.buf[..per_block]);
        return Ok(());
    }
    let rows_per_block = total.div_ceil(blocks);
    out.par_chunks_mut(rows_per_block * q_row)
        .zip(scratch.buf.par_chunks_mut(per_block))
        .enumerate()
        .for_each(|(b, (outs, scratch))| run(b * rows_per_block, outs, scratch));
    Ok(())
}
