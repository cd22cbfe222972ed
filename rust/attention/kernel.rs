//! The one generic kernel: every pass of the attention arithmetic, written once over a
//! 16-lane vector type ([`Lanes`]) that each ISA implements (`scalar`, `avx2`, `avx512`).

use std::ops::Range;

use crate::ring::KvSlice;

use super::{n_keys, score_stride, AttnDims, AttnInputs};

/// Lanes per vector of the canonical reduction order.
pub(super) const LANES: usize = 16;

/// Keys per score block of pass 1 (one transposing reduction per query head).
pub(super) const BLOCK_KEYS: usize = 8;

/// 16 f32 lanes. Implementations must perform exactly the IEEE operation each method names,
/// lane by lane, so every implementation gives identical bits.
///
/// All methods are `unsafe`: the SIMD implementations require their CPU features, and the
/// pointer methods read/write 16 (or `n`) f32.
pub(super) trait Lanes: Copy {
    /// Keys whose score accumulators are live at once (4 or 8; sized to the registers).
    const KEY_GROUP: usize;
    /// Query heads (1 to 3) scored together against each loaded key block.
    const SCORE_HEADS: usize;
    /// Vectors of head dimensions (1 to 4) a value block accumulates, and query heads (1 to
    /// 4) per value block: `VALUE_HEADS × VALUE_VECTORS` accumulators stay in registers.
    /// (How the dimensions are blocked never changes a result: every output lane sums its
    /// keys in sequence order.)
    const VALUE_VECTORS: usize;
    const VALUE_HEADS: usize;

    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(ptr: *const f32) -> Self;
    /// 16 f16 bit patterns widened to f32 (exact).
    unsafe fn load_f16(ptr: *const u16) -> Self;
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

    /// [`Lanes::load_f16`] of `n ≤ 16` values then zeros; reads only the `n` values.
    #[inline(always)]
    unsafe fn load_f16_partial(ptr: *const u16, n: usize) -> Self {
        let mut buf = [0u16; LANES];
        for (i, b) in buf.iter_mut().enumerate().take(n) {
            *b = *ptr.add(i);
        }
        Self::load_f16(buf.as_ptr())
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

/// `e^(v − shift)` of every value (each ≤ `shift`) into `out` (as long), 16 lanes at a time
/// with the kernel's exp: the same bits on every ISA.
///
/// # Safety
/// The lanes' CPU features must be present.
#[inline(always)]
pub(super) unsafe fn exp_shifted_lanes<V: Lanes>(values: &[f32], shift: f32, out: &mut [f32]) {
    debug_assert_eq!(values.len(), out.len());
    let m = V::splat(shift);
    let whole = values.len() / LANES * LANES;
    let (src, dst) = (values.as_ptr(), out.as_mut_ptr());
    for b in (0..whole).step_by(LANES) {
        V::exp_nonpositive(V::sub(V::load(src.add(b)), m)).store(dst.add(b));
    }
    let tail = values.len() - whole;
    if tail > 0 {
        let x = V::sub(V::load_partial(src.add(whole), tail), m);
        V::exp_nonpositive(x).store_partial(dst.add(whole), tail);
    }
}

/// How the kernel reads one stored K/V value type: f32, or f16 bit patterns (`u16`).
pub(super) trait KvElem: Copy {
    /// 16 values at `ptr` as lanes.
    unsafe fn lanes<V: Lanes>(ptr: *const Self) -> V;
    /// `n ≤ 16` values at `ptr`, then zeros.
    unsafe fn lanes_partial<V: Lanes>(ptr: *const Self, n: usize) -> V;
    /// The values of `s` when it is stored as this type.
    fn typed(s: KvSlice<'_>) -> Option<&[Self]>;
}

impl KvElem for f32 {
    fn typed(s: KvSlice<'_>) -> Option<&[f32]> {
        match s {
            KvSlice::F32(v) => Some(v),
            KvSlice::F16(_) => None,
        }
    }
    #[inline(always)]
    unsafe fn lanes<V: Lanes>(ptr: *const f32) -> V {
        V::load(ptr)
    }
    #[inline(always)]
    unsafe fn lanes_partial<V: Lanes>(ptr: *const f32, n: usize) -> V {
        V::load_partial(ptr, n)
    }
}

impl KvElem for u16 {
    fn typed(s: KvSlice<'_>) -> Option<&[u16]> {
        match s {
            KvSlice::F16(v) => Some(v),
            KvSlice::F32(_) => None,
        }
    }
    #[inline(always)]
    unsafe fn lanes<V: Lanes>(ptr: *const u16) -> V {
        V::load_f16(ptr)
    }
    #[inline(always)]
    unsafe fn lanes_partial<V: Lanes>(ptr: *const u16, n: usize) -> V {
        V::load_f16_partial(ptr, n)
    }
}

/// One K or V row source of the key sequence, in order.
#[derive(Clone, Copy)]
enum Segment<'a, E> {
    Slots {
        base: *const E,
        slots: &'a [u32],
    },
    Rows {
        base: *const E,
        count: usize,
    },
    /// A slot table whose first keys (`head` slots) come from another ring's storage.
    Split {
        head_base: *const E,
        head: &'a [u32],
        base: *const E,
        slots: &'a [u32],
    },
}

impl<E: KvElem> Segment<'_, E> {
    fn len(&self) -> usize {
        match self {
            Segment::Slots { slots, .. } => slots.len(),
            Segment::Rows { count, .. } => *count,
            Segment::Split { head, slots, .. } => head.len() + slots.len(),
        }
    }

    /// Prefetches key `i + PREFETCH_AHEAD`'s values `[offset, offset + len)` of its row, for
    /// a slot table only: sequential rows are the hardware prefetcher's job, and there the
    /// hints would be pure overhead.
    #[inline(always)]
    unsafe fn prefetch_ahead(&self, i: usize, kv_row: usize, offset: usize, len: usize) {
        let ahead = i + PREFETCH_AHEAD;
        let (base, slot) = match *self {
            Segment::Slots { base, slots } => (base, slots.get(ahead)),
            Segment::Rows { .. } => return,
            Segment::Split {
                head_base,
                head,
                base,
                slots,
            } => match head.get(ahead) {
                Some(slot) => (head_base, Some(slot)),
                None => (base, slots.get(ahead - head.len())),
            },
        };
        if let Some(&slot) = slot {
            let at = base.add(slot as usize * kv_row + offset);
            prefetch(at.cast(), len * std::mem::size_of::<E>());
        }
    }

    /// Start of key `i`'s row (`kv_row` values).
    #[inline(always)]
    unsafe fn row(&self, i: usize, kv_row: usize) -> *const E {
        match self {
            Segment::Slots { base, slots } => base.add(*slots.get_unchecked(i) as usize * kv_row),
            Segment::Rows { base, .. } => base.add(i * kv_row),
            Segment::Split {
                head_base,
                head,
                base,
                slots,
            } => match head.get(i) {
                Some(&slot) => head_base.add(slot as usize * kv_row),
                None => base.add(*slots.get_unchecked(i - head.len()) as usize * kv_row),
            },
        }
    }
}

/// Keys ahead the value pass prefetches: table-driven rows are scattered, so the hardware
/// prefetcher cannot guess the next one. (The score pass does not prefetch: its 8 row streams
/// per key group already keep the miss buffers busy, and measured, extra prefetches there
/// only slowed it down.)
const PREFETCH_AHEAD: usize = 12;

/// Hints every cache line of `[ptr, ptr + bytes)` into L1: one hint per 64 bytes from
/// `ptr`, plus one at the last byte (the line a misaligned range ends in). Straight-line code
/// when `bytes` is a constant. Never changes a result.
#[inline(always)]
fn prefetch(ptr: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
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
    let _ = (ptr, bytes);
}

/// The row's key sequence for K or V: the fixed and window segments in the ring's storage
/// type `E`, then the local rows (f32, already rounded as the ring would store them).
struct KeySequence<'a, E> {
    fixed: Segment<'a, E>,
    window: Segment<'a, E>,
    local: Segment<'a, f32>,
}

#[inline(always)]
fn key_sequence<'a, E>(
    inputs: &AttnInputs<'a>,
    ring: &'a [E],
    head: Option<&'a [E]>,
    dims: AttnDims,
    values: bool,
) -> KeySequence<'a, E> {
    let local = if values {
        inputs.local_v
    } else {
        inputs.local_k
    };
    KeySequence {
        fixed: Segment::Slots {
            base: ring.as_ptr(),
            slots: inputs.fixed_slots,
        },
        window: match (head, inputs.window_head) {
            (Some(head), Some(h)) => Segment::Split {
                head_base: head.as_ptr(),
                head: h.slots,
                base: ring.as_ptr(),
                slots: inputs.window_slots,
            },
            _ => Segment::Slots {
                base: ring.as_ptr(),
                slots: inputs.window_slots,
            },
        },
        local: Segment::Rows {
            base: local.as_ptr(),
            count: local.len() / dims.kv_row(),
        },
    }
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
unsafe fn score_block<V: Lanes, E: KvElem, const NH: usize, const KG: usize>(
    q: *const f32,
    rows: &[*const E; BLOCK_KEYS],
    offset: usize,
    head_dim: usize,
    scale: f32,
) -> [V; NH] {
    let full = head_dim / LANES;
    let tail = head_dim % LANES;
    // (Loops, not closures: a closure would not inherit the caller's target features.)
    let mut sums = [[V::splat(0.0); BLOCK_KEYS]; NH];
    for first in (0..BLOCK_KEYS).step_by(KG) {
        let group: &[*const E; KG] = &*rows.as_ptr().add(first).cast();
        let mut acc = [[V::splat(0.0); KG]; NH];
        for b in 0..full {
            let mut qb = [V::splat(0.0); NH];
            for (hh, qb) in qb.iter_mut().enumerate() {
                *qb = V::load(q.add(hh * head_dim + b * LANES));
            }
            let at = offset + b * LANES;
            for (n, row) in group.iter().enumerate() {
                let k = E::lanes::<V>(row.add(at));
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
                let k = E::lanes_partial::<V>(row.add(at), tail);
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
unsafe fn store_scores<V: Lanes, E: KvElem, const NH: usize>(
    q: &[f32],
    rows: &[*const E; BLOCK_KEYS],
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
        4 => score_block::<V, E, NH, 4>(q, rows, offset, head_dim, scale),
        _ => score_block::<V, E, NH, 8>(q, rows, offset, head_dim, scale),
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

/// Query heads `heads` of the row: scores, softmax, weighted value sum, into `out`
/// (`heads.len() × head_dim`). A head's arithmetic never depends on which other heads are
/// computed with it, so a row's heads may be split across threads. Inputs must be validated
/// (the ring's K and V share one storage type), `scratch` sized for the whole row.
#[inline(always)]
pub(super) unsafe fn kernel<V: Lanes>(
    inputs: &AttnInputs<'_>,
    dims: AttnDims,
    scale: f32,
    heads: Range<usize>,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    match inputs.ring_k {
        KvSlice::F16(_) => kernel_for::<V, u16>(inputs, dims, scale, heads, scratch, out),
        KvSlice::F32(_) => kernel_for::<V, f32>(inputs, dims, scale, heads, scratch, out),
    }
}

/// Pass 1 over one segment of the key sequence, whose first key is key `j` of the row.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn score_segment<V: Lanes, E: KvElem>(
    segment: Segment<'_, E>,
    q: &[f32],
    j: usize,
    dims: AttnDims,
    scale: f32,
    heads: &Range<usize>,
    scores: *mut f32,
    stride: usize,
) {
    let (n_q_heads, n_kv_heads) = (dims.n_q_heads, dims.n_kv_heads);
    let kv_row = dims.kv_row();
    let group = n_q_heads / n_kv_heads;
    let n = segment.len();
    let mut i = 0;
    while i < n {
        let count = (n - i).min(BLOCK_KEYS);
        let mut rows = [std::ptr::null(); BLOCK_KEYS];
        for (r, row) in rows.iter_mut().enumerate() {
            *row = segment.row(i + r.min(count - 1), kv_row);
        }
        for g in 0..n_kv_heads {
            let (mut h0, end) = heads_of_group(g, group, heads);
            while h0 < end {
                let heads = (end - h0).min(V::SCORE_HEADS);
                let dst = scores.add(j + i);
                match heads {
                    1 => store_scores::<V, E, 1>(q, &rows, dims, g, h0, scale, dst, stride, count),
                    2 => store_scores::<V, E, 2>(q, &rows, dims, g, h0, scale, dst, stride, count),
                    _ => store_scores::<V, E, 3>(q, &rows, dims, g, h0, scale, dst, stride, count),
                }
                h0 += heads;
            }
        }
        i += count;
    }
}

/// The query heads of KV head `g` that are in `heads`, as `(first, end)` (empty: first ≥
/// end).
#[inline(always)]
fn heads_of_group(g: usize, group: usize, heads: &Range<usize>) -> (usize, usize) {
    (
        (g * group).max(heads.start),
        ((g + 1) * group).min(heads.end),
    )
}

/// [`kernel`] for a ring stored as `E`.
#[inline(always)]
unsafe fn kernel_for<V: Lanes, E: KvElem>(
    inputs: &AttnInputs<'_>,
    dims: AttnDims,
    scale: f32,
    heads: Range<usize>,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let typed = |s| E::typed(s).expect("validated: K, V and a window head share one storage type");
    let (ring_k, ring_v) = (typed(inputs.ring_k), typed(inputs.ring_v));
    let head = inputs.window_head.map(|h| [typed(h.k), typed(h.v)]);
    let AttnDims {
        n_q_heads,
        n_kv_heads,
        head_dim,
    } = dims;
    let group = n_q_heads / n_kv_heads;
    let total = n_keys(inputs, dims);
    let stride = score_stride(total);
    let (scores, inv) = scratch.split_at_mut(n_q_heads * stride);
    let scores = scores.as_mut_ptr();

    // Pass 1: scores, 8 keys of a segment at a time (a short last block repeats its last
    // row and stores only its own lanes); each loaded key block feeds every query head of its
    // KV head (up to `V::SCORE_HEADS` at once).
    let keys = key_sequence(inputs, ring_k, head.map(|[k, _]| k), dims, false);
    let (fixed, window) = (keys.fixed.len(), keys.window.len());
    let hs = &heads;
    score_segment::<V, E>(
        keys.fixed,
        inputs.q_fixed,
        0,
        dims,
        scale,
        hs,
        scores,
        stride,
    );
    score_segment::<V, E>(
        keys.window,
        inputs.q_window,
        fixed,
        dims,
        scale,
        hs,
        scores,
        stride,
    );
    let local = fixed + window;
    score_segment::<V, f32>(
        keys.local,
        inputs.q_window,
        local,
        dims,
        scale,
        hs,
        scores,
        stride,
    );

    // Pass 2: numerically stable softmax weights, per query head.
    for (h, inv_h) in inv.iter_mut().enumerate().take(heads.end).skip(heads.start) {
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
    let values = key_sequence(inputs, ring_v, head.map(|[_, v]| v), dims, true);
    for g in 0..n_kv_heads {
        let (mut h0, end) = heads_of_group(g, group, &heads);
        while h0 < end {
            let block_heads = (end - h0).min(V::VALUE_HEADS);
            let mut d0 = 0;
            while d0 < head_dim {
                let width = (head_dim - d0).min(V::VALUE_VECTORS * LANES);
                macro_rules! block {
                    ($nh:literal) => {
                        if width == V::VALUE_VECTORS * LANES {
                            value_block::<V, E, $nh, true>(
                                &values,
                                dims,
                                g,
                                h0,
                                d0,
                                width,
                                scores,
                                stride,
                                inv,
                                heads.start,
                                out,
                            )
                        } else {
                            value_block::<V, E, $nh, false>(
                                &values,
                                dims,
                                g,
                                h0,
                                d0,
                                width,
                                scores,
                                stride,
                                inv,
                                heads.start,
                                out,
                            )
                        }
                    };
                }
                match block_heads {
                    1 => block!(1),
                    2 => block!(2),
                    3 => block!(3),
                    _ => block!(4),
                }
                d0 += width;
            }
            h0 += block_heads;
        }
    }
}

/// Accumulates one segment's values into `acc` (keys in sequence order; the segment's first
/// key is key `j` of the row).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn value_segment<V: Lanes, E: KvElem, const NH: usize, const FULL: bool>(
    segment: Segment<'_, E>,
    acc: &mut [[V; 4]; NH],
    j: usize,
    dims: AttnDims,
    g: usize,
    h0: usize,
    d0: usize,
    width: usize,
    scores: *const f32,
    stride: usize,
) {
    let kv_row = dims.kv_row();
    let head_dim = dims.head_dim;
    for i in 0..segment.len() {
        let prefetch_len = if FULL {
            V::VALUE_VECTORS * LANES
        } else {
            width
        };
        segment.prefetch_ahead(i, kv_row, g * head_dim + d0, prefetch_len);
        let v = segment.row(i, kv_row).add(g * head_dim + d0);
        let mut vv = [V::splat(0.0); 4];
        for (c, lane) in vv.iter_mut().enumerate().take(V::VALUE_VECTORS) {
            if FULL {
                *lane = E::lanes::<V>(v.add(c * LANES));
            } else {
                let start = c * LANES;
                if start < width {
                    *lane = E::lanes_partial::<V>(v.add(start), (width - start).min(LANES));
                }
            }
        }
        for (hh, acc_h) in acc.iter_mut().enumerate() {
            let p = V::splat(*scores.add((h0 + hh) * stride + j + i));
            for c in 0..V::VALUE_VECTORS {
                acc_h[c] = V::fma(p, vv[c], acc_h[c]);
            }
        }
    }
}

/// `out[h0..h0+NH][d0..d0+width] = inv · Σ_j p[h][j] · v_j[g][d0..]` (keys in sequence order;
/// `out` starts at head `first_head`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn value_block<V: Lanes, E: KvElem, const NH: usize, const FULL: bool>(
    values: &KeySequence<'_, E>,
    dims: AttnDims,
    g: usize,
    h0: usize,
    d0: usize,
    width: usize,
    scores: *const f32,
    stride: usize,
    inv: &[f32],
    first_head: usize,
    out: &mut [f32],
) {
    let head_dim = dims.head_dim;
    let mut acc = [[V::splat(0.0); 4]; NH];
    let (fixed, window) = (values.fixed.len(), values.window.len());
    value_segment::<V, E, NH, FULL>(
        values.fixed,
        &mut acc,
        0,
        dims,
        g,
        h0,
        d0,
        width,
        scores,
        stride,
    );
    value_segment::<V, E, NH, FULL>(
        values.window,
        &mut acc,
        fixed,
        dims,
        g,
        h0,
        d0,
        width,
        scores,
        stride,
    );
    value_segment::<V, f32, NH, FULL>(
        values.local,
        &mut acc,
        fixed + window,
        dims,
        g,
        h0,
        d0,
        width,
        scores,
        stride,
    );
    for (hh, acc_h) in acc.iter().enumerate() {
        let h = h0 + hh;
        let scale = V::splat(inv[h]);
        let dst = out.as_mut_ptr().add((h - first_head) * head_dim + d0);
        for (c, lane) in acc_h.iter().enumerate().take(V::VALUE_VECTORS) {
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

// ----- a probe of the primitives (cross-ISA tests) ---------------------------------------

/// Inputs and outputs of [`probe_lanes`]: the reduction and partial-access primitives, run
/// once on one ISA (for the cross-ISA tests).
#[cfg(test)]
#[derive(Clone, Debug, PartialEq)]
pub(super) struct LanesProbe {
    /// 8 vectors of 16 lanes for [`Lanes::hsum8`].
    pub(super) sums_in: [[f32; LANES]; BLOCK_KEYS],
    /// Lanes 0–7 of `hsum8(sums_in)`.
    pub(super) sums_out: [f32; BLOCK_KEYS],
    /// Lanes for [`Lanes::load_partial`]; `partial_n` of them are read.
    pub(super) partial_in: [f32; LANES],
    pub(super) partial_n: usize,
    /// `load_partial(partial_in, n)`, stored whole.
    pub(super) loaded: [f32; LANES],
    /// Prefilled by the caller; `store_partial(partial_in, n)` writes into it.
    pub(super) stored: [f32; LANES],
    /// Prefilled by the caller; `store8(load(sums_out lanes…))` writes into it.
    pub(super) stored8: [f32; LANES],
}

/// Runs the probe's primitives on lanes `V`.
///
/// # Safety
/// `V`'s CPU features must be present.
#[cfg(test)]
#[inline(always)]
pub(super) unsafe fn probe_lanes<V: Lanes>(probe: &mut LanesProbe) {
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
