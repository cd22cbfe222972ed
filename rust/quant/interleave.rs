//! The interleaved weight layout of the 32-element formats: each group of 16 consecutive
//! rows stores its blocks field by field with the rows interleaved, so the SIMD kernels load
//! a block of 16 rows with plain vector loads instead of transposing 16 row pieces per block
//! on every call. A model re-lays its matrices out once at load ([`interleave_rows`]).
//!
//! Layout of block `b` of the group starting at row `16g` (at byte `16g·row_bytes +
//! 16·b·block_bytes`): for each field of the ggml block, in block order, its units (`f16`
//! scales: 2 bytes; `qh` and the codes: 4-byte words), unit `k` of row `i` at
//! `field_start + (16k + i)·unit`: `d` (16 × 2 bytes), `m` (Q4_1, Q5_1), `qh` (Q5_0, Q5_1;
//! 16 × 4 bytes), then the codes (4 or 8 words × 16 × 4 bytes). A group is exactly as many
//! bytes as its 16 rows, so the matrix keeps its size; the rows after the last whole group
//! keep the ggml row layout. Only the byte positions change — and, for Q5, the order of the
//! bits in each `qh` word ([`spread_qh`]) — so every kernel computes the same bits on either
//! layout.

use super::format::GgmlType;

/// Rows of an interleaved group (the widest kernel's lanes).
pub(crate) const GROUP: usize = 16;

/// The fields of a 32-element format's block as `(offset, bytes, unit)`, in block order.
pub(crate) fn fields(dtype: GgmlType) -> Option<&'static [(usize, usize, usize)]> {
    Some(match dtype {
        GgmlType::Q4_0 => &[(0, 2, 2), (2, 16, 4)],
        GgmlType::Q4_1 => &[(0, 2, 2), (2, 2, 2), (4, 16, 4)],
        GgmlType::Q5_0 => &[(0, 2, 2), (2, 4, 4), (6, 16, 4)],
        GgmlType::Q5_1 => &[(0, 2, 2), (2, 2, 2), (4, 4, 4), (8, 16, 4)],
        GgmlType::Q8_0 => &[(0, 2, 2), (2, 32, 4)],
        _ => return None,
    })
}

/// Whether `dtype` has an interleaved layout.
pub(crate) fn supports(dtype: GgmlType) -> bool {
    fields(dtype).is_some()
}

/// Where a Q5 format's `qh` word sits: in a ggml block, and in an interleaved group block.
fn qh_offsets(dtype: GgmlType) -> Option<(usize, usize)> {
    match dtype {
        GgmlType::Q5_0 => Some((2, GROUP * 2)),
        GgmlType::Q5_1 => Some((4, GROUP * 4)),
        _ => None,
    }
}

/// The interleaved order of a Q5 block's 32 fifth bits: bit `8k + v` is element `4v + k`'s
/// (ggml: bit `e` is element `e`'s). The kernels unpack code vector `v` (elements `4v..4v+4`,
/// one per byte `k` of a lane) with a shift and a mask, instead of a byte shuffle and a
/// compare per vector: the unpacking is most of a decode step's cost for Q5.
pub(crate) const fn spread_qh(qh: u32) -> u32 {
    let mut out = 0;
    let mut e = 0;
    while e < 32 {
        out |= ((qh >> e) & 1) << (8 * (e % 4) + e / 4);
        e += 1;
    }
    out
}

/// The inverse of [`spread_qh`]: the ggml order back.
pub(crate) const fn gather_qh(spread: u32) -> u32 {
    let mut out = 0;
    let mut e = 0;
    while e < 32 {
        out |= ((spread >> (8 * (e % 4) + e / 4)) & 1) << e;
        e += 1;
    }
    out
}

/// Applies `f` to the 4-byte word at `at`.
fn map_word(bytes: &mut [u8], at: usize, f: fn(u32) -> u32) {
    let word = &mut bytes[at..at + 4];
    let v = f(u32::from_le_bytes(word.try_into().expect("4 bytes")));
    word.copy_from_slice(&v.to_le_bytes());
}

/// Calls `f(row_block_offset, group_block_offset, len)` for every piece of a block: the
/// byte range `row_block_offset..+len` of row `i`'s ggml block sits at
/// `group_block_offset..+len` of the interleaved group block.
fn for_each_piece(dtype: GgmlType, i: usize, mut f: impl FnMut(usize, usize, usize)) {
    let mut base = 0;
    for &(offset, bytes, unit) in fields(dtype).expect("an interleavable format") {
        for k in 0..bytes / unit {
            f(offset + k * unit, base + (GROUP * k + i) * unit, unit);
        }
        base += GROUP * bytes;
    }
}

/// The interleaved layout of a `(rows, cols)` matrix of `dtype` in ggml row layout.
/// `None` if the format has no interleaved layout or `data` is not `rows` whole rows.
pub fn interleave_rows(dtype: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Option<Vec<u8>> {
    let mut out = vec![0u8; data.len()];
    interleave_rows_into(dtype, rows, cols, data, &mut out).then_some(out)
}

/// [`interleave_rows`] into `out` (`data.len()` bytes); `false` (nothing written) if the
/// format has no interleaved layout or the lengths do not match.
pub fn interleave_rows_into(
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    data: &[u8],
    out: &mut [u8],
) -> bool {
    use rayon::prelude::*;
    let Ok(row_bytes) = dtype.row_bytes(cols) else {
        return false;
    };
    if !supports(dtype)
        || Some(data.len()) != rows.checked_mul(row_bytes)
        || out.len() != data.len()
    {
        return false;
    }
    let bb = dtype.block_bytes();
    let nb = row_bytes / bb;
    let group_bytes = GROUP * row_bytes;
    let whole = rows / GROUP * group_bytes;
    out[whole..].copy_from_slice(&data[whole..]);
    out[..whole]
        .par_chunks_mut(group_bytes)
        .zip(data[..whole].par_chunks(group_bytes))
        .for_each(|(dst, src)| {
            for b in 0..nb {
                let to = b * GROUP * bb;
                for i in 0..GROUP {
                    let from = i * row_bytes + b * bb;
                    for_each_piece(dtype, i, |f, t, len| {
                        dst[to + t..to + t + len].copy_from_slice(&src[from + f..from + f + len]);
                    });
                    if let Some((_, qh)) = qh_offsets(dtype) {
                        map_word(dst, to + qh + 4 * i, spread_qh);
                    }
                }
            }
        });
    true
}

/// Row `r` of an interleaved matrix back in ggml layout, into `out` (`row_bytes` bytes).
pub(crate) fn row_into(dtype: GgmlType, data: &[u8], row_bytes: usize, r: usize, out: &mut [u8]) {
    let rows = data.len() / row_bytes;
    if r >= rows / GROUP * GROUP {
        out.copy_from_slice(&data[r * row_bytes..(r + 1) * row_bytes]);
        return;
    }
    let bb = dtype.block_bytes();
    let (group, i) = ((r / GROUP) * GROUP * row_bytes, r % GROUP);
    for b in 0..row_bytes / bb {
        let src = group + b * GROUP * bb;
        for_each_piece(dtype, i, |from, to, len| {
            out[b * bb + from..b * bb + from + len]
                .copy_from_slice(&data[src + to..src + to + len]);
        });
        if let Some((qh, _)) = qh_offsets(dtype) {
            map_word(out, b * bb + qh, gather_qh);
        }
    }
}
