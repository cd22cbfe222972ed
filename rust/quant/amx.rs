//! AMX-INT8 kernels for the 32-element formats (Intel Sapphire Rapids and later).
//!
//! A matmul of `n` tokens is compute-bound from a few tokens on, and with AVX-512 VNNI its
//! cost is the `vpdpbusd` count (8 per 16 rows, block and token; 16 for a refined input's two
//! byte planes) plus the float epilogue every kernel performs per block. AMX's tile multiply
//! computes the exact integer dot products of 16 token rows × 16 weight rows × one 32-element
//! block in one instruction, on a unit of its own, so what is left on the vector units is the
//! epilogue.
//!
//! Layout. A pass covers one row group (16 weight rows) and up to 16 tokens, whose
//! accumulators stay in registers over all blocks. Per block, B is the group's 8 code vectors:
//! exactly the dword-interleaved vectors the lane kernels unpack (`lanes`), which is AMX's B
//! layout (row `k` holds the four codes of elements `4k..4k+4` of every weight row); the
//! row group's blocks are unpacked once for all passes. A holds token rows of 32 activation
//! codes, copied once per matmul task into tile order: a token per row (8-bit input), or a
//! token's high and low byte planes in two consecutive rows (refined input, 8 tokens a tile,
//! two tiles a pass). C (i32, 16 lanes a row) is stored to an L1 buffer, and each of its rows
//! is one vector of 16 row lanes for the epilogue, which is the lanes' own:
//! `isum = 256·hi + lo − zero·Σa`, `term = (dw·da)·isum (+ m·s)`, `acc = acc + term`.
//!
//! Overlap. The tile unit runs its instructions in order and a tile store waits for its
//! multiply, while the vector units idle behind a tile instruction that waits. So the blocks
//! run as a three-stage pipeline on two alternating sets of B and C tiles — block `k`
//! multiplies, block `k − 1` is stored, block `k − 2` goes through the epilogue — and the tile
//! instructions of an iteration are spread between the epilogue's tokens, which keeps both
//! units busy (in a loop of this shape, a refined block of 16 tokens took ~30 ns with the
//! instructions spread, ~50 ns with them issued together). Measured on one cache-warm
//! 1536 × 576 `Q4_1` matrix, one thread (Sapphire Rapids KVM guest): refined inputs 1.3× the
//! VNNI kernel at 4 tokens, 1.5× at 8, 1.65–1.8× from 16; 8-bit inputs 1.1× at 8, 1.35–1.6×
//! from 9. In a whole forward pass, whose weights stream from memory, the gain is smaller:
//! prefill 8–15% faster, a 16-row step ~10%.
//!
//! # Bit-exactness
//! The tile multiply sums exact integer products into i32 lanes (wrapping, never saturating,
//! like `vpdpbusd`), so `isum` is the same integer whatever the order, and the float sequence
//! per element is the canonical one (`scalar`). Results are bit-identical to every other
//! kernel, for any token count, tiling or thread split. `Q8_0`'s codes enter as the signed
//! bytes they are (`tdpbssd`, no zero point: the same `Σ q·a` as the lanes' `Σ (q + 128)·a −
//! 128·Σa`).
//!
//! # Tile state
//! Linux grants AMX state per process on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), asked
//! once when the kernel is first detected. The tile configuration is per thread: each
//! rectangle loads it and releases the tiles when done, so a pool thread holds no tile state
//! between matmuls (its context switches stay cheap). The tile instructions are inline
//! assembly: the compiler never allocates tile registers itself, so tiles keep their contents
//! between the asm blocks of a pass.

use core::arch::asm;
use core::arch::x86_64::*;
use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::OnceLock;

use super::activation::ActBlocks;
use super::avx512::{self, Avx512};
use super::format::{BlockFormat, QK};
use super::interleave::GROUP;
use super::kernel::OutPtr;
use super::lanes::{self, LaneFormat, Small, NARROW};
use super::scalar;

/// The AVX-512 VNNI lanes whose unpacking the tile kernels share.
type V = Avx512<true>;

/// Weight rows of a pass (one row group: the 16 i32 lanes of a C row).
const ROWS: usize = 16;
/// Tokens of a pass (their accumulators stay in registers).
const PASS: usize = 16;
/// Fewer tokens than this run the VNNI lanes instead: a block's tile round trip costs about
/// the same whatever the token count, more than a few tokens' `vpdpbusd`. Measured as whole
/// decode steps (weights streamed from DRAM, Sapphire Rapids): 8-bit inputs ran 2–5 % slower
/// on tiles at 8 tokens and 2–9 % faster at 12; refined ones (twice the `vpdpbusd`) 3 %
/// slower at 4 tokens and 4–7 % faster at 8.
const MIN_TOKENS: usize = 10;
/// [`MIN_TOKENS`] of a refined input.
const MIN_TOKENS_REFINED: usize = 8;
/// Buffer slots (64-byte vectors) of an unpacked block: 8 code vectors (the B tile), `dw`,
/// `m` — the lanes' own layout (`Small::unpack`).
const SLOTS: usize = 10;
/// Bytes of one A tile: 16 rows of one block's 32 codes.
const A_TILE: usize = 16 * QK;
/// Bytes of one C tile: 16 rows of 16 i32.
const C_TILE: usize = 16 * 64;

/// Whether this CPU and OS run the AMX kernels: AVX-512 VNNI, AMX-TILE and AMX-INT8 in
/// CPUID, tile state enabled by the OS (XCR0), and the process granted it (Linux asks for
/// permission before the first use). Checked once.
pub(crate) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("xsave"))
        {
            return false;
        }
        // SAFETY: CPUID leaf 7 exists on every CPU with AVX-512 (older toolchains mark
        // `__cpuid_count` unsafe).
        #[allow(unused_unsafe)]
        let leaf7 = unsafe { __cpuid_count(7, 0) };
        let (amx_tile, amx_int8) = (leaf7.edx & (1 << 24) != 0, leaf7.edx & (1 << 25) != 0);
        // SAFETY: XGETBV is available (the xsave check above) and XCR0 is always readable.
        let xcr0 = unsafe { _xgetbv(0) };
        // Bits 17 and 18: the OS saves the tile configuration and the tile data.
        let os_tiles = xcr0 & (0b11 << 17) == 0b11 << 17;
        amx_tile && amx_int8 && os_tiles && request_tile_permission()
    })
}

/// Asks Linux for this process's permission to use the tile data state (required before
/// the first tile instruction since Linux 5.16; without it the instruction faults).
#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;
    // SAFETY: arch_prctl with this request only changes the process's permitted xstate
    // features; it reads and writes no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false
}

/// The 64-byte tile configuration (`ldtilecfg`'s operand, palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Tile registers, by block parity: B, and C of each half of a refined pass (C of the one
/// tile of an 8-bit pass is the first). A is tile `half` (refined) or tile `parity` (8-bit).
const B_TILE: [usize; 2] = [2, 5];
const C_TILES: [[usize; 2]; 2] = [[3, 4], [6, 7]];

impl TileConfig {
    /// Tiles for a matmul of `n` tokens: A rows of 32 code bytes, B 8 × 64 bytes (a block's
    /// code vectors), C rows of 16 i32. A single pass configures only the rows it has; more
    /// passes use whole tiles (the last one's spare rows are zeros).
    fn new(wide: bool, n: usize) -> Self {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        let full = n > PASS;
        let mut set = |tile: usize, rows: usize, colsb: usize| {
            c.rows[tile] = rows as u8;
            c.colsb[tile] = if rows == 0 { 0 } else { colsb as u16 };
        };
        for b in B_TILE {
            set(b, QK / 4, 64);
        }
        if wide {
            // Two rows a token: tokens 0..8 in half 0, 8..16 in half 1.
            let rows = |half: usize| {
                if full {
                    16
                } else {
                    2 * n.saturating_sub(8 * half).min(8)
                }
            };
            for half in 0..2 {
                set(half, rows(half), QK);
                for c_tiles in C_TILES {
                    set(c_tiles[half], rows(half), 64);
                }
            }
        } else {
            let rows = if full { 16 } else { n };
            // A tile `parity` and C tile 0 of each parity.
            for (parity, c_tiles) in C_TILES.iter().enumerate() {
                set(parity, rows, QK);
                set(c_tiles[0], rows, 64);
            }
        }
        c
    }
}

/// Holds this thread's tile configuration while alive; releases the tiles on drop.
struct Tiles;

impl Tiles {
    /// Loads `config`.
    ///
    /// # Safety
    /// AMX is [`available`].
    #[inline(always)]
    unsafe fn load(config: &TileConfig) -> Tiles {
        // SAFETY: the configuration is valid (palette 1, rows ≤ 16, colsb ≤ 64, unused
        // tiles zero) and AMX is enabled (caller).
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) config as *const TileConfig, options(nostack, readonly, preserves_flags));
        }
        Tiles
    }
}

impl Drop for Tiles {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: a configuration is loaded (`Tiles::load`); releasing returns the tiles to
        // their initial state.
        unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

thread_local! {
    /// Per-thread scratch of the tile kernels: the activations in tile order, then the
    /// unpacked blocks of the current row group. Grown on demand, never shrunk.
    static SCRATCH: RefCell<Vec<Aligned<64>>> = const { RefCell::new(Vec::new()) };
}

/// Rectangle of a 32-element-format matmul with the AMX tiles (contract as `lanes::rect`);
/// fewer tokens than [`MIN_TOKENS`] (refined: [`MIN_TOKENS_REFINED`]) run the VNNI lanes.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI and AMX is [`available`]; otherwise as for
/// `lanes::rect`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn small_amx(
    dtype: super::GgmlType,
    data: &[u8],
    row_bytes: usize,
    interleaved: bool,
    act: &ActBlocks<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    // SAFETY: forwarded to the caller; the features are enabled here.
    unsafe {
        let min = if act.is_wide() {
            MIN_TOKENS_REFINED
        } else {
            MIN_TOKENS
        };
        if tokens.len() < min {
            return avx512::small_vnni(dtype, data, row_bytes, interleaved, act, rows, tokens, out);
        }
        super::format::with_small_format!(dtype, F => match (interleaved, act.is_wide()) {
            (true, true) => rect::<F, true, true>(data, row_bytes, act, rows, tokens, out),
            (true, false) => rect::<F, true, false>(data, row_bytes, act, rows, tokens, out),
            (false, true) => rect::<F, false, true>(data, row_bytes, act, rows, tokens, out),
            (false, false) => rect::<F, false, false>(data, row_bytes, act, rows, tokens, out),
        })
    }
}

/// Bytes of one pass's activations for one block: one A tile (8-bit), two (refined).
const fn pass_block_bytes<const WIDE: bool>() -> usize {
    if WIDE {
        2 * A_TILE
    } else {
        A_TILE
    }
}

/// Computes `out[t, r]` for `r` in `rows`, `t` in `tokens`.
///
/// # Safety
/// As for [`small_amx`].
#[inline(always)]
unsafe fn rect<F: BlockFormat, const IL: bool, const WIDE: bool>(
    data: &[u8],
    row_bytes: usize,
    act: &ActBlocks<'_>,
    rows: Range<usize>,
    tokens: Range<usize>,
    out: OutPtr,
) {
    let nb = row_bytes / F::BLOCK_BYTES;
    let simd_rows = if IL {
        let groups_end = data.len() / row_bytes / GROUP * GROUP;
        rows.start..rows.end.min(groups_end).max(rows.start)
    } else {
        rows.clone()
    };
    let simd_end = simd_rows.start + simd_rows.len() / ROWS * ROWS;
    assert!(!IL || rows.start.is_multiple_of(GROUP));
    assert_eq!(<Small<F, NARROW> as LaneFormat<V>>::SLOTS, SLOTS);
    if simd_end > simd_rows.start {
        let n = tokens.len();
        let passes = n.div_ceil(PASS);
        let a_bytes = passes * nb * pass_block_bytes::<WIDE>();
        let vectors = (a_bytes + nb * SLOTS * 64) / 64;
        // A raw pointer out of the thread-local: the work below must not run inside a
        // closure, which would not inherit this function's target features (its intrinsics
        // would become calls). Nothing else on this thread touches the scratch meanwhile.
        let a_tiles = SCRATCH.with_borrow_mut(|scratch| {
            if scratch.len() < vectors {
                scratch.resize_with(vectors, || Aligned([0; 64]));
            }
            scratch.as_mut_ptr() as *mut u8
        });
        // SAFETY: the scratch holds `a_bytes` then `nb` unpacked blocks; the tokens are inside
        // `act`; AMX is available (caller) and the configuration fits n tokens.
        unsafe {
            copy_activations::<WIDE>(act, tokens.clone(), nb, a_tiles);
            let codes = a_tiles.add(a_bytes) as *mut __m512i;
            let _tiles = Tiles::load(&TileConfig::new(WIDE, n));
            let block_stride = if IL {
                GROUP * F::BLOCK_BYTES
            } else {
                F::BLOCK_BYTES
            };
            let span = if IL { GROUP } else { ROWS } * F::BLOCK_BYTES;
            for r in (simd_rows.start..simd_end).step_by(ROWS) {
                super::side::claim_group(nb);
                let (first_row, lane_arg) = if IL {
                    (r / GROUP * GROUP, r % GROUP)
                } else {
                    (r, row_bytes)
                };
                // Rows r..r+16 are inside the caller's rectangle and inside `data`.
                let w = data.as_ptr().add(first_row * row_bytes);
                let next = if r + 2 * ROWS <= simd_end {
                    let next_first = if IL {
                        (r + ROWS) / GROUP * GROUP
                    } else {
                        r + ROWS
                    };
                    Some(data.as_ptr().wrapping_add(next_first * row_bytes))
                } else {
                    None
                };
                for b in 0..nb {
                    super::side::issue_block();
                    unpack::<F, IL>(w.add(b * block_stride), lane_arg, codes.add(b * SLOTS));
                }
                for pass in 0..passes {
                    let first = tokens.start + pass * PASS;
                    let pass_act = Pass {
                        act,
                        codes,
                        a: a_tiles.add(pass * nb * pass_block_bytes::<WIDE>()),
                        nb,
                        first,
                        len: (tokens.end - first).min(PASS),
                        // The first pass brings the next row group into L2, a block's share
                        // per block it multiplies, so the reads overlap the arithmetic (all
                        // at once, they would wait for the miss buffers).
                        next: if pass == 0 { next } else { None },
                        span,
                    };
                    if WIDE && pass_act.len > 8 {
                        run_pass::<F, WIDE, true>(&pass_act, out.at(first, r), out.stride);
                    } else {
                        run_pass::<F, WIDE, false>(&pass_act, out.at(first, r), out.stride);
                    }
                }
            }
        }
    }
    if simd_end < rows.end {
        // SAFETY: forwarded to the caller (rows past the last whole group are in row layout).
        unsafe { scalar::quant_rect::<F>(data, row_bytes, act, simd_end..rows.end, tokens, out) };
    }
}

/// Copies the activation codes of `tokens` into tile order at `dst`: for each pass of 16
/// tokens and each block, one A tile (8-bit: row `t` is token `t`'s 32 codes) or two (refined:
/// rows `2t` and `2t + 1` of tile `t / 8` are token `t`'s high and low planes). Rows past the
/// last token are zeros (a whole tile of a later pass multiplies them; no output reads them).
///
/// # Safety
/// `dst` holds `passes · nb · pass_block_bytes` bytes; the tokens are inside `act`.
#[inline(always)]
unsafe fn copy_activations<const WIDE: bool>(
    act: &ActBlocks<'_>,
    tokens: Range<usize>,
    nb: usize,
    dst: *mut u8,
) {
    let step = act.blocks_per_token;
    let passes = tokens.len().div_ceil(PASS);
    // SAFETY: forwarded to the caller; every source row is a whole block of a token in range.
    unsafe {
        for pass in 0..passes {
            for b in 0..nb {
                let tiles = dst.add((pass * nb + b) * pass_block_bytes::<WIDE>());
                for t in 0..PASS {
                    let token = tokens.start + pass * PASS + t;
                    let planes: &[(*const i8, usize)] = if WIDE {
                        &[(act.qs.as_ptr(), 0), (act.lo.as_ptr(), 1)]
                    } else {
                        &[(act.qs.as_ptr(), 0)]
                    };
                    for &(plane, p) in planes {
                        let row = if WIDE {
                            (t / 8) * A_TILE + (2 * (t % 8) + p) * QK
                        } else {
                            t * QK
                        };
                        let v = if token < tokens.end {
                            _mm256_loadu_si256(plane.add((token * step + b) * QK) as *const __m256i)
                        } else {
                            _mm256_setzero_si256()
                        };
                        _mm256_storeu_si256(tiles.add(row) as *mut __m256i, v);
                    }
                }
            }
        }
    }
}

/// Whether format `F`'s codes are signed in the B tile: `Q8_0`'s whole bytes go in as they
/// are (`tdpbssd`, no zero point); the nibble formats' codes are unsigned (`tdpbsud`).
const fn signed_codes<F: BlockFormat>() -> bool {
    !F::NIBBLES
}

/// Unpacks one block of 16 rows into `out[..SLOTS]` with the lanes' unpacking; `Q8_0`'s
/// codes, which the lanes store as `q + 128`, go back to `q`.
///
/// # Safety
/// As for `LaneFormat::unpack`.
#[inline(always)]
unsafe fn unpack<F: BlockFormat, const IL: bool>(
    blk: *const u8,
    lane_arg: usize,
    out: *mut __m512i,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        <Small<F, NARROW> as LaneFormat<V>>::unpack::<IL>(blk, lane_arg, out);
        if signed_codes::<F>() {
            let bias = _mm512_set1_epi8(-128);
            for v in 0..QK / 4 {
                _mm512_store_si512(
                    out.add(v),
                    _mm512_xor_si512(_mm512_load_si512(out.add(v)), bias),
                );
            }
        }
    }
}

/// One pass: a row group's unpacked blocks (`codes`) times up to 16 tokens from `first`,
/// whose A tiles are at `a`.
struct Pass<'a, 'b> {
    act: &'a ActBlocks<'b>,
    codes: *const __m512i,
    a: *const u8,
    nb: usize,
    first: usize,
    len: usize,
    /// The next row group, to prefetch.
    next: Option<*const u8>,
    /// Bytes of one block of a row group.
    span: usize,
}

/// Runs `$body` for `$t` = 0…15, unrolled: the accumulators of a pass then stay in
/// registers (a loop with a data-dependent bound kept them on the stack).
macro_rules! each_token {
    ($t:ident => $body:expr) => {{
        each_token!(@ $t => $body; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    }};
    (@ $t:ident => $body:expr; $($n:literal)*) => {{
        $({
            let $t: usize = $n;
            $body;
        })*
    }};
}

/// A pass over all blocks as a three-stage pipeline (see the module docs): in iteration `k`,
/// block `k` multiplies on tile set `k % 2`, block `k − 1`'s C tiles are stored to C buffer
/// `(k − 1) % 2`, and block `k − 2` goes through the epilogue from buffer `k % 2`, its tokens
/// spread between the tile instructions. `SECOND`: a refined pass of more than 8 tokens (its
/// second A and C tiles are in use).
///
/// # Safety
/// As for [`rect`]; the tiles are configured for the matmul; `out` is owned for 16 floats at
/// `len` token strides.
#[inline(always)]
unsafe fn run_pass<F: BlockFormat, const WIDE: bool, const SECOND: bool>(
    p: &Pass<'_, '_>,
    out: *mut f32,
    out_stride: usize,
) {
    // Uninitialised: a C row is read only after the tile store that wrote it.
    let mut c = MaybeUninit::<Aligned<{ 4 * C_TILE }>>::uninit();
    let c = c.as_mut_ptr() as *mut u8;
    let nb = p.nb;
    // SAFETY: every pointer stays inside the scratch, the C buffers or `out` (caller).
    unsafe {
        let mut acc = [_mm512_setzero_ps(); PASS];
        // The pipeline fills (k = 0, 1), runs, and drains (k = nb, nb + 1): one instance per
        // set of active stages, so the steady state has no branches.
        iteration::<F, WIDE, SECOND, true, false, false>(p, c, 0, &mut acc);
        if nb > 1 {
            iteration::<F, WIDE, SECOND, true, true, false>(p, c, 1, &mut acc);
        } else {
            iteration::<F, WIDE, SECOND, false, true, false>(p, c, 1, &mut acc);
        }
        for k in 2..nb {
            iteration::<F, WIDE, SECOND, true, true, true>(p, c, k, &mut acc);
        }
        if nb > 1 {
            iteration::<F, WIDE, SECOND, false, true, true>(p, c, nb, &mut acc);
        }
        iteration::<F, WIDE, SECOND, false, false, true>(p, c, nb + 1, &mut acc);
        each_token!(t => if t < p.len {
            _mm512_storeu_ps(out.add(t * out_stride), acc[t]);
        });
    }
}

/// Iteration `k` of a pass: `MUL` multiplies block `k`, `STORE` stores block `k − 1`, `EPI`
/// runs block `k − 2`'s epilogue; `c` holds the two C buffers of each parity.
///
/// # Safety
/// As for [`run_pass`].
#[inline(always)]
unsafe fn iteration<
    F: BlockFormat,
    const WIDE: bool,
    const SECOND: bool,
    const MUL: bool,
    const STORE: bool,
    const EPI: bool,
>(
    p: &Pass<'_, '_>,
    c: *mut u8,
    k: usize,
    acc: &mut [__m512; PASS],
) {
    let q = k % 2;
    // C buffer of parity `q`, half `h` (a refined pass's second tile).
    let c_buf = |q: usize, h: usize| c.wrapping_add((2 * q + h) * C_TILE);
    let a = p.a.wrapping_add(k * pass_block_bytes::<WIDE>());
    let signed = signed_codes::<F>();
    let a_first = if WIDE { 0 } else { q };
    // Block k − 2's epilogue for tokens $from..$to (a macro: a closure would not inherit the
    // target features).
    macro_rules! epilogue_part {
        ($from:literal, $to:literal) => {
            if EPI {
                epilogue::<F, WIDE>(p, k - 2, c_buf(q, 0), c_buf(q, 1), $from, $to, acc);
            }
        };
    }
    // SAFETY: forwarded to the caller (block k exists when MUL, k − 1 when STORE, k − 2
    // when EPI).
    unsafe {
        if MUL {
            load_b(q, p.codes.add(k * SLOTS) as *const u8);
            if let Some(next) = p.next {
                lanes::prefetch_slice(next, k, p.span);
            }
        }
        epilogue_part!(0, 2);
        if MUL {
            load_a(a_first, a);
        }
        epilogue_part!(2, 4);
        if MUL {
            mul(q, 0, a_first, signed);
        }
        epilogue_part!(4, 6);
        if MUL && SECOND {
            load_a(1, a.add(A_TILE));
        }
        epilogue_part!(6, 8);
        if MUL && SECOND {
            mul(q, 1, 1, signed);
        }
        epilogue_part!(8, 10);
        if STORE {
            store_c(1 - q, 0, c_buf(1 - q, 0));
        }
        epilogue_part!(10, 12);
        if STORE && SECOND {
            store_c(1 - q, 1, c_buf(1 - q, 1));
        }
        epilogue_part!(12, 16);
    }
}

/// The canonical epilogue of block `j` for the pass's tokens `from..to` (below its length):
/// `isum` from the stored C rows (`256·hi + lo` for a refined input), minus the zero point,
/// then `term = (dw·da)·isum (+ m·s)` and `acc = acc + term`, exactly as `lanes::small_terms`.
///
/// # Safety
/// The C buffers hold block `j`'s rows for those tokens.
#[inline(always)]
unsafe fn epilogue<F: BlockFormat, const WIDE: bool>(
    p: &Pass<'_, '_>,
    j: usize,
    c0: *const u8,
    c1: *const u8,
    from: usize,
    to: usize,
    acc: &mut [__m512; PASS],
) {
    let act = p.act;
    let zero_point = if signed_codes::<F>() { 0 } else { F::ZERO };
    debug_assert!(zero_point == 0 || (zero_point as u32).is_power_of_two());
    // SAFETY: forwarded to the caller; the activation indices are of tokens in the pass.
    unsafe {
        let slot = p.codes.add(j * SLOTS);
        let dw = _mm512_load_ps(slot.add(QK / 4) as *const f32);
        let mw = _mm512_load_ps(slot.add(QK / 4 + 1) as *const f32);
        each_token!(t => if t >= from && t < to && t < p.len {
            let i = (p.first + t) * act.blocks_per_token + j;
            let mut isum;
            if WIDE {
                // Token t: rows 2(t mod 8) (high plane) and the next (low plane) of half t / 8.
                let row = (if t < 8 { c0 } else { c1 }).add(2 * (t % 8) * 64);
                let hi = _mm512_load_si512(row as *const __m512i);
                let lo = _mm512_load_si512(row.add(64) as *const __m512i);
                isum = _mm512_add_epi32(_mm512_slli_epi32::<8>(hi), lo);
            } else {
                isum = _mm512_load_si512(c0.add(64 * t) as *const __m512i);
            }
            if zero_point != 0 {
                // A power of two: a shift, as in `lanes`.
                let qsum = _mm512_set1_epi32(*act.qsum.get_unchecked(i));
                let shift = _mm_cvtsi32_si128(zero_point.trailing_zeros() as i32);
                isum = _mm512_sub_epi32(isum, _mm512_sll_epi32(qsum, shift));
            }
            let da = _mm512_set1_ps(*act.scale.get_unchecked(i));
            let mut term = _mm512_mul_ps(_mm512_mul_ps(dw, da), _mm512_cvtepi32_ps(isum));
            if F::HAS_MIN {
                let s = _mm512_set1_ps(*act.scaled_sum.get_unchecked(i));
                term = _mm512_add_ps(term, _mm512_mul_ps(mw, s));
            }
            acc[t] = _mm512_add_ps(acc[t], term);
        });
    }
}

// The tile instructions. Tiles are immediates, so each is a match over the tiles it may
// name (B_TILE, C_TILES, A = 0 or 1).

/// Loads block codes (8 rows of 64 bytes at `codes`) into parity `q`'s B tile.
///
/// # Safety
/// 512 readable bytes at `codes`; tiles configured.
#[inline(always)]
unsafe fn load_b(q: usize, codes: *const u8) {
    // SAFETY: forwarded to the caller.
    unsafe {
        if q == 0 {
            asm!("tileloadd tmm2, [{p} + {s}*1]", p = in(reg) codes, s = in(reg) 64usize, options(nostack, readonly, preserves_flags));
        } else {
            asm!("tileloadd tmm5, [{p} + {s}*1]", p = in(reg) codes, s = in(reg) 64usize, options(nostack, readonly, preserves_flags));
        }
    }
}

/// Loads an A tile (rows of 32 bytes, consecutive at `a`) into tile `tile` (0 or 1).
///
/// # Safety
/// The configured rows of 32 readable bytes at `a`; tiles configured.
#[inline(always)]
unsafe fn load_a(tile: usize, a: *const u8) {
    // SAFETY: forwarded to the caller.
    unsafe {
        if tile == 0 {
            asm!("tileloadd tmm0, [{p} + {s}*1]", p = in(reg) a, s = in(reg) QK, options(nostack, readonly, preserves_flags));
        } else {
            asm!("tileloadd tmm1, [{p} + {s}*1]", p = in(reg) a, s = in(reg) QK, options(nostack, readonly, preserves_flags));
        }
    }
}

/// `C = A·B` into parity `q`'s C tile of half `h`, from A tile `a` and parity `q`'s B tile;
/// `signed`: B holds signed codes (`tdpbssd`), else unsigned ones (`tdpbsud`).
///
/// # Safety
/// Tiles configured and loaded.
#[inline(always)]
unsafe fn mul(q: usize, h: usize, a: usize, signed: bool) {
    debug_assert!(B_TILE == [2, 5] && C_TILES == [[3, 4], [6, 7]]);
    macro_rules! arm {
        ($op:literal, $c:literal, $a:literal, $b:literal) => {
            asm!(
                concat!("tilezero tmm", $c),
                concat!($op, " tmm", $c, ", tmm", $a, ", tmm", $b),
                options(nostack, nomem, preserves_flags)
            )
        };
    }
    // SAFETY: forwarded to the caller.
    unsafe {
        match (q, h, a, signed) {
            (0, 0, 0, false) => arm!("tdpbsud", 3, 0, 2),
            (0, 0, 0, true) => arm!("tdpbssd", 3, 0, 2),
            (0, 1, _, false) => arm!("tdpbsud", 4, 1, 2),
            (0, 1, _, true) => arm!("tdpbssd", 4, 1, 2),
            (_, 0, 0, false) => arm!("tdpbsud", 6, 0, 5),
            (_, 0, 0, true) => arm!("tdpbssd", 6, 0, 5),
            (_, 0, _, false) => arm!("tdpbsud", 6, 1, 5),
            (_, 0, _, true) => arm!("tdpbssd", 6, 1, 5),
            (_, _, _, false) => arm!("tdpbsud", 7, 1, 5),
            (_, _, _, true) => arm!("tdpbssd", 7, 1, 5),
        }
    }
}

/// Stores parity `q`'s C tile of half `h` to `c` (64 bytes a row).
///
/// # Safety
/// The configured rows of 64 writable bytes at `c`; tiles configured.
#[inline(always)]
unsafe fn store_c(q: usize, h: usize, c: *mut u8) {
    macro_rules! arm {
        ($c:literal) => {
            asm!(
                concat!("tilestored [{p} + {s}*1], tmm", $c),
                p = in(reg) c, s = in(reg) 64usize,
                options(nostack, preserves_flags)
            )
        };
    }
    // SAFETY: forwarded to the caller.
    unsafe {
        match (q, h) {
            (0, 0) => arm!(3),
            (0, _) => arm!(4),
            (_, 0) => arm!(6),
            (_, _) => arm!(7),
        }
    }
}

#[repr(C, align(64))]
struct Aligned<const N: usize>([u8; N]);
