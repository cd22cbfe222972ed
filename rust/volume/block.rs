//! KV storage in fixed-size position blocks, in memory or mapped from a volume file.
//!
//! A volume's KV for positions `[0, prefix_len)` is a sequence of blocks of
//! [`BLOCK_POSITIONS`] positions (the last one may be shorter), each laid out
//! `(layers, kv_heads, positions, head_dim)` for keys and for values. A full block is
//! determined by the model, the layer range, the tenant and the token ids up to its end, so
//! two volumes that share those ids share the block itself (an `Arc`): a system prompt that
//! heads many cached prompts is held once.

use std::sync::Arc;

use memmap2::Mmap;

use super::slab::{all_finite, copy_all_finite, with_elems, HeapKv, KvElem, SlabShape};
use crate::ring::{KvDtype, KvSlice};

/// Positions per KV block (the last block of a volume may hold fewer).
pub const BLOCK_POSITIONS: usize = 16;

/// KV values owned on the heap or borrowed from a read-only file mapping, as f32 or as f16
/// bit patterns.
pub(super) enum Floats {
    Heap(HeapKv),
    Mapped {
        map: Arc<Mmap>,
        /// Byte offset of the first value (a multiple of 4).
        offset: usize,
        /// Values (not bytes).
        len: usize,
        dtype: KvDtype,
    },
}

impl Floats {
    /// `len` values of type `dtype` in `map` from byte `offset`.
    ///
    /// # Panics
    /// If the range is outside the mapping or `offset` is not 4-byte aligned (the disk
    /// format aligns every array; callers check the file size first).
    pub(super) fn mapped(map: &Arc<Mmap>, offset: usize, len: usize, dtype: KvDtype) -> Self {
        assert!(offset.is_multiple_of(4) && offset + dtype.bytes() * len <= map.len());
        Floats::Mapped {
            map: Arc::clone(map),
            offset,
            len,
            dtype,
        }
    }

    fn slice(&self) -> KvSlice<'_> {
        match self {
            Floats::Heap(v) => v.slice(),
            Floats::Mapped {
                map,
                offset,
                len,
                dtype,
            } => {
                let bytes = &map[*offset..*offset + dtype.bytes() * len];
                // SAFETY: the range lies inside the mapping (checked in `mapped`), the
                // mapping is page-aligned and `offset` a multiple of 4, so the pointer is
                // aligned for both types; every bit pattern is a valid f32 and u16; the
                // mapping is read-only and lives as long as `self` holds its `Arc`. The file
                // is never written in place (volume files are written whole and renamed into
                // place).
                unsafe {
                    match dtype {
                        KvDtype::F32 => KvSlice::F32(std::slice::from_raw_parts(
                            bytes.as_ptr().cast::<f32>(),
                            *len,
                        )),
                        KvDtype::F16 => KvSlice::F16(std::slice::from_raw_parts(
                            bytes.as_ptr().cast::<u16>(),
                            *len,
                        )),
                    }
                }
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
        debug_assert!(data.slice().len().is_multiple_of(2));
        KvBlock { positions, data }
    }

    /// Copies positions `[start, start + positions)` of a `(layers, kv_heads, n, head_dim)`
    /// slab pair into a new block of the slabs' storage type, checking finiteness as it
    /// copies. `None` if a copied value is not finite (the caller locates it).
    pub(super) fn copy_from<T: KvElem>(
        shape: SlabShape,
        keys: &[T],
        vals: &[T],
        start: usize,
        positions: usize,
    ) -> Option<Self> {
        let run = positions * shape.head_dim;
        let n = shape.layers * shape.kv_heads * run;
        let mut data = vec![T::ZERO; 2 * n];
        let (dst_keys, dst_vals) = data.split_at_mut(n);
        let mut finite = true;
        for (src, dst) in [(keys, dst_keys), (vals, dst_vals)] {
            for (i, out) in dst.chunks_exact_mut(run).enumerate() {
                let (layer, head) = (i / shape.kv_heads, i % shape.kv_heads);
                let from = shape.row_offset(layer, head, start);
                finite &= copy_all_finite(&src[from..from + run], out);
            }
        }
        finite.then(|| KvBlock::new(positions, Floats::Heap(T::heap(data))))
    }

    /// Whether positions `[start, start + positions)` of a slab pair are all finite (the
    /// check an input gets where its block is already cached and need not be copied).
    pub(super) fn rows_finite<T: KvElem>(
        shape: SlabShape,
        keys: &[T],
        vals: &[T],
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

    /// How the values are stored.
    pub fn dtype(&self) -> KvDtype {
        self.data.slice().dtype()
    }

    /// Keys, `(layers, kv_heads, positions, head_dim)`.
    pub fn keys(&self) -> KvSlice<'_> {
        let all = self.data.slice();
        with_elems!(all, v => KvElem::slice(&v[..v.len() / 2]))
    }

    /// Values, `(layers, kv_heads, positions, head_dim)`.
    pub fn vals(&self) -> KvSlice<'_> {
        let all = self.data.slice();
        with_elems!(all, v => KvElem::slice(&v[v.len() / 2..]))
    }

    /// Bytes of keys and values.
    pub fn nbytes(&self) -> usize {
        let all = self.data.slice();
        all.dtype().bytes() * all.len()
    }

    /// Whether the values are mapped from a volume file rather than owned.
    pub fn is_mapped(&self) -> bool {
        matches!(self.data, Floats::Mapped { .. })
    }

    /// A heap copy with `keys[index]` replaced by NaN (fault injection).
    pub(super) fn damaged_copy(&self, index: usize) -> Self {
        let all = self.data.slice();
        let data = with_elems!(all, v => {
            let mut data = v.to_vec();
            data[index] = KvElem::NAN;
            Floats::Heap(KvElem::heap(data))
        });
        KvBlock::new(self.positions, data)
    }
}

impl std::fmt::Debug for KvBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvBlock")
            .field("positions", &self.positions)
            .field("dtype", &self.dtype())
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
