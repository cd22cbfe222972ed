//! One cached prefix volume.

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, OnceLock};

use super::block::KvBlock;
use super::data::entry_bytes;
use super::key::Namespace;
use super::slab::{
    all_finite, copy_all_finite, first_damaged_row, first_non_finite, with_elems, SlabShape,
};
use super::VolumeError;
use crate::ring::{KvDtype, KvSlice};

/// Keys and values, each one slab in [`AmplituhedronVolume::slab_shape`] layout.
pub(super) type Slabs = (Box<[f32]>, Box<[f32]>);

/// One cached prefix volume. Immutable once built; shared as `Arc` with callers. Its KV
/// lives in blocks of [`BLOCK_POSITIONS`](super::BLOCK_POSITIONS) positions that it may share
/// with other volumes of the same model, layer range and tenant whose ids agree up to the
/// block's end. Erasure replaces the cache's `Arc` with a trimmed copy that shares the
/// blocks, so a caller's handle never changes under it.
pub struct AmplituhedronVolume {
    pub(super) namespace: Namespace,
    pub(super) lookup_hash: u64,
    pub(super) digest: [u8; 32],
    pub(super) tokens: Arc<[u32]>,
    /// `positions` is `prefix_len`: the layout of [`kv_keys`](Self::kv_keys).
    pub(super) shape: SlabShape,
    /// Positions the blocks cover: `prefix_len`, or `prefix_len − 1` after an erasure.
    pub(super) kv_len: usize,
    pub(super) tail: Option<Vec<f32>>,
    pub(super) logits: Option<Vec<f32>>,
    /// Consecutive blocks covering positions `[0, prefix_len)`.
    pub(super) blocks: Vec<Arc<KvBlock>>,
    pub(super) drift: f32,
    /// Keys and values as one slab each, assembled on first request.
    pub(super) contiguous: OnceLock<Slabs>,
}

impl AmplituhedronVolume {
    /// Model fingerprint the volume was captured under.
    pub fn model_fingerprint(&self) -> u64 {
        self.namespace.fingerprint
    }

    /// Lookup hash: the wire `prefix_hash` if unsalted, the tenant-keyed one if salted.
    pub fn prefix_hash(&self) -> u64 {
        self.lookup_hash
    }

    /// Full 32-byte BLAKE3 digest of the tokens (keyed by the tenant key when salted).
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// Whether the volume belongs to a salted tenant.
    pub fn is_salted(&self) -> bool {
        self.namespace.salt_key.is_some()
    }

    /// The prefix token ids.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// First layer of the range.
    pub fn layer_lo(&self) -> u16 {
        self.namespace.layer_lo
    }

    /// One past the last layer of the range.
    pub fn layer_hi(&self) -> u16 {
        self.namespace.layer_hi
    }

    /// Number of tokens in the prefix.
    pub fn prefix_len(&self) -> usize {
        self.tokens.len()
    }

    /// Positions the KV covers (`prefix_len`, or `prefix_len − 1` after an erasure).
    pub fn kv_len(&self) -> usize {
        self.kv_len
    }

    /// Whether the trailing position was erased.
    pub fn is_erased(&self) -> bool {
        self.kv_len < self.prefix_len()
    }

    /// How the KV blocks store their values: f32, or f16 bit patterns (a volume captured from
    /// an f16 session: half the bytes, and replay into an f16 ring is a copy).
    pub fn kv_dtype(&self) -> KvDtype {
        self.blocks.first().map_or(KvDtype::F32, |b| b.dtype())
    }

    /// KV heads per layer.
    pub fn kv_heads(&self) -> usize {
        self.shape.kv_heads
    }

    /// Floats per row.
    pub fn head_dim(&self) -> usize {
        self.shape.head_dim
    }

    /// Layout of [`kv_keys`](Self::kv_keys): `positions` is `prefix_len` (the row stride) even
    /// after an erasure; only the first [`kv_len`](Self::kv_len) positions are valid.
    pub fn slab_shape(&self) -> SlabShape {
        self.shape
    }

    /// Tail residual; `None` after an erasure (it described the erased position).
    pub fn tail(&self) -> Option<&[f32]> {
        self.tail.as_deref()
    }

    /// Exit-station logits, if captured and not erased.
    pub fn logits(&self) -> Option<&[f32]> {
        self.logits.as_deref()
    }

    /// The KV blocks, in position order (all of [`BLOCK_POSITIONS`](super::BLOCK_POSITIONS)
    /// positions but possibly the last).
    pub fn blocks(&self) -> &[Arc<KvBlock>] {
        &self.blocks
    }

    /// The blocks holding positions `[0, kv_len)`, each with how many of its positions lie in
    /// that range: what a replay writes into a session, block by block.
    ///
    /// # Panics
    /// If `kv_len` exceeds [`kv_len`](Self::kv_len).
    pub fn blocks_upto(&self, kv_len: usize) -> impl Iterator<Item = (&KvBlock, usize)> + '_ {
        assert!(
            kv_len <= self.kv_len,
            "only {} positions are covered",
            self.kv_len
        );
        let mut start = 0;
        self.blocks.iter().map_while(move |b| {
            let n = b.positions().min(kv_len.saturating_sub(start));
            start += b.positions();
            (n > 0).then_some((&**b, n))
        })
    }

    /// The whole key slab in [`slab_shape`](Self::slab_shape) layout, assembled from the
    /// blocks on first use (one copy per volume; replay reads the blocks instead).
    pub fn kv_keys(&self) -> &[f32] {
        &self.contiguous().0
    }

    /// The whole value slab in [`slab_shape`](Self::slab_shape) layout (see
    /// [`kv_keys`](Self::kv_keys)).
    pub fn kv_vals(&self) -> &[f32] {
        &self.contiguous().1
    }

    fn contiguous(&self) -> &Slabs {
        self.contiguous.get_or_init(|| {
            let s = self.shape;
            let n = s.checked_len().expect("validated at capture");
            let mut keys = vec![0.0f32; n].into_boxed_slice();
            let mut vals = vec![0.0f32; n].into_boxed_slice();
            let mut start = 0;
            for b in &self.blocks {
                let run = b.positions() * s.head_dim;
                for i in 0..s.layers * s.kv_heads {
                    let dst = s.row_offset(i / s.kv_heads, i % s.kv_heads, start);
                    let rows = i * run..(i + 1) * run;
                    b.keys()
                        .slice(rows.clone())
                        .widen_into(&mut keys[dst..dst + run]);
                    b.vals().slice(rows).widen_into(&mut vals[dst..dst + run]);
                }
                start += b.positions();
            }
            (keys, vals)
        })
    }

    /// Pisot drift of the tail at capture.
    pub fn drift(&self) -> f32 {
        self.drift
    }

    /// Logical byte size (formula in the module docs); with shared blocks the cache may hold
    /// less.
    pub fn nbytes(&self) -> usize {
        entry_bytes(
            2 * self.kv_dtype().bytes() * self.shape.checked_len().expect("validated at capture"),
            self.tail.as_ref().map_or(0, Vec::len),
            self.logits.as_ref().map_or(0, Vec::len),
            self.tokens.len(),
        )
    }

    /// Smallest covered position at which any layer/head row of either slab is non-finite.
    pub fn first_non_finite_position(&self) -> Option<usize> {
        let mut start = 0;
        for b in &self.blocks {
            let limit = b.positions().min(self.kv_len.saturating_sub(start));
            if limit == 0 {
                break;
            }
            let shape = SlabShape {
                positions: b.positions(),
                ..self.shape
            };
            let keys = with_elems!(b.keys(), k => first_damaged_row(shape, limit, k)).map(|r| r.2);
            let vals_limit = keys.unwrap_or(limit);
            let vals =
                with_elems!(b.vals(), v => first_damaged_row(shape, vals_limit, v)).map(|r| r.2);
            if let Some(p) = vals.or(keys) {
                return Some(start + p);
            }
            start += b.positions();
        }
        None
    }

    /// Copies the key and value rows `(layer, head, positions)` into `dst_keys` / `dst_vals`
    /// (each `positions.len() × head_dim` floats), checking finiteness as it copies.
    ///
    /// `layer` is absolute (in `[layer_lo, layer_hi)`); positions must lie in `[0, kv_len)`.
    /// On [`VolumeError::NonFiniteKv`] the destinations hold partial data and the runtime
    /// should report the damage ([`AmplituhedronCache::report_damage`](super::AmplituhedronCache::report_damage)).
    pub fn copy_rows_checked(
        &self,
        layer: usize,
        head: usize,
        positions: Range<usize>,
        dst_keys: &mut [f32],
        dst_vals: &mut [f32],
    ) -> Result<(), VolumeError> {
        let out_of_range = || VolumeError::RowsOutOfRange {
            layer,
            head,
            positions: positions.clone(),
        };
        let local = layer
            .checked_sub(usize::from(self.layer_lo()))
            .filter(|&l| l < self.shape.layers)
            .ok_or_else(out_of_range)?;
        if head >= self.shape.kv_heads
            || positions.start > positions.end
            || positions.end > self.kv_len
        {
            return Err(out_of_range());
        }
        let hd = self.shape.head_dim;
        let n = positions.len() * hd;
        for dst in [&*dst_keys, &*dst_vals] {
            if dst.len() != n {
                return Err(VolumeError::DestinationLength {
                    expected: n,
                    actual: dst.len(),
                });
            }
        }
        let mut block_start = 0;
        for b in &self.blocks {
            let block_end = block_start + b.positions();
            let from = positions.start.max(block_start);
            let to = positions.end.min(block_end);
            if from < to {
                let shape = SlabShape {
                    positions: b.positions(),
                    ..self.shape
                };
                let src_at = shape.row_offset(local, head, from - block_start);
                let dst_at = (from - positions.start) * hd;
                let len = (to - from) * hd;
                for (which, src, dst) in [
                    ("kv_keys", b.keys(), &mut *dst_keys),
                    ("kv_vals", b.vals(), &mut *dst_vals),
                ] {
                    let src = src.slice(src_at..src_at + len);
                    let out = &mut dst[dst_at..dst_at + len];
                    let finite = match src {
                        KvSlice::F32(v) => copy_all_finite(v, out),
                        KvSlice::F16(v) => {
                            src.widen_into(out);
                            all_finite(v)
                        }
                    };
                    if !finite {
                        let bad = with_elems!(src, v => first_non_finite(v))
                            .expect("a non-finite value exists");
                        return Err(VolumeError::NonFiniteKv {
                            which,
                            layer,
                            head,
                            position: from + bad / hd,
                        });
                    }
                }
            }
            block_start = block_end;
        }
        Ok(())
    }

    /// A copy with the trailing position erased (its tail and logits described the erased
    /// position, so they go); the blocks are shared, not copied.
    pub(super) fn trimmed(&self) -> Self {
        AmplituhedronVolume {
            kv_len: self.kv_len - 1,
            tail: None,
            logits: None,
            ..self.with_blocks(self.blocks.clone())
        }
    }

    /// A copy holding `blocks` instead of this volume's.
    pub(super) fn with_blocks(&self, blocks: Vec<Arc<KvBlock>>) -> Self {
        AmplituhedronVolume {
            namespace: self.namespace,
            lookup_hash: self.lookup_hash,
            digest: self.digest,
            tokens: Arc::clone(&self.tokens),
            shape: self.shape,
            kv_len: self.kv_len,
            tail: self.tail.clone(),
            logits: self.logits.clone(),
            blocks,
            drift: self.drift,
            contiguous: OnceLock::new(),
        }
    }
}

impl fmt::Debug for AmplituhedronVolume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Metadata only: the slabs are megabytes.
        f.debug_struct("AmplituhedronVolume")
            .field("model_fingerprint", &self.namespace.fingerprint)
            .field("prefix_hash", &self.lookup_hash)
            .field("salted", &self.is_salted())
            .field("layers", &(self.layer_lo()..self.layer_hi()))
            .field("prefix_len", &self.tokens.len())
            .field("kv_len", &self.kv_len)
            .field("kv_heads", &self.shape.kv_heads)
            .field("head_dim", &self.shape.head_dim)
            .field("blocks", &self.blocks.len())
            .field("drift", &self.drift)
            .field("nbytes", &self.nbytes())
            .finish_non_exhaustive()
    }
}
