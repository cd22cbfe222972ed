//! The SIMD matmul kernels of every quantized format, written once over a small vector
//! abstraction ([`Isa`]) that AVX-512 (with or without VNNI) and AVX2 implement.
//!
//! Lanes are output rows. A group of `LANES` rows is unpacked block by block into
//! *dword-interleaved* code vectors: vector `v` holds, in the 32-bit lane of row `i`, the
//! four unsigned codes of row `i` for elements `4v..4v+4` of the block. A token's integer dot
//! product is then `Σ_v dot4(code_v, broadcast(a[4v..4v+4]))`, accumulating straight into
//! per-row lanes (one `vpdpbusd` per vector with VNNI) — no per-token transposes. The
//! unpacked blocks of a column chunk sit in an L1-sized buffer and serve every token of the
//! rectangle, `TILE` tokens at a time with their accumulators in registers; each lane then
//! performs exactly the scalar canonical sequence (see `scalar`), so results are bit-identical
//! to it whatever the ISA, the tiling or the chunking.

use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
use std::mem::MaybeUninit;
use std::ops::Range;

use super::activation::{ActBlocks, SuperActBlocks};
use super::format::{BlockFormat, GgmlType, QK};
use super::interleave::GROUP;
use super::kernel::OutPtr;
use super::kquant::{SuperBlockFormat, QK_K};
use super::scalar;

/// The vector operations the kernels need. Integer vectors hold `LANES` 32-bit lanes (one
/// per output row); the byte-level operations work within each 32-bit lane.
///
/// # Safety
/// Every method needs the CPU features of its implementation; callers run them inside a
/// function compiled with those features (`#[target_feature]`).
pub(crate) trait Isa: Copy {
    /// Output rows per vector.
    const LANES: usize;
    /// VNNI's exact `u8 × i8 → i32` dot: any byte codes, the scale applied after the sum.
    const VNNI: bool;
    /// Tokens whose accumulators stay in registers.
    const TILE: usize;
    /// Code vectors of a k-quant group dotted at once (register budget).
    const UNIT: usize;
    /// Integer vector.
    type I: Copy;
    /// f32 vector.
    type F: Copy;

    unsafe fn zero() -> Self::I;
    unsafe fn splat(v: i32) -> Self::I;
    /// The i32 at `p` in every lane.
    unsafe fn splat_load(p: *const i32) -> Self::I;
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn add32(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn sub32(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn sub8(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn mullo32(a: Self::I, b: Self::I) -> Self::I;
    /// Logical shifts of the 32-bit lanes.
    unsafe fn srl32(a: Self::I, n: u32) -> Self::I;
    unsafe fn sll32(a: Self::I, n: u32) -> Self::I;
    /// Arithmetic right shifts of the 32- and 16-bit lanes.
    unsafe fn sra32(a: Self::I, n: u32) -> Self::I;
    unsafe fn sra16(a: Self::I, n: u32) -> Self::I;
    /// Rearranges the bytes of every 32-bit lane: byte `k` of the result is byte
    /// `ctrl.to_le_bytes()[k]` of the lane, or 0 where that control byte is `0x80`.
    unsafe fn dword_bytes(a: Self::I, ctrl: u32) -> Self::I;
    /// `0x01` in every byte where `a & mask` is non-zero, else 0.
    unsafe fn bits_to_ones(a: Self::I, mask: Self::I) -> Self::I;
    unsafe fn load(p: *const Self::I) -> Self::I;
    unsafe fn store(p: *mut Self::I, v: Self::I);
    /// The 16 bytes at `p + i·stride` of every row `i`, as four vectors: lane `i` of vector
    /// `k` is the `k`-th 32-bit word of row `i`'s bytes.
    unsafe fn rows_x16(p: *const u8, stride: usize) -> [Self::I; 4];
    /// `acc + Σ_k c0_k · a[k] + Σ_k c1_k · a[4 + k]` per lane (codes below 64, or any byte
    /// with VNNI).
    unsafe fn dot_pair(acc: Self::I, c0: Self::I, c1: Self::I, a: *const i8) -> Self::I;
    /// The two i16 halves of every lane: `c_0·a[0] + c_1·a[1]` and `c_2·a[2] + c_3·a[3]`
    /// (`vpmaddubsw`; unsigned codes below 64, so nothing saturates).
    unsafe fn pair_products(c: Self::I, a: *const i8) -> Self::I;
    /// Adds the i16 halves of the lanes.
    unsafe fn add16(a: Self::I, b: Self::I) -> Self::I;
    /// Every lane's two i16 halves summed, as an i32 lane (`vpmaddwd` by ones).
    unsafe fn widen16(a: Self::I) -> Self::I;
    /// `scale · Σ_v Σ_k codes[v]_k · a[4v + k]` per lane, `scale` in [`Isa::scale_form`].
    /// Without VNNI the products of `run` consecutive code vectors are summed in i16 before
    /// the scale widens them ([`k_run`]: as many as keep the sums exact).
    unsafe fn dot_codes_scaled(
        codes: &[Self::I],
        a: *const i8,
        scale: Self::I,
        run: usize,
    ) -> Self::I;
    /// A group scale's form for [`Isa::dot_codes_scaled`], from the byte at index `k` of
    /// every lane of `bytes` (sign-extended when `signed`).
    unsafe fn scale_form(bytes: Self::I, k: u32, signed: bool) -> Self::I;
    /// `acc + p_lo·s_lo + p_hi·s_hi` per lane: `pairs` holds two i16 per lane, `s` points at
    /// two i16 (broadcast).
    unsafe fn madd_pairs(acc: Self::I, pairs: Self::I, s: *const i16) -> Self::I;
    /// `acc + Σ_k q_k·a_k` per lane for signed 8-bit weights `q` (`abs_q = |q|`), without
    /// VNNI.
    unsafe fn dot4_signed(acc: Self::I, abs_q: Self::I, q: Self::I, a: *const i8) -> Self::I;
    /// `|q|` per byte.
    unsafe fn abs8(q: Self::I) -> Self::I;
    /// `LANES` consecutive 32-bit words at `p` (unaligned).
    unsafe fn loadu(p: *const u8) -> Self::I;
    /// `LANES` consecutive binary16 values at `p`, as f32 (exact).
    unsafe fn load_f16(p: *const u8) -> Self::F;

    unsafe fn fzero() -> Self::F;
    unsafe fn fsplat(v: f32) -> Self::F;
    unsafe fn fadd(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn fsub(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn fmul(a: Self::F, b: Self::F) -> Self::F;
    /// i32 lanes to f32 (round to nearest even, as `as f32`).
    unsafe fn cvt(a: Self::I) -> Self::F;
    /// The binary16 in the low 16 bits of every lane, as f32 (exact).
    unsafe fn f16_low(a: Self::I) -> Self::F;
    unsafe fn fload(p: *const Self::F) -> Self::F;
    unsafe fn fstore(p: *mut Self::F, v: Self::F);
    /// Stores `LANES` floats at `p` (unaligned).
    unsafe fn fstore_out(p: *mut f32, v: Self::F);
}

/// Defines the `#[target_feature]` entry points of one ISA: `$small` for the 32-element
/// formats and `$k` for the k-quants, each dispatching `$dtype` to [`rect`].
macro_rules! lane_entries {
    ($isa:ty, $features:literal, $small:ident, $k:ident) => {
        /// Rectangle of a 32-element-format matmul (contract as `lanes::rect`).
        ///
        /// # Safety
        /// The CPU has the features above; otherwise as for `lanes::rect`.
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        pub(crate) unsafe fn $small(
            dtype: $crate::quant::GgmlType,
            data: &[u8],
            row_bytes: usize,
            interleaved: bool,
            act: &$crate::quant::activation::ActBlocks<'_>,
            rows: std::ops::Range<usize>,
            tokens: std::ops::Range<usize>,
            out: $crate::quant::kernel::OutPtr,
        ) {
            use $crate::quant::lanes::{rect, Small};
            // SAFETY: forwarded to the caller; the kernels' features are enabled here.
            unsafe {
                use $crate::quant::lanes::{NARROW, PAIRS, PLANES};
                use $crate::quant::lanes::Isa as _;
                // Q8_0 without VNNI dots a refined input's codes as i16 pairs when it has them
                // (two instances only: the other formats gain nothing from it).
                if dtype == $crate::quant::GgmlType::Q8_0 && !<$isa>::VNNI && act.has_pairs() {
                    type F = $crate::quant::format::Q80;
                    return if interleaved {
                        rect::<$isa, Small<F, PAIRS>, true>(data, row_bytes, act, rows, tokens, out)
                    } else {
                        rect::<$isa, Small<F, PAIRS>, false>(data, row_bytes, act, rows, tokens, out)
                    };
                }
                $crate::quant::format::with_small_format!(dtype, F => match (interleaved, act.is_wide()) {
                    (true, true) => rect::<$isa, Small<F, PLANES>, true>(data, row_bytes, act, rows, tokens, out),
                    (true, false) => rect::<$isa, Small<F, NARROW>, true>(data, row_bytes, act, rows, tokens, out),
                    (false, true) => rect::<$isa, Small<F, PLANES>, false>(data, row_bytes, act, rows, tokens, out),
                    (false, false) => rect::<$isa, Small<F, NARROW>, false>(data, row_bytes, act, rows, tokens, out),
                })
            }
        }

        /// Rectangle of a k-quant matmul (contract as `lanes::rect`).
        ///
        /// # Safety
        /// As for the 32-element entry above.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $k(
            dtype: $crate::quant::GgmlType,
            data: &[u8],
            row_bytes: usize,
            act: &$crate::quant::activation::SuperActBlocks<'_>,
            rows: std::ops::Range<usize>,
            tokens: std::ops::Range<usize>,
            out: $crate::quant::kernel::OutPtr,
        ) {
            use $crate::quant::lanes::{rect, Super};
            // SAFETY: forwarded to the caller; the kernels' features are enabled here.
            unsafe {
                $crate::quant::kquant::with_k_format!(dtype, F => rect::<$isa, Super<F>, false>(
                    data, row_bytes, act, rows, tokens, out
                ))
            }
        }
    };
}
pub(crate) use lane_entries;

/// Bytes of the unpacked-block buffer (a column chunk of one row group: within L1).
const BUFFER_BYTES: usize = 20 * 1024;
/// Tokens per pass over a row group (their accumulators live in a stack array between
/// column chunks).
const TOKEN_CHUNK: usize = 64;
/// Up to this many TILEs of tokens run as direct passes (no unpacked-block buffer).
const DIRECT_PASSES: usize = 4;

#[repr(C, align(64))]
struct Aligned<const N: usize>([u8; N]);

/// A weight format the lane kernels compute: how a block of `LANES` rows unpacks into the
/// buffer, and how a tile of tokens consumes it.
pub(crate) trait LaneFormat<S: Isa> {
    /// The activation blocks this format multiplies.
    type Act<'a>;
    /// Bytes per block of one row.
    const BLOCK_BYTES: usize;
    /// Vectors one unpacked block takes in the buffer.
    const SLOTS: usize;

    /// Unpacks block `blk` (of row 0; row `i` at `blk + i·row_bytes`) into `out[..SLOTS]`.
    /// Interleaved (`IL`): `blk` is the group's block and `row_bytes` the first row's lane
    /// within the group (`interleave`).
    unsafe fn unpack<const IL: bool>(blk: *const u8, row_bytes: usize, out: *mut S::I);

    /// `acc[t] = acc[t] + term_b(t)` for tokens `t0..t0+T` and block `b` at `blk`, unpacked
    /// and consumed at once; by default through `buf` (one block's slots).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn direct_block<const T: usize, const IL: bool>(
        blk: *const u8,
        row_bytes: usize,
        buf: *mut S::I,
        b: usize,
        act: &Self::Act<'_>,
        t0: usize,
        acc: &mut [S::F; T],
    ) {
        // SAFETY: forwarded to the caller.
        unsafe {
            Self::unpack::<IL>(blk, row_bytes, buf);
            Self::tile::<T>(buf, b..b + 1, act, t0, acc)
        }
    }

    /// `acc[t] = acc[t] + term_b(t)` for tokens `t0..t0+T` and blocks `blocks` in order;
    /// block `b` is unpacked at `buf + (b − blocks.start)·SLOTS`.
    unsafe fn tile<const T: usize>(
        buf: *const S::I,
        blocks: Range<usize>,
        act: &Self::Act<'_>,
        t0: usize,
        acc: &mut [S::F; T],
    );

    /// The scalar kernel, for the rows that do not fill a vector (in ggml row layout: past
    /// the last whole interleaved group).
    unsafe fn scalar_rect(
        data: &[u8],
        row_bytes: usize,
        act: &Self::Act<'_>,
        rows: Range<usize>,
        tokens: Range<usize>,
        out: OutPtr,
    );
}

/// Computes `out[t, r]` for `r` in `rows`, `t` in `tokens` with ISA `S` and format `F`.
///
/// # Safety
/// The CPU supports `S`; `data` holds whole rows of `row_bytes` for every row in `rows`;
/// `act` holds every token in `tokens`; `out` is valid and exclusively owned for the
/// rectangle `rows × tokens`.
#[inline(always)]
pub(crate) unsafe fn rect<S: Isa, F: LaneFormat<S>, const IL: bool>(
    data: &[u8],
    row_bytes: usize,
    act: &F::Act<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    let nb = row_bytes / F::BLOCK_BYTES;
    // Interleaved: the SIMD rows end with the last whole group (the rest is in row layout);
    // a block of a group spans GROUP rows.
    let simd_rows = if IL {
        let groups_end = data.len() / row_bytes / GROUP * GROUP;
        rows.start..rows.end.min(groups_end).max(rows.start)
    } else {
        rows.clone()
    };
    let block_stride = if IL {
        GROUP * F::BLOCK_BYTES
    } else {
        F::BLOCK_BYTES
    };
    let span = if IL { GROUP } else { S::LANES } * F::BLOCK_BYTES;
    let vector_bytes = S::LANES * 4;
    let chunk_blocks = (BUFFER_BYTES / (F::SLOTS * vector_bytes)).clamp(1, nb);
    // Uninitialised: a slot is read only after `unpack` (or a tile) has written it.
    let mut buffer = MaybeUninit::<Aligned<BUFFER_BYTES>>::uninit();
    let buf = buffer.as_mut_ptr() as *mut S::I;
    assert!(chunk_blocks * F::SLOTS * vector_bytes <= BUFFER_BYTES);
    let mut partial = MaybeUninit::<Aligned<{ TOKEN_CHUNK * 64 }>>::uninit();
    let partial = partial.as_mut_ptr() as *mut S::F;
    let simd_end = simd_rows.start + simd_rows.len() / S::LANES * S::LANES;
    assert!(!IL || (rows.start.is_multiple_of(GROUP) && S::LANES <= GROUP));
    for r in (rows.start..simd_end).step_by(S::LANES) {
        super::side::claim_group(nb);
        // Row layout: row r's blocks, row i at `+ i·row_bytes`. Interleaved: r's group and
        // r's lane in it (passed where the row stride goes).
        let (first_row, lane_arg) = if IL {
            (r / GROUP * GROUP, r % GROUP)
        } else {
            (r, row_bytes)
        };
        // SAFETY: rows r..r+LANES are inside the caller's rectangle and inside `data`.
        let w = unsafe { data.as_ptr().add(first_row * row_bytes) };
        // The hardware prefetchers see LANES interleaved row streams too late: while a group
        // unpacks its blocks it prefetches the same blocks of the next group.
        let next = (r + 2 * S::LANES <= simd_end).then(|| {
            let next_first = if IL {
                (r + S::LANES) / GROUP * GROUP
            } else {
                r + S::LANES
            };
            data.as_ptr().wrapping_add(next_first * row_bytes)
        });
        if tokens.len() <= DIRECT_PASSES * S::TILE {
            // Few tokens: each block is unpacked and consumed at once (the compiler keeps it in
            // registers), the accumulators stay in registers across all blocks, one pass per
            // TILE tokens. Every count up to TILE has its own pass, so the weights are unpacked
            // once per pass whatever the number of tokens (a batch of 3, 5, 6 or 7 streams
            // would otherwise unpack them two or three times). A second pass re-reads the
            // group's blocks from L1/L2, which costs less than the unpacked-block buffer's
            // stores and loads (16 tokens: ~10% faster).
            for t in tokens.clone().step_by(S::TILE) {
                let n = (tokens.end - t).min(S::TILE);
                // Only the first pass prefetches: the next group is then on its way.
                let next = if t == tokens.start { next } else { None };
                // SAFETY: as below, the pass covering tokens t..t + n.
                unsafe {
                    let (o, s) = (out.at(t, r), out.stride);
                    let d = (w, next, lane_arg, nb, buf, act, t, o, s, block_stride, span);
                    match n {
                        8.. if S::TILE >= 8 => direct::<S, F, 8, IL>(d),
                        7 if S::TILE >= 8 => direct::<S, F, 7, IL>(d),
                        6 if S::TILE >= 8 => direct::<S, F, 6, IL>(d),
                        5 if S::TILE >= 8 => direct::<S, F, 5, IL>(d),
                        4.. => direct::<S, F, 4, IL>(d),
                        3 => direct::<S, F, 3, IL>(d),
                        2 => direct::<S, F, 2, IL>(d),
                        _ => direct::<S, F, 1, IL>(d),
                    };
                }
            }
            continue;
        }
        for chunk_start in tokens.clone().step_by(TOKEN_CHUNK) {
            let chunk_end = (chunk_start + TOKEN_CHUNK).min(tokens.end);
            for c0 in (0..nb).step_by(chunk_blocks) {
                let c1 = (c0 + chunk_blocks).min(nb);
                for b in c0..c1 {
                    // SAFETY: block b of the LANES rows is inside `data`; the buffer holds
                    // `chunk_blocks` unpacked blocks (asserted above).
                    unsafe {
                        let blk = w.add(b * block_stride);
                        if let (Some(next), true) = (next, chunk_start == tokens.start) {
                            prefetch_slice(next, b, span);
                        }
                        super::side::issue_block();
                        F::unpack::<IL>(blk, lane_arg, buf.add((b - c0) * F::SLOTS));
                    }
                }
                let (first, last) = (c0 == 0, c1 == nb);
                let mut t = chunk_start;
                while t < chunk_end {
                    // SAFETY: tokens t..t+T are inside the caller's rectangle and `act`;
                    // `partial` holds TOKEN_CHUNK vectors; `out` rows r..r+LANES at those
                    // tokens are owned by the caller.
                    unsafe {
                        let p = partial.add(t - chunk_start);
                        let o = out.at(t, r);
                        t += match chunk_end - t {
                            8.. if S::TILE >= 8 => run_tile::<S, F, 8>(
                                buf,
                                c0..c1,
                                act,
                                t,
                                p,
                                first,
                                last,
                                o,
                                out.stride,
                            ),
                            4.. => run_tile::<S, F, 4>(
                                buf,
                                c0..c1,
                                act,
                                t,
                                p,
                                first,
                                last,
                                o,
                                out.stride,
                            ),
                            2.. => run_tile::<S, F, 2>(
                                buf,
                                c0..c1,
                                act,
                                t,
                                p,
                                first,
                                last,
                                o,
                                out.stride,
                            ),
                            _ => run_tile::<S, F, 1>(
                                buf,
                                c0..c1,
                                act,
                                t,
                                p,
                                first,
                                last,
                                o,
                                out.stride,
                            ),
                        };
                    }
                }
            }
        }
    }
    if simd_end < rows.end {
        // Interleaved: these rows are past the last whole group, in row layout.
        debug_assert!(!IL || simd_end >= data.len() / row_bytes / GROUP * GROUP);
        // SAFETY: forwarded to the caller.
        unsafe { F::scalar_rect(data, row_bytes, act, simd_end..rows.end, tokens, out) };
    }
}

/// The arguments of [`direct`]: the row group `w`, the next one (to prefetch), `row_bytes`
/// (interleaved: the lane in the group), blocks per row, the one-block buffer, the
/// activations, the first token, the output of (first token, first row), the output's token
/// stride, the bytes from one block of the group to the next and the prefetch span.
type DirectArgs<'a, 'b, S, F> = (
    *const u8,
    Option<*const u8>,
    usize,
    usize,
    *mut <S as Isa>::I,
    &'a <F as LaneFormat<S>>::Act<'b>,
    usize,
    *mut f32,
    usize,
    usize,
    usize,
);

/// All blocks of one row group for a single tile of `T` tokens: unpack a block, consume it.
///
/// # Safety
/// As for [`rect`]: `w` is the row group, `buf` holds one unpacked block, tokens
/// `t0..t0 + T` exist, `out` is owned for LANES floats at T token strides.
#[inline(always)]
unsafe fn direct<S: Isa, F: LaneFormat<S>, const T: usize, const IL: bool>(
    args: DirectArgs<'_, '_, S, F>,
) {
    let (w, next, row_bytes, nb, buf, act, t0, out, out_stride, block_stride, span) = args;
    // SAFETY: forwarded to the caller.
    unsafe {
        let mut acc = [S::fzero(); T];
        for b in 0..nb {
            if let Some(next) = next {
                prefetch_slice(next, b, span);
            }
            super::side::issue_block();
            F::direct_block::<T, IL>(
                w.add(b * block_stride),
                row_bytes,
                buf,
                b,
                act,
                t0,
                &mut acc,
            );
        }
        for (t, a) in acc.into_iter().enumerate() {
            S::fstore_out(out.add(t * out_stride), a);
        }
    }
}

/// One tile of `T` tokens over a column chunk: accumulators start at zero (first chunk) or
/// from `partial`, and go to `out` (last chunk) or back to `partial`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn run_tile<S: Isa, F: LaneFormat<S>, const T: usize>(
    buf: *const S::I,
    blocks: Range<usize>,
    act: &F::Act<'_>,
    t0: usize,
    partial: *mut S::F,
    first: bool,
    last: bool,
    out: *mut f32,
    out_stride: usize,
) -> usize {
    // SAFETY: `partial` holds T vectors and `out` LANES floats at T token strides (caller).
    unsafe {
        let mut acc = [S::fzero(); T];
        if !first {
            for (t, a) in acc.iter_mut().enumerate() {
                *a = S::fload(partial.add(t));
            }
        }
        F::tile::<T>(buf, blocks, act, t0, &mut acc);
        for (t, a) in acc.into_iter().enumerate() {
            if last {
                S::fstore_out(out.add(t * out_stride), a);
            } else {
                S::fstore(partial.add(t), a);
            }
        }
    }
    T
}

/// Prefetches slice `b` (of `span` bytes) of the next row group, one block's share of it,
/// into L2: a k-quant block's share is dozens of lines, and prefetches into L1 would stall
/// on its few miss buffers. The few lines of a 32-element block go to L2 too: into L1 they
/// streamed Q8_0 weights ~25% slower at one token (Q4_0/Q4_1 within the noise).
#[inline(always)]
pub(crate) unsafe fn prefetch_slice(next: *const u8, b: usize, span: usize) {
    let from = next.wrapping_add(b * span);
    for off in (0..span).step_by(64).chain([span - 1]) {
        // SAFETY: prefetches never fault; `wrapping_add` keeps the address computation
        // defined even past the end of `data`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(from.wrapping_add(off) as *const i8) };
    }
}

/// Low (`x & 0xf`) and high (`x >> 4`) nibbles of every byte.
#[inline(always)]
unsafe fn nibbles<S: Isa>(x: S::I) -> (S::I, S::I) {
    // SAFETY: plain vector arithmetic (caller's features).
    unsafe {
        let mask = S::splat(0x0f0f_0f0f);
        (S::and(x, mask), S::and(S::srl32(x, 4), mask))
    }
}

/// `x | (bit << shift)` where `bit` is `(bits >> bit_shift) & 1` per byte of the lane.
#[inline(always)]
unsafe fn or_bit<S: Isa>(x: S::I, bits: S::I, bit_shift: u32, shift: u32) -> S::I {
    // SAFETY: plain vector arithmetic (caller's features).
    unsafe {
        let b = S::and(S::srl32(bits, bit_shift), S::splat(0x0101_0101));
        S::or(x, S::sll32(b, shift))
    }
}

// ---- 32-element formats ------------------------------------------------------------------

/// How a 32-element kernel reads the activation codes ([`Small`]'s `CODES`): 8-bit codes.
pub(crate) const NARROW: u8 = 0;
/// A refined input's 16-bit codes as two byte planes (`256·Σ u·hi + Σ u·lo`).
pub(crate) const PLANES: u8 = 1;
/// A refined input's 16-bit codes as i16 pairs (`ActBlocks::pairs`), dotted by `vpmaddwd`
/// with the weights widened to i16: `Q8_0` without VNNI only, where the byte planes cost
/// twice the sign-trick multiplies (`Q8_0`'s codes are signed, so `vpmaddubsw` needs
/// `vpsignb` and a `vpmaddwd` per plane).
pub(crate) const PAIRS: u8 = 2;

/// Whether format `F` runs `Q8_0`'s signed path on ISA `S` (no VNNI: `maddubs` needs the
/// sign trick; with VNNI the codes are `q + 128` and the zero point removes the 128).
const fn signed_path<S: Isa, F: BlockFormat>() -> bool {
    !F::NIBBLES && !S::VNNI
}

/// Buffer slots of a 32-element block: 8 code vectors (element order), for the signed path 8
/// more (the signed codes, next to their magnitudes), then `d` and `m` as f32.
const fn small_slots<S: Isa, F: BlockFormat>() -> usize {
    if signed_path::<S, F>() {
        18
    } else {
        10
    }
}

/// One unpacked 32-element block of `LANES` rows.
struct SmallBlock<S: Isa> {
    /// Code vector `v` holds elements `4v..4v+4` (the magnitudes on the signed path; with
    /// `PAIRS`, elements `4v` and `4v+2` as i16s).
    codes: [S::I; 8],
    /// The signed codes (signed path only; with `PAIRS`, elements `4v+1` and `4v+3` as i16s).
    signed: [S::I; 8],
    dw: S::F,
    m: S::F,
}

impl<S: Isa> SmallBlock<S> {
    #[inline(always)]
    unsafe fn store<F: BlockFormat>(&self, out: *mut S::I) {
        let slots = small_slots::<S, F>();
        // SAFETY: `out` holds the block's slots (caller).
        unsafe {
            for (v, &c) in self.codes.iter().enumerate() {
                S::store(out.add(v), c);
            }
            if signed_path::<S, F>() {
                for (v, &q) in self.signed.iter().enumerate() {
                    S::store(out.add(8 + v), q);
                }
            }
            S::store(out.add(slots - 2), f_bits::<S>(self.dw));
            S::store(out.add(slots - 1), f_bits::<S>(self.m));
        }
    }

    #[inline(always)]
    unsafe fn load<F: BlockFormat>(base: *const S::I) -> Self {
        let slots = small_slots::<S, F>();
        // SAFETY: `base` holds the block's slots (caller).
        unsafe {
            let mut blk = Self {
                codes: [S::zero(); 8],
                signed: [S::zero(); 8],
                dw: S::fload(base.add(slots - 2) as *const S::F),
                m: S::fload(base.add(slots - 1) as *const S::F),
            };
            for v in 0..8 {
                blk.codes[v] = S::load(base.add(v));
                if signed_path::<S, F>() {
                    blk.signed[v] = S::load(base.add(8 + v));
                }
            }
            blk
        }
    }
}

/// Unpacks a 32-element block of `LANES` rows.
#[inline(always)]
unsafe fn unpack_small<S: Isa, F: BlockFormat, const CODES: u8>(
    blk: *const u8,
    row_bytes: usize,
) -> SmallBlock<S> {
    // SAFETY: the block of every row is readable (caller).
    unsafe {
        let head = S::rows_x16(blk, row_bytes);
        let dm = head[0];
        let mut out = SmallBlock {
            codes: [S::zero(); 8],
            signed: [S::zero(); 8],
            dw: S::f16_low(dm),
            m: S::f16_low(S::srl32(dm, 16)),
        };
        if !F::NIBBLES {
            // 32 signed bytes: words 0..3 from bytes 2..18, 4..7 from 18..34.
            let q = words::<S, 8>(blk.add(2), row_bytes);
            for (v, &qv) in q.iter().enumerate() {
                q8_code_vectors::<S, F, CODES>(&mut out, v, qv);
            }
            return out;
        }
        let qs = S::rows_x16(blk.add(F::QS_OFFSET), row_bytes);
        // The 32 high bits of Q5: bytes 2..6 (Q5_0) or 4..8 (Q5_1) of the block.
        let qh = match F::QH_OFFSET {
            Some(2) => S::or(S::srl32(head[0], 16), S::sll32(head[1], 16)),
            Some(_) => head[1],
            None => S::zero(),
        };
        for (j, &q) in qs.iter().enumerate() {
            let (mut low, mut high) = nibbles::<S>(q);
            if F::QH_OFFSET.is_some() {
                // Element e's 5th bit is bit e of qh: the low nibbles of word j are elements
                // 4j..4j+4 (qh byte j/2, bits 4(j%2)..), the high ones 16+4j.. (byte 2 + j/2).
                let mask = S::splat((0x0804_0201u32 << (4 * (j as u32 % 2))) as i32);
                low = S::or(low, fifth_bits::<S>(qh, j as u32 / 2, mask));
                high = S::or(high, fifth_bits::<S>(qh, 2 + j as u32 / 2, mask));
            }
            out.codes[j] = low;
            out.codes[4 + j] = high;
        }
        out
    }
}

/// Unpacks a 32-element block of `LANES` rows from an interleaved group block `g`
/// (`interleave`), the rows starting at lane `lane` of the group: plain vector loads, then
/// the same code arithmetic as [`unpack_small`].
#[inline(always)]
unsafe fn unpack_small_interleaved<S: Isa, F: BlockFormat, const CODES: u8>(
    g: *const u8,
    lane: usize,
) -> SmallBlock<S> {
    const G: usize = GROUP;
    let m_at = 2 * G;
    let qh_at = m_at + if F::HAS_MIN { 2 * G } else { 0 };
    let qs_at = qh_at + if F::QH_OFFSET.is_some() { 4 * G } else { 0 };
    // SAFETY: the group block holds every field of GROUP rows, and lane + LANES ≤ GROUP
    // (caller).
    unsafe {
        let mut out = SmallBlock {
            codes: [S::zero(); 8],
            signed: [S::zero(); 8],
            dw: S::load_f16(g.add(2 * lane)),
            m: if F::HAS_MIN {
                S::load_f16(g.add(m_at + 2 * lane))
            } else {
                S::fzero()
            },
        };
        // Word k of the codes: row `lane`'s four bytes of its k-th group of 16 words.
        let word = |k: usize| g.add(qs_at + 4 * (G * k + lane));
        if !F::NIBBLES {
            for v in 0..8 {
                q8_code_vectors::<S, F, CODES>(&mut out, v, S::loadu(word(v)));
            }
            return out;
        }
        // The fifth bits in the interleaved order (`interleave::spread_qh`): code vector v's
        // are bits v, 8 + v, 16 + v, 24 + v, so one shift puts them at bit 4 of each byte.
        let qh = if F::QH_OFFSET.is_some() {
            S::loadu(g.add(qh_at + 4 * lane))
        } else {
            S::zero()
        };
        for j in 0..4 {
            let (mut low, mut high) = nibbles::<S>(S::loadu(word(j)));
            if F::QH_OFFSET.is_some() {
                low = S::or(low, fifth_bit::<S>(qh, j as u32));
                high = S::or(high, fifth_bit::<S>(qh, 4 + j as u32));
            }
            out.codes[j] = low;
            out.codes[4 + j] = high;
        }
        out
    }
}

/// Stores `Q8_0`'s code word vector `qv` (elements `4v..4v+4`) in the form the kernel dots:
/// the magnitudes and the signed codes (the signed path), the two i16 pairs (`PAIRS`), or
/// the codes offset by 128 (VNNI's unsigned bytes; the zero point takes the 128 back).
#[inline(always)]
unsafe fn q8_code_vectors<S: Isa, F: BlockFormat, const CODES: u8>(
    out: &mut SmallBlock<S>,
    v: usize,
    qv: S::I,
) {
    // SAFETY: plain vector arithmetic (caller's features).
    unsafe {
        if CODES == PAIRS {
            // Bytes (q0, q1, q2, q3) of a lane: (q0, q2) and (q1, q3), each sign-extended.
            out.codes[v] = S::sra16(S::sll32(qv, 8), 8);
            out.signed[v] = S::sra16(qv, 8);
        } else if signed_path::<S, F>() {
            out.codes[v] = S::abs8(qv);
            out.signed[v] = qv;
        } else {
            out.codes[v] = S::sub8(qv, S::splat(0x8080_8080u32 as i32));
        }
    }
}

/// Code vector `v`'s fifth bits in the interleaved order (bits v, 8 + v, 16 + v, 24 + v of
/// each lane of `qh`), moved to bit 4 of each byte by one shift.
#[inline(always)]
unsafe fn fifth_bit<S: Isa>(qh: S::I, v: u32) -> S::I {
    // SAFETY: plain vector arithmetic (caller's features).
    unsafe {
        let at_bit4 = match v {
            0..4 => S::sll32(qh, 4 - v),
            4 => qh,
            _ => S::srl32(qh, v - 4),
        };
        S::and(at_bit4, S::splat(0x1010_1010))
    }
}

/// `0x10` in byte `k` of every lane where byte `byte` of `qh` has bit `mask_k` set.
#[inline(always)]
unsafe fn fifth_bits<S: Isa>(qh: S::I, byte: u32, mask: S::I) -> S::I {
    // SAFETY: plain vector arithmetic (caller's features).
    unsafe {
        let spread = S::dword_bytes(qh, byte * 0x0101_0101);
        S::sll32(S::bits_to_ones(spread, mask), 4)
    }
}

/// `isum[t] −= zero_point·Σa(t)` for block index `i0 + t·step`. The zero points are powers
/// of two, so a shift of the broadcast sum (no scalar multiply, no move from a general
/// register).
///
/// # Safety
/// Every `i0 + t·step` indexes `act.qsum`.
#[inline(always)]
unsafe fn zero_point_terms<S: Isa, const T: usize>(
    isum: &mut [S::I; T],
    act: &ActBlocks<'_>,
    i0: usize,
    step: usize,
    zero_point: i32,
) {
    if zero_point != 0 {
        debug_assert!(zero_point.count_ones() == 1);
        let shift = zero_point.trailing_zeros();
        for (t, s) in isum.iter_mut().enumerate() {
            // SAFETY: forwarded to the caller.
            unsafe {
                let qsum = S::splat_load(act.qsum.as_ptr().add(i0 + t * step));
                *s = S::sub32(*s, S::sll32(qsum, shift));
            }
        }
    }
}

/// Block `b`'s terms for tokens `t0..t0+T`: `isum` from the codes, then
/// `term = (dw·da)·isum (+ m·s)` and `acc = acc + term`.
///
/// `isum` includes `−zero_point·Σa`, added first or (i16 sums, wide codes) last: exact
/// integers either way, the same value as subtracting the offset from every code. With wide
/// codes as byte planes ([`PLANES`]: a refined input, `a = 256·hi + lo`) the high plane's
/// sums, shifted left by 8, start the low plane's: `isum = 256·Σ u·hi + Σ u·lo −
/// zero_point·Σa`, exact in an i32. As i16 pairs ([`PAIRS`]) `isum = Σ q·a` directly: the same
/// integer, so the same bits.
#[inline(always)]
unsafe fn small_terms<S: Isa, F: BlockFormat, const T: usize, const CODES: u8>(
    blk: &SmallBlock<S>,
    b: usize,
    act: &ActBlocks<'_>,
    t0: usize,
    acc: &mut [S::F; T],
) {
    let zero_point = if F::NIBBLES {
        F::ZERO
    } else if signed_path::<S, F>() {
        0
    } else {
        128
    };
    // SAFETY: every activation index is below n_tokens · blocks_per_token (caller).
    unsafe {
        let i0 = act.index(t0, b);
        let step = act.blocks_per_token;
        let wide = CODES != NARROW;
        debug_assert!(CODES != PAIRS || signed_path::<S, F>());
        // The zero point joins first where the products go straight into i32 sums.
        let zero_point_first = !wide && !i16_sums::<S, F>();
        if token_outer::<S, T, CODES>() {
            // One token at a time: its two planes' chains, then its term. Only one token's
            // sums are live, so a tile's accumulators and the block's codes stay in registers
            // (token-inner, 2·T sums beside them spill at T = 8); the out-of-order core
            // overlaps one token's chains with the next one's.
            for (t, acc) in acc.iter_mut().enumerate() {
                let i = i0 + t * step;
                let (hi, lo) = (act.qs.as_ptr().add(i * QK), act.lo.as_ptr().add(i * QK));
                let hi = plane_dots::<S, F, 1>(blk, hi, 0, [S::zero()], 2)[0];
                let lo = plane_dots::<S, F, 1>(blk, lo, 0, [S::zero()], 2)[0];
                let mut isum = [S::add32(S::sll32(hi, 8), lo)];
                zero_point_terms::<S, 1>(&mut isum, act, i, step, zero_point);
                add_term::<S, F>(acc, blk, act, i, isum[0]);
            }
            return;
        }
        let mut isum = [S::zero(); T];
        if zero_point_first {
            zero_point_terms::<S, T>(&mut isum, act, i0, step, zero_point);
        }
        if CODES == PAIRS {
            // Q8_0: no zero point.
            isum = pair_dots::<S, T>(blk, act.pairs.as_ptr().add(i0 * QK), step * QK);
        } else if CODES == PLANES {
            // The two planes as independent sums, combined after: each is a shorter
            // dependency chain, and they overlap (the high plane's shift in the middle of one
            // chain serialized them). The same integer: 256·Σ u·hi + Σ u·lo.
            let chains = plane_chains::<T>(2);
            let hi =
                plane_dots::<S, F, T>(blk, act.qs.as_ptr().add(i0 * QK), step * QK, isum, chains);
            let lo = plane_dots::<S, F, T>(
                blk,
                act.lo.as_ptr().add(i0 * QK),
                step * QK,
                [S::zero(); T],
                chains,
            );
            for (s, (&hi, &lo)) in isum.iter_mut().zip(hi.iter().zip(&lo)) {
                *s = S::add32(S::sll32(hi, 8), lo);
            }
        } else {
            isum = plane_dots::<S, F, T>(
                blk,
                act.qs.as_ptr().add(i0 * QK),
                step * QK,
                isum,
                plane_chains::<T>(1),
            );
        }
        if !zero_point_first {
            zero_point_terms::<S, T>(&mut isum, act, i0, step, zero_point);
        }
        for (t, (acc, &isum)) in acc.iter_mut().zip(&isum).enumerate() {
            add_term::<S, F>(acc, blk, act, i0 + t * step, isum);
        }
    }
}

/// Whether [`small_terms`] runs token by token: wide codes at 4 tokens or more with VNNI,
/// where token-inner chains would hold two sums per token.
const fn token_outer<S: Isa, const T: usize, const CODES: u8>() -> bool {
    S::VNNI && CODES == PLANES && T >= 4
}

/// `acc = acc + (dw·da)·isum (+ m·s)` for activation block `i`: the canonical term.
///
/// # Safety
/// `i` indexes `act.scale` (and `act.scaled_sum`).
#[inline(always)]
unsafe fn add_term<S: Isa, F: BlockFormat>(
    acc: &mut S::F,
    blk: &SmallBlock<S>,
    act: &ActBlocks<'_>,
    i: usize,
    isum: S::I,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        let da = S::fsplat(*act.scale.get_unchecked(i));
        let mut term = S::fmul(S::fmul(blk.dw, da), S::cvt(isum));
        if F::HAS_MIN {
            let s = S::fsplat(*act.scaled_sum.get_unchecked(i));
            term = S::fadd(term, S::fmul(blk.m, s));
        }
        *acc = S::fadd(*acc, term);
    }
}

/// Whether format `F` sums its products in i16 on ISA `S` (without VNNI every product pair
/// needs a `vpmaddwd` to widen it to i32; nibble codes are small enough to sum in i16 first).
const fn i16_sums<S: Isa, F: BlockFormat>() -> bool {
    !S::VNNI && F::NIBBLES
}

/// Dependency chains per token for a block's `vpdpbusd` with `planes` byte planes per token
/// (`plane_dots`): enough independent sums in flight to cover the instruction's latency
/// (about 8 at two per cycle), without adding more partial sums than that needs.
#[inline(always)]
const fn plane_chains<const T: usize>(planes: usize) -> usize {
    match T * planes {
        0..=2 => 4,
        3..=6 => 2,
        _ => 1,
    }
}

/// `init[t] + Σ u·a(t)` over one block for tokens `t0..t0+T`, whose activation bytes start at
/// `a0` (token `t` at `a0 + t·stride`), without the zero point.
///
/// The loops run code pair by code pair with the tokens innermost: each token's sum is
/// `chains` dependency chains (1, 2 or 4; with VNNI: few tokens would otherwise wait on the
/// `vpdpbusd` latency; without it, two below 4 tokens), added at the end, and small bodies
/// with constant trip counts unroll fully, so the sums and the accumulators stay in registers
/// (a loop over whole tokens kept them on the stack).
///
/// # Safety
/// Every token's 32 bytes are readable.
#[inline(always)]
unsafe fn plane_dots<S: Isa, F: BlockFormat, const T: usize>(
    blk: &SmallBlock<S>,
    a0: *const i8,
    stride: usize,
    init: [S::I; T],
    chains: usize,
) -> [S::I; T] {
    let split = T < 4;
    // SAFETY: forwarded to the caller.
    unsafe {
        let a = |t: usize| a0.add(t * stride);
        let mut isum = init;
        let mut odd = [S::zero(); T];
        if signed_path::<S, F>() {
            for v in 0..8 {
                for t in 0..T {
                    let s = if split && v % 2 == 1 {
                        &mut odd[t]
                    } else {
                        &mut isum[t]
                    };
                    *s = S::dot4_signed(*s, blk.codes[v], blk.signed[v], a(t).add(4 * v));
                }
            }
        } else if i16_sums::<S, F>() {
            // |a| ≤ 128, so a half-lane holds 16 products of 4-bit codes (16·15·128 < 2¹⁵) or
            // 8 of 5-bit ones (8·31·128 < 2¹⁵): the sums stay exact. Only the i16 sums are
            // live in the loop (a tile's accumulators then stay in registers).
            let run = if F::QH_OFFSET.is_some() { 4 } else { 8 };
            let mut half = [S::zero(); T];
            let mut wide = [S::zero(); T];
            for (v, &codes) in blk.codes.iter().enumerate() {
                for (t, half) in half.iter_mut().enumerate() {
                    let p = S::pair_products(codes, a(t).add(4 * v));
                    *half = if v % run == 0 { p } else { S::add16(*half, p) };
                }
                if v % run == run - 1 {
                    for (wide, &half) in wide.iter_mut().zip(&half) {
                        *wide = if v < run {
                            S::widen16(half)
                        } else {
                            S::add32(*wide, S::widen16(half))
                        };
                    }
                }
            }
            for (s, &w) in isum.iter_mut().zip(&wide) {
                *s = S::add32(*s, w);
            }
            return isum;
        } else {
            // Chain c of token t: pairs k ≡ c (mod chains); chain 0 starts from `init`.
            debug_assert!(matches!(chains, 1 | 2 | 4));
            let mut part = [[S::zero(); T]; 3];
            for k in 0..4 {
                let (c0, c1) = (blk.codes[2 * k], blk.codes[2 * k + 1]);
                for t in 0..T {
                    let s = match k % chains {
                        0 => &mut isum[t],
                        c => &mut part[c - 1][t],
                    };
                    *s = S::dot_pair(*s, c0, c1, a(t).add(8 * k));
                }
            }
            for c in 1..chains {
                for (s, &p) in isum.iter_mut().zip(&part[c - 1]) {
                    *s = S::add32(*s, p);
                }
            }
            return isum;
        }
        if split {
            for (s, &o) in isum.iter_mut().zip(&odd) {
                *s = S::add32(*s, o);
            }
        }
        isum
    }
}

/// `Σ q·a` over one `Q8_0` block for tokens `t0..t0+T`, the codes unpacked as i16 pairs and
/// the activations' i16 pairs starting at `a0` (token `t` at `a0 + t·stride`): one
/// `vpmaddwd` per pair vector, two dependency chains per token below 4 tokens (as in
/// [`plane_dots`]).
///
/// # Safety
/// Every token's 32 i16s are readable.
#[inline(always)]
unsafe fn pair_dots<S: Isa, const T: usize>(
    blk: &SmallBlock<S>,
    a0: *const i16,
    stride: usize,
) -> [S::I; T] {
    let split = T < 4;
    // SAFETY: forwarded to the caller.
    unsafe {
        let mut even = [S::zero(); T];
        let mut odd = [S::zero(); T];
        for v in 0..8 {
            for t in 0..T {
                let a = a0.add(t * stride + 4 * v);
                even[t] = S::madd_pairs(even[t], blk.codes[v], a);
                let s = if split { &mut odd[t] } else { &mut even[t] };
                *s = S::madd_pairs(*s, blk.signed[v], a.add(2));
            }
        }
        if split {
            for (s, &o) in even.iter_mut().zip(&odd) {
                *s = S::add32(*s, o);
            }
        }
        even
    }
}

/// Reinterprets an f32 vector as an integer vector (for the buffer).
#[inline(always)]
unsafe fn f_bits<S: Isa>(v: S::F) -> S::I {
    // SAFETY: both are plain vectors of the same size (checked at compile time by the
    // transmute).
    unsafe { std::mem::transmute_copy(&v) }
}

/// A 32-element format as a lane format, for 8-bit activation codes ([`NARROW`]) or a
/// refined input's 16-bit ones ([`PLANES`], [`PAIRS`]).
pub(crate) struct Small<F, const CODES: u8>(std::marker::PhantomData<F>);

impl<S: Isa, F: BlockFormat, const CODES: u8> LaneFormat<S> for Small<F, CODES> {
    type Act<'a> = ActBlocks<'a>;
    const BLOCK_BYTES: usize = F::BLOCK_BYTES;
    const SLOTS: usize = small_slots::<S, F>();

    #[inline(always)]
    unsafe fn unpack<const IL: bool>(blk: *const u8, row_bytes: usize, out: *mut S::I) {
        // SAFETY: forwarded to the caller.
        unsafe {
            if IL {
                unpack_small_interleaved::<S, F, CODES>(blk, row_bytes).store::<F>(out)
            } else {
                unpack_small::<S, F, CODES>(blk, row_bytes).store::<F>(out)
            }
        }
    }

    /// In registers: a 32-element block is 10 vectors.
    #[inline(always)]
    unsafe fn direct_block<const T: usize, const IL: bool>(
        blk: *const u8,
        row_bytes: usize,
        _buf: *mut S::I,
        b: usize,
        act: &Self::Act<'_>,
        t0: usize,
        acc: &mut [S::F; T],
    ) {
        // SAFETY: forwarded to the caller; the block stays in registers.
        unsafe {
            let unpacked = if IL {
                unpack_small_interleaved::<S, F, CODES>(blk, row_bytes)
            } else {
                unpack_small::<S, F, CODES>(blk, row_bytes)
            };
            small_terms::<S, F, T, CODES>(&unpacked, b, act, t0, acc)
        }
    }

    #[inline(always)]
    unsafe fn tile<const T: usize>(
        buf: *const S::I,
        blocks: Range<usize>,
        act: &Self::Act<'_>,
        t0: usize,
        acc: &mut [S::F; T],
    ) {
        // SAFETY: the buffer holds every block of `blocks` (caller).
        unsafe {
            for (slot, b) in blocks.enumerate() {
                let unpacked = SmallBlock::<S>::load::<F>(buf.add(slot * small_slots::<S, F>()));
                small_terms::<S, F, T, CODES>(&unpacked, b, act, t0, acc);
            }
        }
    }

    unsafe fn scalar_rect(
        data: &[u8],
        row_bytes: usize,
        act: &Self::Act<'_>,
        rows: Range<usize>,
        tokens: Range<usize>,
        out: OutPtr,
    ) {
        // SAFETY: forwarded to the caller.
        unsafe { scalar::quant_rect::<F>(data, row_bytes, act, rows, tokens, out) }
    }
}

// ---- k-quants ----------------------------------------------------------------------------

/// Buffer layout of a k-quant super-block: 64 code vectors (element order), one scale
/// vector per group ([`Isa::scale_form`]), the i16 pairs of the min (or zero-point) term per
/// two groups, then `d` and `dmin` as f32.
const fn super_slots<F: SuperBlockFormat>() -> usize {
    64 + F::GROUPS + F::GROUPS / 2 + 2
}

/// Where the per-super-block pieces sit in the buffer.
struct SuperLayout;

impl SuperLayout {
    const CODES: usize = 0;
    const SCALES: usize = 64;
    const fn pairs<F: SuperBlockFormat>() -> usize {
        64 + F::GROUPS
    }
    const fn d<F: SuperBlockFormat>() -> usize {
        64 + F::GROUPS + F::GROUPS / 2
    }
}

/// The integer scale bytes of a super-block's groups, four per 32-bit lane: vector `g / 4`,
/// byte `g % 4` is group `g`'s scale (`signed`: an i8); likewise the mins (min formats) —
/// for the symmetric formats the pairs use the scales themselves (the zero-point term).
struct GroupBytes<S: Isa> {
    scales: [S::I; 4],
    mins: [S::I; 4],
    signed: bool,
}

impl<S: Isa> GroupBytes<S> {
    #[inline(always)]
    unsafe fn new(signed: bool) -> Self {
        // SAFETY: a zero vector (caller's features).
        let zero = unsafe { S::zero() };
        Self {
            scales: [zero; 4],
            mins: [zero; 4],
            signed,
        }
    }
}

/// Stores the group scales, the min/zero-point pairs, `d` and `dmin` of a super-block.
#[inline(always)]
unsafe fn store_super_params<S: Isa, F: SuperBlockFormat>(
    g: &GroupBytes<S>,
    d: S::F,
    dmin: S::F,
    out: *mut S::I,
) {
    // SAFETY: `out` holds the super-block's slots (caller).
    unsafe {
        for group in 0..F::GROUPS {
            let v = S::scale_form(g.scales[group / 4], group as u32 % 4, g.signed);
            S::store(out.add(SuperLayout::SCALES + group), v);
        }
        let pair_source = if F::HAS_MIN { &g.mins } else { &g.scales };
        let signed_pairs = !F::HAS_MIN && g.signed;
        for k in 0..F::GROUPS / 2 {
            let lo = 2 * (k as u32 % 2);
            let v = if signed_pairs {
                let bytes = S::dword_bytes(
                    pair_source[k / 2],
                    0x0080_0080 | (lo << 8) | ((lo + 1) << 24),
                );
                S::sra16(bytes, 8)
            } else {
                S::dword_bytes(pair_source[k / 2], 0x8000_8000 | lo | ((lo + 1) << 16))
            };
            S::store(out.add(SuperLayout::pairs::<F>() + k), v);
        }
        S::store(out.add(SuperLayout::d::<F>()), f_bits::<S>(d));
        S::store(out.add(SuperLayout::d::<F>() + 1), f_bits::<S>(dmin));
    }
}

/// `N` consecutive 32-bit words of every row from `p` (`N` a multiple of 4): lane `i` of
/// vector `k` is word `k` of row `i`.
#[inline(always)]
unsafe fn words<S: Isa, const N: usize>(p: *const u8, rs: usize) -> [S::I; N] {
    let mut w = [S::zero(); N];
    for k in (0..N).step_by(4) {
        // SAFETY: 4·N readable bytes at p + i·rs for every row (caller).
        let r = unsafe { S::rows_x16(p.add(4 * k), rs) };
        w[k..k + 4].copy_from_slice(&r);
    }
    w
}

/// `(x >> shift) & mask` per 32-bit lane.
#[inline(always)]
unsafe fn field<S: Isa>(x: S::I, shift: u32, mask: u32) -> S::I {
    // SAFETY: plain vector arithmetic (caller's features).
    unsafe { S::and(S::srl32(x, shift), S::splat(mask as i32)) }
}

/// Unpacks one k-quant super-block of `LANES` rows (code positions as in `kquant`; code
/// vector `v` covers elements `4v..4v+4`). Loops run over 8 words at a time with the
/// innermost over those 8, so the compiler keeps them in registers.
#[inline(always)]
unsafe fn unpack_super<S: Isa, F: SuperBlockFormat>(blk: *const u8, rs: usize, out: *mut S::I) {
    // SAFETY: every load reads inside the super-block of each row (every 16-byte window
    // starts at most BLOCK_BYTES − 16); `out` holds the super-block's slots (caller).
    unsafe {
        let codes = out.add(SuperLayout::CODES);
        match F::BLOCK_BYTES {
            // Q2_K: scales[16] (scale | min << 4), qs[64], d, dmin.
            84 => {
                for h in 0..2 {
                    let q = words::<S, 8>(blk.add(16 + 32 * h), rs);
                    for j in 0..4 {
                        for (l, &x) in q.iter().enumerate() {
                            let v = 32 * h + 8 * j + l;
                            S::store(codes.add(v), field::<S>(x, 2 * j as u32, 0x0303_0303));
                        }
                    }
                }
                let s = S::rows_x16(blk, rs);
                let mut g = GroupBytes::<S>::new(false);
                for (k, &x) in s.iter().enumerate() {
                    g.scales[k] = field::<S>(x, 0, 0x0f0f_0f0f);
                    g.mins[k] = field::<S>(x, 4, 0x0f0f_0f0f);
                }
                let tail = S::rows_x16(blk.add(68), rs)[3];
                let (d, dmin) = (S::f16_low(tail), S::f16_low(S::srl32(tail, 16)));
                store_super_params::<S, F>(&g, d, dmin, out);
            }
            // Q3_K: hmask[32], qs[64], scales[12] (6-bit, − 32), d.
            110 => {
                let hm = words::<S, 8>(blk, rs);
                for h in 0..2 {
                    let q = words::<S, 8>(blk.add(32 + 32 * h), rs);
                    for j in 0..4 {
                        for l in 0..8 {
                            let low = field::<S>(q[l], 2 * j as u32, 0x0303_0303);
                            let code = or_bit::<S>(low, hm[l], (4 * h + j) as u32, 2);
                            S::store(codes.add(32 * h + 8 * j + l), code);
                        }
                    }
                }
                // Bytes 94..110: qs[62..64], scales[0..12], d.
                let t = S::rows_x16(blk.add(94), rs);
                let s0 = S::or(S::srl32(t[0], 16), S::sll32(t[1], 16));
                let s1 = S::or(S::srl32(t[1], 16), S::sll32(t[2], 16));
                let s2 = S::or(S::srl32(t[2], 16), S::sll32(t[3], 16));
                let low = [s0, s1, S::srl32(s0, 4), S::srl32(s1, 4)];
                let mut g = GroupBytes::<S>::new(true);
                for (k, &low) in low.iter().enumerate() {
                    let six = S::or(
                        field::<S>(low, 0, 0x0f0f_0f0f),
                        S::sll32(field::<S>(s2, 2 * k as u32, 0x0303_0303), 4),
                    );
                    g.scales[k] = S::sub8(six, S::splat(0x2020_2020));
                }
                let d = S::f16_low(S::srl32(t[3], 16));
                store_super_params::<S, F>(&g, d, S::fzero(), out);
            }
            // Q4_K / Q5_K: d, dmin, scales[12] (6-bit scales and mins), [qh[32],] qs[128].
            144 | 176 => {
                let five = F::BLOCK_BYTES == 176;
                let qh = if five {
                    words::<S, 8>(blk.add(16), rs)
                } else {
                    [S::zero(); 8]
                };
                let qs = blk.add(if five { 48 } else { 16 });
                for c in 0..4 {
                    let q = words::<S, 8>(qs.add(32 * c), rs);
                    for l in 0..8 {
                        let (mut low, mut high) = nibbles::<S>(q[l]);
                        if five {
                            low = or_bit::<S>(low, qh[l], (2 * c) as u32, 4);
                            high = or_bit::<S>(high, qh[l], (2 * c + 1) as u32, 4);
                        }
                        S::store(codes.add(16 * c + l), low);
                        S::store(codes.add(16 * c + 8 + l), high);
                    }
                }
                let head = S::rows_x16(blk, rs);
                let mut g = GroupBytes::<S>::new(false);
                g.scales[0] = field::<S>(head[1], 0, 0x3f3f_3f3f);
                g.mins[0] = field::<S>(head[2], 0, 0x3f3f_3f3f);
                // Groups 4..8: low nibbles in bytes 8..12, top two bits in bytes 0..8.
                let (s_top, m_top) = (
                    field::<S>(head[1], 2, 0x3030_3030),
                    field::<S>(head[2], 2, 0x3030_3030),
                );
                g.scales[1] = S::or(field::<S>(head[3], 0, 0x0f0f_0f0f), s_top);
                g.mins[1] = S::or(field::<S>(head[3], 4, 0x0f0f_0f0f), m_top);
                let dm = head[0];
                store_super_params::<S, F>(&g, S::f16_low(dm), S::f16_low(S::srl32(dm, 16)), out);
            }
            // Q6_K: ql[128], qh[64], scales[16] (i8), d.
            _ => {
                for h in 0..2 {
                    let qh = words::<S, 8>(blk.add(128 + 32 * h), rs);
                    for p in 0..2 {
                        let ql = words::<S, 8>(blk.add(64 * h + 32 * p), rs);
                        for l in 0..8 {
                            // Quarter q of the half: ql's low nibbles for q < 2, high for
                            // q ≥ 2; qh's bits 2q, 2q + 1.
                            let (low, high) = nibbles::<S>(ql[l]);
                            let low_top = field::<S>(qh[l], 2 * p as u32, 0x0303_0303);
                            let high_top = field::<S>(qh[l], 2 * (p + 2) as u32, 0x0303_0303);
                            let v = 32 * h + 8 * p + l;
                            S::store(codes.add(v), S::or(low, S::sll32(low_top, 4)));
                            S::store(codes.add(v + 16), S::or(high, S::sll32(high_top, 4)));
                        }
                    }
                }
                let mut g = GroupBytes::<S>::new(true);
                g.scales = S::rows_x16(blk.add(192), rs);
                let d = S::f16_low(S::srl32(S::rows_x16(blk.add(194), rs)[3], 16));
                store_super_params::<S, F>(&g, d, S::fzero(), out);
            }
        }
    }
}

/// Code vectors of a k-quant whose `vpmaddubsw` products can be summed in i16: a half-lane
/// then holds `2·run` products of codes below `2^bits` and activations of at most 128 in
/// magnitude, which must stay below 2¹⁵ (Q6_K: 4·63·128; Q5_K: 8·31·128; the rest 16·15·128).
pub(crate) const fn k_run<F: SuperBlockFormat>() -> usize {
    match F::DTYPE {
        GgmlType::Q6_K => 2,
        GgmlType::Q5_K => 4,
        _ => 8,
    }
}

/// The tile of a k-quant: per super-block and token, `isum = Σ_g s_g·dot_g` from the codes,
/// the pair term `Σ_g x_g·Σa_g` (mins, or scales times the zero point), then the canonical
/// `term` and `acc = acc + term`.
#[inline(always)]
unsafe fn tile_super<S: Isa, F: SuperBlockFormat, const T: usize>(
    buf: *const S::I,
    blocks: Range<usize>,
    act: &SuperActBlocks<'_>,
    t0: usize,
    acc: &mut [S::F; T],
) {
    let slots = super_slots::<F>();
    let group_vectors = F::GROUP / 4;
    let unit = group_vectors.min(S::UNIT);
    // SAFETY: the buffer holds every super-block of `blocks`; every activation index is below
    // n_tokens · blocks_per_token (caller).
    unsafe {
        for (slot, b) in blocks.enumerate() {
            let base = buf.add(slot * slots);
            let mut isum = [S::zero(); T];
            for group in 0..F::GROUPS {
                let scale = S::load(base.add(SuperLayout::SCALES + group));
                for first in (0..group_vectors).step_by(unit) {
                    let v0 = group * group_vectors + first;
                    let mut codes = [S::zero(); 8];
                    for (k, c) in codes[..unit].iter_mut().enumerate() {
                        *c = S::load(base.add(SuperLayout::CODES + v0 + k));
                    }
                    for (t, isum_t) in isum.iter_mut().enumerate() {
                        let i = act.index(t0 + t, b);
                        let a = act.qs.as_ptr().add(i * QK_K + 4 * v0);
                        let dot = S::dot_codes_scaled(&codes[..unit], a, scale, k_run::<F>());
                        *isum_t = S::add32(*isum_t, dot);
                    }
                }
            }
            let d = S::fload(base.add(SuperLayout::d::<F>()) as *const S::F);
            let dmin = S::fload(base.add(SuperLayout::d::<F>() + 1) as *const S::F);
            for (t, (acc_t, isum_t)) in acc.iter_mut().zip(isum).enumerate() {
                let i = act.index(t0 + t, b);
                let sums = scalar::group_sums::<F>(act, i).as_ptr();
                let mut pair = S::zero();
                for k in 0..F::GROUPS / 2 {
                    let p = S::load(base.add(SuperLayout::pairs::<F>() + k));
                    pair = S::madd_pairs(pair, p, sums.add(2 * k));
                }
                let da = S::fsplat(*act.scale.get_unchecked(i));
                let term = if F::HAS_MIN {
                    let t = S::fmul(S::fmul(d, da), S::cvt(isum_t));
                    S::fsub(t, S::fmul(S::fmul(dmin, da), S::cvt(pair)))
                } else {
                    let isum_t = S::sub32(isum_t, S::mullo32(pair, S::splat(F::ZERO)));
                    S::fmul(S::fmul(d, da), S::cvt(isum_t))
                };
                *acc_t = S::fadd(*acc_t, term);
            }
        }
    }
}

/// A k-quant as a lane format.
pub(crate) struct Super<F>(std::marker::PhantomData<F>);

impl<S: Isa, F: SuperBlockFormat> LaneFormat<S> for Super<F> {
    type Act<'a> = SuperActBlocks<'a>;
    const BLOCK_BYTES: usize = F::BLOCK_BYTES;
    const SLOTS: usize = super_slots::<F>();

    /// k-quants have no interleaved layout (`IL` is always false).
    #[inline(always)]
    unsafe fn unpack<const IL: bool>(blk: *const u8, row_bytes: usize, out: *mut S::I) {
        debug_assert!(!IL);
        // SAFETY: forwarded to the caller.
        unsafe { unpack_super::<S, F>(blk, row_bytes, out) }
    }

    #[inline(always)]
    unsafe fn tile<const T: usize>(
        buf: *const S::I,
        blocks: Range<usize>,
        act: &Self::Act<'_>,
        t0: usize,
        acc: &mut [S::F; T],
    ) {
        // SAFETY: forwarded to the caller.
        unsafe { tile_super::<S, F, T>(buf, blocks, act, t0, acc) }
    }

    unsafe fn scalar_rect(
        data: &[u8],
        row_bytes: usize,
        act: &Self::Act<'_>,
        rows: Range<usize>,
        tokens: Range<usize>,
        out: OutPtr,
    ) {
        // SAFETY: forwarded to the caller.
        unsafe { scalar::super_rect::<F>(data, row_bytes, act, rows, tokens, out) }
    }
}
