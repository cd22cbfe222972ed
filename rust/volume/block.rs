//! KV storage in fixed-size position blocks, in memory or mapped from a volume file.
//!
//! A volume's KV for positions `[0, prefix_len)` is a sequence of blocks of
//! [`BLOCK_POSITIONS`] positions (the last one may be shorter), each laid out
//! `(layers, kv_heads, positions, head_dim)` for keys and for values. A full block is
//! determined by the model, the layer range, the tenant and the token ids up to its end, so
//! two volumes that share those ids share the block itself (an `Arc`): a system prompt that
//! heads many cached prompts is held once.

use std::ops::Deref;
use std::sync::Arc;

use memmap2::Mmap;

use super::slab::{all_finite, copy_all_finite, SlabShape};

/// Positions per KV block (the last block of a volume may hold fewer).
pub const BLOCK_POSITIONS: usize = 16;

/// Floats owned on the heap or borrowed from a read-only file mapping.
pub(super) enum Floats {
    Heap(Box<[f32]>),
    Mapped {
        map: Arc<Mmap>,
        /// Byte offset of the first float (a multiple of 4).
        offset: usize,
        len: usize,
    },
}

impl Floats {
    /// `len` floats of `map` from byte `offset`.
    ///
    /// # Panics
    /// If the range is outside the mapping or `offset` is not 4-byte aligned (the disk
    /// format aligns every float array; callers check the file size first).
    pub(super) fn mapped(map: &Arc<Mmap>, offset: usize, len: usize) -> Self {
        assert!(offset.is_multiple_of(4) && offset + 4 * len <= map.len());
        Floats::Mapped {
            map: Arc::clone(map),
            offset,
            len,
        }
    }
}

impl Deref for Floats {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Floats::Heap(v) => v,
            Floats::Mapped { map, offset, len } => {
                let bytes = &map[*offset..*offset + 4 * len];
                // SAFETY: the range lies inside the mapping (checked in `mapped`), the mapping
                // is page-aligned and `offset` a multiple of 4, so the pointer is aligned for
                // f32; every bit pattern is a valid f32; the mapping is read-only and lives as
                // long as `self` holds its `Arc`. The file is never written in place (volume
                // files are written whole and renamed into place).
                unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), *len) }
            }
        }
    }
}

/// Keys and values of one block of positions, each `(layers, kv_heads, positions,
/// head_dim)`, held as one array: the keys, then the values (the volume file's layout too).
pub struct KvBlock {
    positions: usize,
    data: Floats,
}

impl KvBlock {
    /// A block over `data`: keys then values, equally long.
    pub(super) fn new(positions: usize, data: Floats) -> Self {
        debug_assert!(data.len().is_multiple_of(2));
        KvBlock { positions, data }
    }

    /// Copies positions `[start, start + positions)` of a `(layers, kv_heads, n, head_dim)`
    /// slab pair into a new block, checking finiteness as it copies. `None` if a copied value
    /// is not finite (the caller locates it).
    pub(super) fn copy_from(
        shape: SlabShape,
        keys: &[f32],
        vals: &[f32],
        start: usize,
        positions: usize,
    ) -> Option<Self> {
        let run = positions * shape.head_dim;
        let n = shape.layers * shape.kv_heads * run;
        let mut data = vec![0.0f32; 2 * n].into_boxed_slice();
        let (dst_keys, dst_vals) = data.split_at_mut(n);
        let mut finite = true;
        for (src, dst) in [(keys, dst_keys), (vals, dst_vals)] {
            for (i, out) in dst.chunks_exact_mut(run).enumerate() {
                let (layer, head) = (i / shape.kv_heads, i % shape.kv_heads);
                let from = shape.row_offset(layer, head, start);
                finite &= copy_all_finite(&src[from..from + run], out);
            }
        }
        finite.then(|| KvBlock::new(positions, Floats::Heap(data)))
    }

    /// Whether positions `[start, start + positions)` of a slab pair are all finite (the
    /// check an input gets where its block is already cached and need not be copied).
    pub(super) fn rows_finite(
        shape: SlabShape,
        keys: &[f32],
        vals: &[f32],
        start: usize,
        positions: usize,
    ) -> bool {
        let run = positions * shape.head_dim;
        (0..shape.layers * shape.kv_heads).all(|i| {
            let from = shape.row_offset(i / shape.kv_heads, i % shape.kv_heads, start);
            all_finite(&keys[from..from + run]) && all_finite(&vals[from..from + run])
        })
    }

    /// Positions held.
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// Keys, `(layers, kv_heads, positions, head_dim)`.
    pub fn keys(&self) -> &[f32] {
        &self.data[..self.data.len() / 2]
    }

    /// Values, `(layers, kv_heads, positions, head_dim)`.
    pub fn vals(&self) -> &[f32] {
        &self.data[self.data.len() / 2..]
    }

    /// Bytes of keys and values.
    pub fn nbytes(&self) -> usize {
        4 * self.data.len()
    }

    /// Whether the floats are mapped from a volume file rather than owned.
    pub fn is_mapped(&self) -> bool {
        matches!(self.data, Floats::Mapped { .. })
    }

    /// A heap copy with `keys[index]` replaced by NaN (fault injection).
    pub(super) fn damaged_copy(&self, index: usize) -> Self {
        let mut data: Box<[f32]> = self.data.to_vec().into_boxed_slice();
        data[index] = f32::NAN;
        KvBlock::new(self.positions, Floats::Heap(data))
    }
}

impl std::fmt::Debug for KvBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvBlock")
            .field("positions", &self.positions)
            .field("mapped", &self.is_mapped())
            .finish_non_exhaustive()
    }
}

/// Start and length of each block of a `prefix_len`-position volume.
pub(super) fn block_spans(prefix_len: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..prefix_len.div_ceil(BLOCK_POSITIONS)).map(move |j| {
        let start = j * BLOCK_POSITIONS;
        (start, BLOCK_POSITIONS.min(prefix_len - start))
    })
}
