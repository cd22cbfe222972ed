//! The volume cache: prefilled KV slabs keyed by prompt prefix (SPEC §2, seed 000 §2–3).
//!
//! After a prompt is prefilled, a station **captures** an [`AmplituhedronVolume`]: its KV
//! slab for positions `[0, prefix_len)` over its layer range, the tail residual of the last
//! prefix position and (exit station) that position's logits. A later session with the same
//! prefix **replays** it instead of prefilling.
//!
//! Rules enforced here:
//! - A hit needs the model fingerprint, layer range, tenant salt, the full 32-byte BLAKE3
//!   digest **and** the token ids to match; the 64-bit lookup hash only narrows the scan.
//! - An empty prefix never makes a volume (Lean `clinamen_swerve = 1`); damaged
//!   (non-finite) data never makes a volume; bad input is an error that changes nothing.
//! - The cache is bounded by `max_entries` and `max_bytes` after every operation; victims
//!   are chosen by [`crate::eviction`], never the entry being inserted.
//! - Erasure (Lean `topological_erasure`): damage at the trailing covered position trims
//!   that position once; any other damage clears that one entry, never the whole cache.
//!
//! Byte size of an entry (reported by [`AmplituhedronVolume::nbytes`] and counted against
//! `max_bytes`) is exactly
//! `4 × (2 × prefix_len × layers × kv_heads × head_dim + tail_len + logits_len + prefix_len)`:
//! the two f32 slabs, the f32 tail and logits, and the u32 token ids. The slab term is the
//! Lean `volume = states × constraints` (`prefix_len × layers`) times `2 × kv_heads × head_dim`.
//! Fixed bookkeeping (digest, counters) is not counted.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Weak};

use crate::eviction::{pisot_drift, select_victim, EvictionCandidate, EvictionPolicy};
use crate::keys::{digest_prefix_u64, prefix_digest, salted_prefix_digest, tenant_key, CacheKey};

// ---------------------------------------------------------------------------------------
// Slab layout and finiteness kernels
// ---------------------------------------------------------------------------------------

/// Row-major layout `(layers, kv_heads, positions, head_dim)` of a KV slab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlabShape {
    /// Layers in the station's range (`layer_hi − layer_lo`).
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Positions stored per (layer, head): the prefix length.
    pub positions: usize,
    /// Floats per (layer, head, position) row.
    pub head_dim: usize,
}

impl SlabShape {
    /// The shape of a 4-D array `[layers, kv_heads, positions, head_dim]`.
    pub fn from_dims(dims: [usize; 4]) -> Self {
        let [layers, kv_heads, positions, head_dim] = dims;
        SlabShape {
            layers,
            kv_heads,
            positions,
            head_dim,
        }
    }

    /// `[layers, kv_heads, positions, head_dim]`.
    pub fn dims(&self) -> [usize; 4] {
        [self.layers, self.kv_heads, self.positions, self.head_dim]
    }

    /// Number of floats, or `None` if it overflows `usize`.
    pub fn checked_len(&self) -> Option<usize> {
        self.layers
            .checked_mul(self.kv_heads)?
            .checked_mul(self.positions)?
            .checked_mul(self.head_dim)
    }

    /// Offset of the first float of row `(layer, head, position)` (local layer index).
    pub fn row_offset(&self, layer: usize, head: usize, position: usize) -> usize {
        ((layer * self.kv_heads + head) * self.positions + position) * self.head_dim
    }
}

/// Largest `|bits|` of a finite f32 (as `i32`); anything above is ±inf or NaN.
const MAX_FINITE_ABS_BITS: i32 = 0x7f7f_ffff;
const ABS_MASK: u32 = 0x7fff_ffff;

/// 1 if `v` is ±inf or NaN, else 0. Branch-free integer compare on the magnitude bits, so
/// loops over it vectorise with baseline SSE2 (a float `is_finite` test does not).
#[inline(always)]
fn non_finite_bit(v: f32) -> u32 {
    // The mask clears the sign bit, so the signed compare is exact.
    u32::from((v.to_bits() & ABS_MASK) as i32 > MAX_FINITE_ABS_BITS)
}

/// Whether every value is finite (one vectorised pass, no early exit).
pub fn all_finite(values: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { avx2::all_finite(values) };
    }
    all_finite_portable(values)
}

/// Copies `src` into `dst` (equal lengths) and reports whether every value was finite.
///
/// Works in 4 KiB chunks: each chunk is copied (the compiler's memcpy) and then checked
/// while it is still in L1, so the source is read from memory once even for slabs far
/// larger than the caches.
///
/// # Panics
/// If the lengths differ (callers check them first).
pub fn copy_all_finite(src: &[f32], dst: &mut [f32]) -> bool {
    assert_eq!(src.len(), dst.len(), "copy_all_finite: length mismatch");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { avx2::copy_all_finite(src, dst) };
    }
    copy_all_finite_portable(src, dst)
}

#[inline(always)]
fn all_finite_portable(values: &[f32]) -> bool {
    values.iter().fold(0u32, |bad, &v| bad | non_finite_bit(v)) == 0
}

#[inline(always)]
fn copy_all_finite_portable(src: &[f32], dst: &mut [f32]) -> bool {
    const CHUNK: usize = 1024;
    let mut bad = 0u32;
    for (d, s) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
        d.copy_from_slice(s);
        bad |= s.iter().fold(0u32, |b, &v| b | non_finite_bit(v));
    }
    bad == 0
}

/// The same loops compiled for AVX2 (twice the lanes of the SSE2 baseline for the check),
/// chosen at run time: the crate is built for baseline x86-64, so without this the check
/// would stay SSE2.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn all_finite(values: &[f32]) -> bool {
        super::all_finite_portable(values)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy_all_finite(src: &[f32], dst: &mut [f32]) -> bool {
        super::copy_all_finite_portable(src, dst)
    }
}

/// Index of the first non-finite value, if any.
fn first_non_finite(values: &[f32]) -> Option<usize> {
    values.iter().position(|v| !v.is_finite())
}

/// Smallest position `< kv_len` at which any layer/head row of `slab` holds a non-finite
/// value, with the (local layer, head) where it was found first.
fn first_damaged_row(
    shape: SlabShape,
    kv_len: usize,
    slab: &[f32],
) -> Option<(usize, usize, usize)> {
    let mut found: Option<(usize, usize, usize)> = None;
    for layer in 0..shape.layers {
        for head in 0..shape.kv_heads {
            // Only positions before the best hit so far can improve it.
            let limit = found.map_or(kv_len, |(_, _, p)| p);
            let start = shape.row_offset(layer, head, 0);
            let block = &slab[start..start + limit * shape.head_dim];
            if !all_finite(block) {
                let bad = first_non_finite(block).expect("a non-finite value exists");
                found = Some((layer, head, bad / shape.head_dim));
            }
        }
    }
    found
}

// ---------------------------------------------------------------------------------------
// Errors and outcomes
// ---------------------------------------------------------------------------------------

/// Bad input to the volume cache. Returned before any state changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeError {
    /// Zero tokens: an empty prefix has no volume (Lean `clinamen_swerve = 1`).
    EmptyPrefix,
    /// `layer_lo >= layer_hi`.
    EmptyLayerRange {
        /// First layer.
        layer_lo: u16,
        /// One past the last layer.
        layer_hi: u16,
    },
    /// A KV slab dimension disagrees with the layer range or the prefix length.
    SlabDimension {
        /// Which dimension (e.g. `"layers (dim 0)"`).
        dim: &'static str,
        /// What the key implies.
        expected: usize,
        /// What the slab has.
        actual: usize,
    },
    /// `kv_heads` or `head_dim` is zero.
    ZeroDimension {
        /// Which dimension.
        dim: &'static str,
    },
    /// The slab's float count does not fit `usize`.
    SlabTooLarge,
    /// A slab's length is not `layers × kv_heads × prefix_len × head_dim`.
    SlabLength {
        /// `"kv_keys"` or `"kv_vals"`.
        which: &'static str,
        /// `layers × kv_heads × prefix_len × head_dim`.
        expected: usize,
        /// The slab's length.
        actual: usize,
    },
    /// The tail residual is empty (it is `hidden_dim` floats).
    EmptyTail,
    /// Logits were given but empty.
    EmptyLogits,
    /// A non-finite value in the tail residual or the logits.
    NonFinite {
        /// `"tail"` or `"logits"`.
        what: &'static str,
        /// Index of the first non-finite value.
        index: usize,
    },
    /// A non-finite value in a KV slab.
    NonFiniteKv {
        /// `"kv_keys"` or `"kv_vals"`.
        which: &'static str,
        /// Absolute layer index.
        layer: usize,
        /// KV head.
        head: usize,
        /// Position (token index).
        position: usize,
    },
    /// A damage report names a position the volume does not cover.
    DamageOutOfRange {
        /// The reported position.
        position: usize,
        /// Positions covered by the volume.
        kv_len: usize,
    },
    /// A row copy asked for a layer, head or position range the volume does not hold.
    RowsOutOfRange {
        /// Absolute layer index asked for.
        layer: usize,
        /// Head asked for.
        head: usize,
        /// Positions asked for.
        positions: Range<usize>,
    },
    /// A row-copy destination has the wrong length.
    DestinationLength {
        /// `positions.len() × head_dim`.
        expected: usize,
        /// The destination's length.
        actual: usize,
    },
    /// A configuration value out of range (every limit must be at least 1).
    InvalidConfig {
        /// Which setting.
        setting: &'static str,
    },
}

impl fmt::Display for VolumeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VolumeError::EmptyPrefix => {
                f.write_str("empty prefix: a volume needs at least one token (clinamen_swerve = 1)")
            }
            VolumeError::EmptyLayerRange { layer_lo, layer_hi } => write!(
                f,
                "empty layer range: layer_lo ({layer_lo}) must be < layer_hi ({layer_hi})"
            ),
            VolumeError::SlabDimension {
                dim,
                expected,
                actual,
            } => write!(
                f,
                "KV slab {dim} is {actual}, expected {expected} \
                 (layout: layer_hi - layer_lo, kv_heads, prefix_len, head_dim)"
            ),
            VolumeError::ZeroDimension { dim } => write!(f, "KV slab {dim} must be at least 1"),
            VolumeError::SlabTooLarge => f.write_str("KV slab size overflows usize"),
            VolumeError::SlabLength {
                which,
                expected,
                actual,
            } => write!(
                f,
                "{which} has {actual} floats, expected layers × kv_heads × prefix_len × \
                 head_dim = {expected}"
            ),
            VolumeError::EmptyTail => {
                f.write_str("tail residual is empty (it must hold hidden_dim floats)")
            }
            VolumeError::EmptyLogits => f.write_str("logits were given but are empty"),
            VolumeError::NonFinite { what, index } => write!(
                f,
                "{what} has a non-finite value at index {index}: a volume is never built \
                 from damaged data"
            ),
            VolumeError::NonFiniteKv {
                which,
                layer,
                head,
                position,
            } => write!(
                f,
                "{which} has a non-finite value at layer {layer}, head {head}, position \
                 {position}: a volume is never built from damaged data"
            ),
            VolumeError::DamageOutOfRange { position, kv_len } => write!(
                f,
                "damage position {position} is outside the volume's covered positions \
                 [0, {kv_len})"
            ),
            VolumeError::RowsOutOfRange {
                layer,
                head,
                positions,
            } => write!(
                f,
                "rows (layer {layer}, head {head}, positions {}..{}) are outside the volume",
                positions.start, positions.end
            ),
            VolumeError::DestinationLength { expected, actual } => write!(
                f,
                "destination holds {actual} floats, expected positions × head_dim = {expected}"
            ),
            VolumeError::InvalidConfig { setting } => {
                write!(f, "{setting} must be at least 1")
            }
        }
    }
}

impl std::error::Error for VolumeError {}

/// What a valid [`AmplituhedronCache::capture`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureOutcome {
    /// A new entry of `bytes` bytes was stored.
    Stored {
        /// The entry's byte size.
        bytes: usize,
    },
    /// The same key and content is already cached (a concurrent capture): nothing stored.
    /// (An entry that was trimmed by an erasure is replaced instead: `Stored`.)
    AlreadyPresent {
        /// The resident entry's byte size.
        bytes: usize,
    },
    /// The prefix is longer than `max_prefix_len`: not captured (not an error).
    SkippedTooLong {
        /// The prefix length.
        prefix_len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// The entry alone is larger than `max_bytes`: not captured.
    SkippedTooLarge {
        /// The entry's byte size.
        bytes: usize,
        /// The configured maximum.
        max: usize,
    },
    /// The cache is disabled: nothing stored, nothing counted.
    Disabled,
    /// Stored after dropping `cleared` entries that drifted (same lookup hash and layer range
    /// but another model fingerprint — all entries of that fingerprint go — or other ids).
    StoredAfterDrift {
        /// The new entry's byte size.
        bytes: usize,
        /// Entries dropped.
        cleared: usize,
    },
}

impl CaptureOutcome {
    /// Bytes of the entry now cached for this key, 0 when nothing is (skipped or disabled).
    pub fn cached_bytes(&self) -> usize {
        match *self {
            CaptureOutcome::Stored { bytes }
            | CaptureOutcome::AlreadyPresent { bytes }
            | CaptureOutcome::StoredAfterDrift { bytes, .. } => bytes,
            CaptureOutcome::SkippedTooLong { .. }
            | CaptureOutcome::SkippedTooLarge { .. }
            | CaptureOutcome::Disabled => 0,
        }
    }
}

/// What [`AmplituhedronCache::report_damage`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DamageOutcome {
    /// The trailing position was stripped; the volume now covers `kv_len` positions.
    Trimmed {
        /// Positions still covered (`prefix_len − 1`).
        kv_len: usize,
    },
    /// The entry was dropped (damage before the trailing position, or a second erasure).
    Cleared,
    /// No such entry is cached.
    Absent,
}

/// Counters and occupancy of an [`AmplituhedronCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Replays that returned a volume.
    pub hits: u64,
    /// Replays that did not (while enabled).
    pub misses: u64,
    /// Entries removed to respect `max_entries` / `max_bytes`.
    pub evictions: u64,
    /// Entries resident now.
    pub entries: usize,
    /// Bytes resident now (sum of [`AmplituhedronVolume::nbytes`]).
    pub bytes: usize,
    /// Captures that stored an entry.
    pub captures: u64,
    /// Captures skipped for exceeding `max_prefix_len`.
    pub skipped_too_long: u64,
    /// Captures skipped for exceeding `max_bytes` on their own.
    pub skipped_too_large: u64,
    /// Entries dropped because a capture revealed drift (model change or u64 collision).
    pub drift_clears: u64,
    /// Damage reports that trimmed or cleared an entry.
    pub erasures: u64,
    /// Replays that missed exactly but reused the longest cached shared prefix.
    pub prefix_hits: u64,
}

impl CacheStats {
    /// Every counter by name, in a fixed order (the bindings' and the station's dict form).
    pub fn as_pairs(&self) -> [(&'static str, u64); 11] {
        [
            ("hits", self.hits),
            ("misses", self.misses),
            ("evictions", self.evictions),
            ("entries", self.entries as u64),
            ("bytes", self.bytes as u64),
            ("captures", self.captures),
            ("skipped_too_long", self.skipped_too_long),
            ("skipped_too_large", self.skipped_too_large),
            ("drift_clears", self.drift_clears),
            ("erasures", self.erasures),
            ("prefix_hits", self.prefix_hits),
        ]
    }
}

// ---------------------------------------------------------------------------------------
// Keys and captured data
// ---------------------------------------------------------------------------------------

/// Everything that addresses a volume: model, prefix tokens, layer range, tenant salt.
#[derive(Debug, Clone, Copy)]
pub struct VolumeKey<'a> {
    /// Hash of the model's content (weights + config).
    pub model_fingerprint: u64,
    /// The prefix token ids (`prefix_len` of them).
    pub tokens: &'a [u32],
    /// First layer of the station's range.
    pub layer_lo: u16,
    /// One past its last layer.
    pub layer_hi: u16,
    /// Optional tenant salt; salted and unsalted (or differently salted) keys never meet.
    pub salt: Option<&'a str>,
}

impl VolumeKey<'_> {
    /// Checks the key on its own: a non-empty prefix and a non-empty layer range.
    pub fn validate(&self) -> Result<(), VolumeError> {
        if self.tokens.is_empty() {
            return Err(VolumeError::EmptyPrefix);
        }
        if self.layer_lo >= self.layer_hi {
            return Err(VolumeError::EmptyLayerRange {
                layer_lo: self.layer_lo,
                layer_hi: self.layer_hi,
            });
        }
        Ok(())
    }

    /// The lookup hash: the wire `prefix_hash` without a salt, else the first 8 bytes of the
    /// BLAKE3 digest keyed by `BLAKE3(salt)`.
    pub fn lookup_hash(&self) -> u64 {
        PrefixIdentity::of(self).lookup_hash
    }

    /// This key in the tagged key space shared with the matvec memo.
    pub fn cache_key(&self) -> CacheKey {
        CacheKey::Volume {
            model_fingerprint: self.model_fingerprint,
            prefix_hash: self.lookup_hash(),
            layer_lo: self.layer_lo,
            layer_hi: self.layer_hi,
        }
    }
}

/// Borrowed volume data for [`AmplituhedronCache::capture`] (copied once into the cache).
#[derive(Debug, Clone, Copy)]
pub struct VolumeData<'a> {
    /// `[layer_hi − layer_lo, kv_heads, prefix_len, head_dim]` of both slabs.
    pub kv_shape: [usize; 4],
    /// Hidden state emitted for the last prefix position (`hidden_dim` floats).
    pub tail: &'a [f32],
    /// Key slab, row-major in `kv_shape`.
    pub kv_keys: &'a [f32],
    /// Value slab, row-major in `kv_shape`.
    pub kv_vals: &'a [f32],
    /// The exit station's logits for the last prefix position.
    pub logits: Option<&'a [f32]>,
}

/// Owned volume data for [`AmplituhedronCache::capture_owned`]: the slabs move into the
/// cache without another copy.
#[derive(Debug, Clone)]
pub struct OwnedVolumeData {
    /// `[layer_hi − layer_lo, kv_heads, prefix_len, head_dim]` of both slabs.
    pub kv_shape: [usize; 4],
    /// Hidden state emitted for the last prefix position (`hidden_dim` floats).
    pub tail: Vec<f32>,
    /// Key slab, row-major in `kv_shape`.
    pub kv_keys: Vec<f32>,
    /// Value slab, row-major in `kv_shape`.
    pub kv_vals: Vec<f32>,
    /// The exit station's logits for the last prefix position.
    pub logits: Option<Vec<f32>>,
}

/// Both capture variants, borrowed or owned, so one code path validates and stores them.
struct IncomingVolume<'a> {
    shape: SlabShape,
    tail: Cow<'a, [f32]>,
    kv_keys: Cow<'a, [f32]>,
    kv_vals: Cow<'a, [f32]>,
    logits: Option<Cow<'a, [f32]>>,
}

impl<'a> From<VolumeData<'a>> for IncomingVolume<'a> {
    fn from(d: VolumeData<'a>) -> Self {
        IncomingVolume {
            shape: SlabShape::from_dims(d.kv_shape),
            tail: Cow::Borrowed(d.tail),
            kv_keys: Cow::Borrowed(d.kv_keys),
            kv_vals: Cow::Borrowed(d.kv_vals),
            logits: d.logits.map(Cow::Borrowed),
        }
    }
}

impl From<OwnedVolumeData> for IncomingVolume<'static> {
    fn from(d: OwnedVolumeData) -> Self {
        IncomingVolume {
            shape: SlabShape::from_dims(d.kv_shape),
            tail: Cow::Owned(d.tail),
            kv_keys: Cow::Owned(d.kv_keys),
            kv_vals: Cow::Owned(d.kv_vals),
            logits: d.logits.map(Cow::Owned),
        }
    }
}

impl IncomingVolume<'_> {
    /// Checks shapes, lengths, tail and logits against the key (cheap; no slab scan).
    fn validate_shape(&self, key: &VolumeKey<'_>) -> Result<(), VolumeError> {
        key.validate()?;
        let layers = usize::from(key.layer_hi - key.layer_lo);
        let s = self.shape;
        if s.layers != layers {
            return Err(VolumeError::SlabDimension {
                dim: "layers (dim 0)",
                expected: layers,
                actual: s.layers,
            });
        }
        if s.positions != key.tokens.len() {
            return Err(VolumeError::SlabDimension {
                dim: "positions (dim 2, must equal prefix_len)",
                expected: key.tokens.len(),
                actual: s.positions,
            });
        }
        if s.kv_heads == 0 {
            return Err(VolumeError::ZeroDimension {
                dim: "kv_heads (dim 1)",
            });
        }
        if s.head_dim == 0 {
            return Err(VolumeError::ZeroDimension {
                dim: "head_dim (dim 3)",
            });
        }
        let expected = s.checked_len().ok_or(VolumeError::SlabTooLarge)?;
        for (which, slab) in [("kv_keys", &self.kv_keys), ("kv_vals", &self.kv_vals)] {
            if slab.len() != expected {
                return Err(VolumeError::SlabLength {
                    which,
                    expected,
                    actual: slab.len(),
                });
            }
        }
        if self.tail.is_empty() {
            return Err(VolumeError::EmptyTail);
        }
        if let Some(index) = first_non_finite(&self.tail) {
            return Err(VolumeError::NonFinite {
                what: "tail",
                index,
            });
        }
        if let Some(logits) = &self.logits {
            if logits.is_empty() {
                return Err(VolumeError::EmptyLogits);
            }
            if let Some(index) = first_non_finite(logits) {
                return Err(VolumeError::NonFinite {
                    what: "logits",
                    index,
                });
            }
        }
        Ok(())
    }

    /// Byte size the entry will have (see the module docs for the formula).
    fn entry_bytes(&self) -> usize {
        entry_bytes(
            self.kv_keys.len() + self.kv_vals.len(),
            self.tail.len(),
            self.logits.as_ref().map_or(0, |l| l.len()),
            self.shape.positions,
        )
    }

    /// Checks both slabs for non-finite values without copying them.
    fn check_slabs(&self, layer_lo: u16) -> Result<(), VolumeError> {
        for (which, slab) in [("kv_keys", &self.kv_keys), ("kv_vals", &self.kv_vals)] {
            if !all_finite(slab) {
                return Err(locate_slab_damage(self.shape, which, slab, layer_lo));
            }
        }
        Ok(())
    }
}

/// A checked, owned slab: a borrowed slab is copied once with the check fused into the copy;
/// an owned one is checked and moved (no copy).
fn checked_slab(
    shape: SlabShape,
    which: &'static str,
    slab: Cow<'_, [f32]>,
    layer_lo: u16,
) -> Result<Vec<f32>, VolumeError> {
    match slab {
        Cow::Borrowed(src) => {
            // Zeroed allocation of a large buffer is lazily-mapped zero pages: no extra pass.
            let mut dst = vec![0.0f32; src.len()];
            if copy_all_finite(src, &mut dst) {
                Ok(dst)
            } else {
                Err(locate_slab_damage(shape, which, src, layer_lo))
            }
        }
        Cow::Owned(v) => {
            if all_finite(&v) {
                Ok(v)
            } else {
                Err(locate_slab_damage(shape, which, &v, layer_lo))
            }
        }
    }
}

/// The error for a slab known to hold a non-finite value, naming where it is.
fn locate_slab_damage(
    shape: SlabShape,
    which: &'static str,
    slab: &[f32],
    layer_lo: u16,
) -> VolumeError {
    let (layer, head, position) =
        first_damaged_row(shape, shape.positions, slab).expect("caller saw a non-finite value");
    VolumeError::NonFiniteKv {
        which,
        layer: usize::from(layer_lo) + layer,
        head,
        position,
    }
}

/// Byte size of an entry: f32 slabs, tail and logits plus the u32 token ids.
fn entry_bytes(slab_floats: usize, tail_len: usize, logits_len: usize, prefix_len: usize) -> usize {
    4 * (slab_floats + tail_len + logits_len + prefix_len)
}

/// How a probe identifies a prefix: the digest (keyed when salted) and its u64 prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PrefixIdentity {
    digest: [u8; 32],
    lookup_hash: u64,
    salt_key: Option<[u8; 32]>,
}

impl PrefixIdentity {
    fn of(key: &VolumeKey<'_>) -> Self {
        let salt_key = key.salt.map(tenant_key);
        let digest = match &salt_key {
            Some(k) => salted_prefix_digest(key.tokens, k),
            None => prefix_digest(key.tokens),
        };
        PrefixIdentity {
            digest,
            lookup_hash: digest_prefix_u64(&digest),
            salt_key,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The volume
// ---------------------------------------------------------------------------------------

/// One cached prefix volume. Immutable once built; shared as `Arc` with callers (the
/// Python views borrow its slabs zero-copy). Erasure replaces the cache's `Arc` with a
/// trimmed copy that shares the slabs, so a caller's handle never changes under it.
pub struct AmplituhedronVolume {
    model_fingerprint: u64,
    lookup_hash: u64,
    digest: [u8; 32],
    salt_key: Option<[u8; 32]>,
    tokens: Vec<u32>,
    layer_lo: u16,
    layer_hi: u16,
    /// `positions` is `prefix_len`, the stride of the slabs.
    shape: SlabShape,
    /// Positions the slabs cover: `prefix_len`, or `prefix_len − 1` after an erasure.
    kv_len: usize,
    tail: Option<Vec<f32>>,
    logits: Option<Vec<f32>>,
    kv_keys: Arc<Vec<f32>>,
    kv_vals: Arc<Vec<f32>>,
    drift: f32,
}

impl AmplituhedronVolume {
    /// Model fingerprint the volume was captured under.
    pub fn model_fingerprint(&self) -> u64 {
        self.model_fingerprint
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
        self.salt_key.is_some()
    }

    /// The prefix token ids.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// First layer of the range.
    pub fn layer_lo(&self) -> u16 {
        self.layer_lo
    }

    /// One past the last layer of the range.
    pub fn layer_hi(&self) -> u16 {
        self.layer_hi
    }

    /// Number of tokens in the prefix.
    pub fn prefix_len(&self) -> usize {
        self.tokens.len()
    }

    /// Positions the slabs cover (`prefix_len`, or `prefix_len − 1` after an erasure).
    pub fn kv_len(&self) -> usize {
        self.kv_len
    }

    /// Whether the trailing position was erased.
    pub fn is_erased(&self) -> bool {
        self.kv_len < self.prefix_len()
    }

    /// KV heads per layer.
    pub fn kv_heads(&self) -> usize {
        self.shape.kv_heads
    }

    /// Floats per row.
    pub fn head_dim(&self) -> usize {
        self.shape.head_dim
    }

    /// Storage layout of the slabs: `positions` is `prefix_len` (the row stride) even after
    /// an erasure; only the first [`kv_len`](Self::kv_len) positions are valid.
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

    /// The whole key slab in [`slab_shape`](Self::slab_shape) layout.
    pub fn kv_keys(&self) -> &[f32] {
        &self.kv_keys
    }

    /// The whole value slab in [`slab_shape`](Self::slab_shape) layout.
    pub fn kv_vals(&self) -> &[f32] {
        &self.kv_vals
    }

    /// Pisot drift of the tail at capture.
    pub fn drift(&self) -> f32 {
        self.drift
    }

    /// Byte size counted against `max_bytes` (formula in the module docs).
    pub fn nbytes(&self) -> usize {
        entry_bytes(
            self.kv_keys.len() + self.kv_vals.len(),
            self.tail.as_ref().map_or(0, Vec::len),
            self.logits.as_ref().map_or(0, Vec::len),
            self.tokens.len(),
        )
    }

    /// Smallest covered position at which any layer/head row of either slab is non-finite.
    pub fn first_non_finite_position(&self) -> Option<usize> {
        let keys = first_damaged_row(self.shape, self.kv_len, &self.kv_keys).map(|r| r.2);
        let limit = keys.unwrap_or(self.kv_len);
        let vals = first_damaged_row(self.shape, limit, &self.kv_vals).map(|r| r.2);
        vals.or(keys)
    }

    /// Copies the key and value rows `(layer, head, positions)` into `dst_keys` / `dst_vals`
    /// (each `positions.len() × head_dim` floats), checking finiteness as it copies.
    ///
    /// `layer` is absolute (in `[layer_lo, layer_hi)`); positions must lie in `[0, kv_len)`.
    /// On [`VolumeError::NonFiniteKv`] the destinations hold partial data and the runtime
    /// should report the damage ([`AmplituhedronCache::report_damage`]).
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
            .checked_sub(usize::from(self.layer_lo))
            .filter(|&l| l < self.shape.layers)
            .ok_or_else(out_of_range)?;
        if head >= self.shape.kv_heads
            || positions.start > positions.end
            || positions.end > self.kv_len
        {
            return Err(out_of_range());
        }
        let n = positions.len() * self.shape.head_dim;
        for dst in [&*dst_keys, &*dst_vals] {
            if dst.len() != n {
                return Err(VolumeError::DestinationLength {
                    expected: n,
                    actual: dst.len(),
                });
            }
        }
        let start = self.shape.row_offset(local, head, positions.start);
        for (which, src, dst) in [
            ("kv_keys", &self.kv_keys, &mut *dst_keys),
            ("kv_vals", &self.kv_vals, &mut *dst_vals),
        ] {
            let src = &src[start..start + n];
            if !copy_all_finite(src, dst) {
                let bad = first_non_finite(src).expect("a non-finite value exists");
                return Err(VolumeError::NonFiniteKv {
                    which,
                    layer,
                    head,
                    position: positions.start + bad / self.shape.head_dim,
                });
            }
        }
        Ok(())
    }

    fn matches(&self, key: &VolumeKey<'_>, id: &PrefixIdentity) -> bool {
        self.lookup_hash == id.lookup_hash
            && self.model_fingerprint == key.model_fingerprint
            && self.layer_lo == key.layer_lo
            && self.layer_hi == key.layer_hi
            && self.salt_key == id.salt_key
            && self.digest == id.digest
            && self.tokens == key.tokens
    }

    /// The same slot as `key` (lookup hash and layer range) — a match or a drift.
    fn same_slot(&self, key: &VolumeKey<'_>, id: &PrefixIdentity) -> bool {
        self.lookup_hash == id.lookup_hash
            && self.layer_lo == key.layer_lo
            && self.layer_hi == key.layer_hi
    }

    /// A copy with the trailing position erased (its tail and logits described the erased
    /// position, so they go); the slabs are shared, not copied.
    fn trimmed(&self) -> Self {
        AmplituhedronVolume {
            model_fingerprint: self.model_fingerprint,
            lookup_hash: self.lookup_hash,
            digest: self.digest,
            salt_key: self.salt_key,
            tokens: self.tokens.clone(),
            layer_lo: self.layer_lo,
            layer_hi: self.layer_hi,
            shape: self.shape,
            kv_len: self.kv_len - 1,
            tail: None,
            logits: None,
            kv_keys: Arc::clone(&self.kv_keys),
            kv_vals: Arc::clone(&self.kv_vals),
            drift: self.drift,
        }
    }
}

impl fmt::Debug for AmplituhedronVolume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Metadata only: the slabs are megabytes.
        f.debug_struct("AmplituhedronVolume")
            .field("model_fingerprint", &self.model_fingerprint)
            .field("prefix_hash", &self.lookup_hash)
            .field("salted", &self.salt_key.is_some())
            .field("layers", &(self.layer_lo..self.layer_hi))
            .field("prefix_len", &self.tokens.len())
            .field("kv_len", &self.kv_len)
            .field("kv_heads", &self.shape.kv_heads)
            .field("head_dim", &self.shape.head_dim)
            .field("drift", &self.drift)
            .field("nbytes", &self.nbytes())
            .finish_non_exhaustive()
    }
}

// ---------------------------------------------------------------------------------------
// The cache
// ---------------------------------------------------------------------------------------

/// Limits and policy of an [`AmplituhedronCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// Most entries resident at once (default 4).
    pub max_entries: usize,
    /// Longest prefix captured (default 512).
    pub max_prefix_len: usize,
    /// Most bytes resident at once (default: unbounded).
    pub max_bytes: Option<usize>,
    /// Victim choice when full (default Pisot-guard).
    pub policy: EvictionPolicy,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            max_entries: 4,
            max_prefix_len: 512,
            max_bytes: None,
            policy: EvictionPolicy::PisotGuard,
        }
    }
}

impl CacheConfig {
    /// Every limit must be at least 1.
    pub fn validate(&self) -> Result<(), VolumeError> {
        check_limit("max_entries", self.max_entries)?;
        check_limit("max_prefix_len", self.max_prefix_len)?;
        if let Some(b) = self.max_bytes {
            check_limit("max_bytes", b)?;
        }
        Ok(())
    }
}

fn check_limit(setting: &'static str, value: usize) -> Result<(), VolumeError> {
    if value == 0 {
        Err(VolumeError::InvalidConfig { setting })
    } else {
        Ok(())
    }
}

#[derive(Debug)]
struct Entry {
    volume: Arc<AmplituhedronVolume>,
    last_used: u64,
}

impl Entry {
    fn candidate(&self) -> EvictionCandidate {
        EvictionCandidate {
            drift: self.volume.drift,
            last_used: self.last_used,
        }
    }
}

/// A station's bounded cache of prefix volumes. Small N: a linear scan over entries.
#[derive(Debug)]
pub struct AmplituhedronCache {
    config: CacheConfig,
    enabled: bool,
    entries: Vec<Entry>,
    /// Logical clock: bumped on every capture and replay while enabled.
    tick: u64,
    stats: CacheStats,
    /// The volume of the last hit, for [`AmplituhedronCache::tail`].
    last_hit: Weak<AmplituhedronVolume>,
}

impl Default for AmplituhedronCache {
    fn default() -> Self {
        Self::new(CacheConfig::default()).expect("the default config is valid")
    }
}

impl AmplituhedronCache {
    /// An empty, enabled cache; fails if a limit is zero.
    pub fn new(config: CacheConfig) -> Result<Self, VolumeError> {
        config.validate()?;
        Ok(AmplituhedronCache {
            config,
            enabled: true,
            entries: Vec::new(),
            tick: 0,
            stats: CacheStats::default(),
            last_hit: Weak::new(),
        })
    }

    /// Turns the cache on or off. Off: captures return `Disabled`, replays miss silently;
    /// entries are kept.
    pub fn enable(&mut self, on: bool) {
        self.enabled = on;
    }

    /// Whether the cache is on.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Current limits and policy.
    pub fn config(&self) -> CacheConfig {
        self.config
    }

    /// Sets the entry limit (≥ 1) and evicts down to it at once.
    pub fn set_max_entries(&mut self, n: usize) -> Result<(), VolumeError> {
        check_limit("max_entries", n)?;
        self.config.max_entries = n;
        self.evict_to_fit(0, 0);
        Ok(())
    }

    /// Sets the longest prefix future captures accept (≥ 1). Resident entries stay.
    pub fn set_max_prefix_len(&mut self, n: usize) -> Result<(), VolumeError> {
        check_limit("max_prefix_len", n)?;
        self.config.max_prefix_len = n;
        Ok(())
    }

    /// Sets the byte limit (`None` = unbounded, else ≥ 1) and evicts down to it at once.
    pub fn set_max_bytes(&mut self, n: Option<usize>) -> Result<(), VolumeError> {
        if let Some(b) = n {
            check_limit("max_bytes", b)?;
        }
        self.config.max_bytes = n;
        self.evict_to_fit(0, 0);
        Ok(())
    }

    /// Sets the eviction policy.
    pub fn set_policy(&mut self, policy: EvictionPolicy) {
        self.config.policy = policy;
    }

    /// Drops every entry (counters are kept).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.stats.entries = 0;
        self.stats.bytes = 0;
        self.last_hit = Weak::new();
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Entries resident.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is resident.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Captures a volume, copying the borrowed slabs once (with the finiteness check fused
    /// into the copy). Validates everything before touching state.
    pub fn capture(
        &mut self,
        key: &VolumeKey<'_>,
        data: VolumeData<'_>,
    ) -> Result<CaptureOutcome, VolumeError> {
        self.capture_identified(key, PrefixIdentity::of(key), data.into())
    }

    /// Like [`capture`](Self::capture), but moves owned slabs in without copying them.
    pub fn capture_owned(
        &mut self,
        key: &VolumeKey<'_>,
        data: OwnedVolumeData,
    ) -> Result<CaptureOutcome, VolumeError> {
        self.capture_identified(key, PrefixIdentity::of(key), data.into())
    }

    /// Looks the key up; a hit needs fingerprint, layer range, salt, digest and token ids to
    /// match. Errors only for an invalid key (empty prefix or layer range). Disabled: `None`
    /// without counting.
    pub fn replay(
        &mut self,
        key: &VolumeKey<'_>,
    ) -> Result<Option<Arc<AmplituhedronVolume>>, VolumeError> {
        key.validate()?;
        Ok(self.replay_identified(key, &PrefixIdentity::of(key)))
    }

    /// Longest-prefix replay (SPEC §2, beyond the seeds): after an exact miss, the cached
    /// volume (same model, layer range and salt) sharing the longest token prefix with
    /// `key`, and how many of its positions can serve `key`: the shared length, capped by
    /// the volume's covered positions and by `len − 1` (the last prompt position is always
    /// computed, so its logits and tail are fresh). Only reuses of at least `min_reuse`
    /// positions count; KV for a position depends only on the tokens before it, so the
    /// reused positions equal what prefill would compute. Compares token ids directly, so
    /// a hash never decides. Counted in `prefix_hits`; a disabled cache reuses nothing.
    pub fn replay_longest_prefix(
        &mut self,
        key: &VolumeKey<'_>,
        min_reuse: usize,
    ) -> Result<Option<(Arc<AmplituhedronVolume>, usize)>, VolumeError> {
        key.validate()?;
        if !self.enabled {
            return Ok(None);
        }
        let id = PrefixIdentity::of(key);
        let cap = key.tokens.len() - 1;
        let mut best: Option<(usize, usize)> = None; // (entry index, reusable positions)
        for (i, e) in self.entries.iter().enumerate() {
            let v = &e.volume;
            if v.model_fingerprint != key.model_fingerprint
                || (v.layer_lo, v.layer_hi) != (key.layer_lo, key.layer_hi)
                || v.salt_key != id.salt_key
            {
                continue;
            }
            let shared = v
                .tokens
                .iter()
                .zip(key.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            let usable = shared.min(v.kv_len).min(cap);
            let better = match best {
                None => true,
                Some((j, u)) => {
                    usable > u || (usable == u && e.last_used > self.entries[j].last_used)
                }
            };
            if usable >= min_reuse.max(1) && better {
                best = Some((i, usable));
            }
        }
        let Some((i, usable)) = best else {
            return Ok(None);
        };
        self.tick += 1;
        self.entries[i].last_used = self.tick;
        self.stats.prefix_hits += 1;
        Ok(Some((Arc::clone(&self.entries[i].volume), usable)))
    }

    /// Tail residual of the most recent hit, if its lookup hash is `prefix_hash` and it is
    /// still resident (seed 000 §2: the accessor the replay flow uses after a hit).
    ///
    /// It only ever answers for a volume a full replay verified, so a bare u64 never
    /// decides which volume's data is returned.
    pub fn tail(&self, prefix_hash: u64) -> Option<Vec<f32>> {
        let vol = self.last_hit.upgrade()?;
        if vol.lookup_hash != prefix_hash
            || !self.entries.iter().any(|e| Arc::ptr_eq(&e.volume, &vol))
        {
            return None;
        }
        vol.tail.clone()
    }

    /// Fault injection for tests and failure drills: overwrites the key slab of `key`'s
    /// volume at `position` (first layer, head and dimension) with NaN, as memory corruption
    /// would. Returns whether an entry was found. Never used by the runtime itself.
    pub fn inject_fault(
        &mut self,
        key: &VolumeKey<'_>,
        position: usize,
    ) -> Result<bool, VolumeError> {
        key.validate()?;
        let id = PrefixIdentity::of(key);
        let Some(entry) = self.entries.iter_mut().find(|e| e.volume.matches(key, &id)) else {
            return Ok(false);
        };
        let vol = &entry.volume;
        if position >= vol.kv_len {
            return Err(VolumeError::DamageOutOfRange {
                position,
                kv_len: vol.kv_len,
            });
        }
        let mut keys = vol.kv_keys.as_ref().clone();
        keys[vol.shape.row_offset(0, 0, position)] = f32::NAN;
        let mut damaged = vol.trimmed();
        damaged.kv_len = vol.kv_len;
        damaged.tail.clone_from(&vol.tail);
        damaged.logits.clone_from(&vol.logits);
        damaged.kv_keys = Arc::new(keys);
        entry.volume = Arc::new(damaged);
        Ok(true)
    }

    /// Reports damage found at `position` while replaying `key`'s volume (Lean
    /// `topological_erasure`): the trailing covered position of a never-erased volume is
    /// trimmed once; any other damage clears that one entry. Other entries are untouched.
    pub fn report_damage(
        &mut self,
        key: &VolumeKey<'_>,
        position: usize,
    ) -> Result<DamageOutcome, VolumeError> {
        key.validate()?;
        let id = PrefixIdentity::of(key);
        let Some(idx) = self.entries.iter().position(|e| e.volume.matches(key, &id)) else {
            return Ok(DamageOutcome::Absent);
        };
        let vol = &self.entries[idx].volume;
        let kv_len = vol.kv_len;
        if position >= kv_len {
            return Err(VolumeError::DamageOutOfRange { position, kv_len });
        }
        self.stats.erasures += 1;
        // Trimming to zero positions would leave an empty volume, which cannot exist.
        if position + 1 == kv_len && !vol.is_erased() && kv_len > 1 {
            let trimmed = Arc::new(vol.trimmed());
            self.stats.bytes = self.stats.bytes - vol.nbytes() + trimmed.nbytes();
            self.entries[idx].volume = trimmed;
            Ok(DamageOutcome::Trimmed { kv_len: kv_len - 1 })
        } else {
            self.remove_at(idx);
            Ok(DamageOutcome::Cleared)
        }
    }

    /// Whether a capture of `key` — an entry of `entry_bytes` bytes — would store nothing
    /// (disabled, already present, too long, too large), decided before the caller gathers
    /// the slab from its live KV. A decline is counted exactly as [`capture`](Self::capture)
    /// counts it. `None`: gather the slab and capture.
    pub fn decline(&mut self, key: &VolumeKey<'_>, entry_bytes: usize) -> Option<CaptureOutcome> {
        let id = PrefixIdentity::of(key);
        let (skip, intact) = self.skip_outcome(key, &id, entry_bytes);
        if let Some(outcome) = skip {
            self.count_skip(outcome, intact);
        }
        skip
    }

    /// The entry size `capture` would report for these lengths (floats of both slabs, tail,
    /// logits, and the prefix's token ids).
    pub fn entry_bytes(
        slab_floats: usize,
        tail_len: usize,
        logits_len: usize,
        prefix_len: usize,
    ) -> usize {
        entry_bytes(slab_floats, tail_len, logits_len, prefix_len)
    }

    /// The outcome of a capture that stores nothing, if it is one, and the index of an intact
    /// entry with the same content. An erased (trimmed) entry is not "the same content": a
    /// fresh capture replaces it.
    fn skip_outcome(
        &self,
        key: &VolumeKey<'_>,
        id: &PrefixIdentity,
        bytes: usize,
    ) -> (Option<CaptureOutcome>, Option<usize>) {
        let prefix_len = key.tokens.len();
        let present = self.entries.iter().position(|e| e.volume.matches(key, id));
        let intact = present.filter(|&i| !self.entries[i].volume.is_erased());
        let skip = if !self.enabled {
            Some(CaptureOutcome::Disabled)
        } else if let Some(i) = intact {
            Some(CaptureOutcome::AlreadyPresent {
                bytes: self.entries[i].volume.nbytes(),
            })
        } else if prefix_len > self.config.max_prefix_len {
            Some(CaptureOutcome::SkippedTooLong {
                prefix_len,
                max: self.config.max_prefix_len,
            })
        } else {
            self.config
                .max_bytes
                .filter(|&max| bytes > max)
                .map(|max| CaptureOutcome::SkippedTooLarge { bytes, max })
        };
        (skip, intact)
    }

    /// Counts a capture that stored nothing (a disabled cache counts nothing).
    fn count_skip(&mut self, outcome: CaptureOutcome, intact: Option<usize>) {
        if !self.enabled {
            return;
        }
        self.tick += 1;
        match outcome {
            CaptureOutcome::AlreadyPresent { .. } => {
                if let Some(i) = intact {
                    self.entries[i].last_used = self.tick;
                }
            }
            CaptureOutcome::SkippedTooLong { .. } => self.stats.skipped_too_long += 1,
            CaptureOutcome::SkippedTooLarge { .. } => self.stats.skipped_too_large += 1,
            _ => {}
        }
    }

    // ---- internals (the identity is explicit so tests can force a lookup-hash collision)

    fn capture_identified(
        &mut self,
        key: &VolumeKey<'_>,
        id: PrefixIdentity,
        data: IncomingVolume<'_>,
    ) -> Result<CaptureOutcome, VolumeError> {
        data.validate_shape(key)?;
        let bytes = data.entry_bytes();
        let prefix_len = key.tokens.len();

        // Outcomes that store nothing are decided before copying, but the slabs are still
        // checked, so bad input is an error whatever the cache's state.
        let (skip, intact) = self.skip_outcome(key, &id, bytes);
        if let Some(outcome) = skip {
            data.check_slabs(key.layer_lo)?;
            self.count_skip(outcome, intact);
            return Ok(outcome);
        }

        let IncomingVolume {
            shape,
            tail,
            kv_keys,
            kv_vals,
            logits,
        } = data;
        let kv_keys = checked_slab(shape, "kv_keys", kv_keys, key.layer_lo)?;
        let kv_vals = checked_slab(shape, "kv_vals", kv_vals, key.layer_lo)?;
        let tail = tail.into_owned();
        let logits = logits.map(Cow::into_owned);

        // Valid: from here on state changes.
        self.tick += 1;
        // The erased (trimmed) entry this capture restores, if any.
        if let Some(i) = self.entries.iter().position(|e| e.volume.matches(key, &id)) {
            self.remove_at(i);
        }
        let cleared = self.clear_drift(key, &id);
        self.evict_to_fit(1, bytes);
        let volume = AmplituhedronVolume {
            model_fingerprint: key.model_fingerprint,
            lookup_hash: id.lookup_hash,
            digest: id.digest,
            salt_key: id.salt_key,
            tokens: key.tokens.to_vec(),
            layer_lo: key.layer_lo,
            layer_hi: key.layer_hi,
            shape,
            kv_len: prefix_len,
            drift: pisot_drift(&tail),
            tail: Some(tail),
            logits,
            kv_keys: Arc::new(kv_keys),
            kv_vals: Arc::new(kv_vals),
        };
        debug_assert_eq!(volume.nbytes(), bytes);
        self.push(Entry {
            volume: Arc::new(volume),
            last_used: self.tick,
        });
        self.stats.captures += 1;
        Ok(if cleared == 0 {
            CaptureOutcome::Stored { bytes }
        } else {
            CaptureOutcome::StoredAfterDrift { bytes, cleared }
        })
    }

    fn replay_identified(
        &mut self,
        key: &VolumeKey<'_>,
        id: &PrefixIdentity,
    ) -> Option<Arc<AmplituhedronVolume>> {
        if !self.enabled {
            return None;
        }
        self.tick += 1;
        match self.entries.iter_mut().find(|e| e.volume.matches(key, id)) {
            Some(e) => {
                e.last_used = self.tick;
                self.stats.hits += 1;
                self.last_hit = Arc::downgrade(&e.volume);
                Some(Arc::clone(&e.volume))
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Drops entries in `key`'s slot that drifted: another fingerprint means the model
    /// changed (every entry of that old fingerprint goes); the same fingerprint with other
    /// ids (or salt) is a u64 collision (that entry goes). Returns how many were dropped.
    fn clear_drift(&mut self, key: &VolumeKey<'_>, id: &PrefixIdentity) -> usize {
        let mut stale_fingerprints = Vec::new();
        let mut collided = Vec::new();
        for e in &self.entries {
            let v = &e.volume;
            if v.same_slot(key, id) && !v.matches(key, id) {
                if v.model_fingerprint != key.model_fingerprint {
                    stale_fingerprints.push(v.model_fingerprint);
                } else {
                    collided.push(Arc::clone(&e.volume));
                }
            }
        }
        let before = self.entries.len();
        let mut i = 0;
        while i < self.entries.len() {
            let v = &self.entries[i].volume;
            if stale_fingerprints.contains(&v.model_fingerprint)
                || collided.iter().any(|c| Arc::ptr_eq(c, v))
            {
                self.remove_at(i);
            } else {
                i += 1;
            }
        }
        let cleared = before - self.entries.len();
        self.stats.drift_clears += cleared as u64;
        cleared
    }

    /// Evicts by policy until `incoming_entries` more entries and `incoming_bytes` more
    /// bytes fit. Callers guarantee `incoming_bytes <= max_bytes`, so this terminates.
    fn evict_to_fit(&mut self, incoming_entries: usize, incoming_bytes: usize) {
        loop {
            let over_entries = self.entries.len() + incoming_entries > self.config.max_entries;
            let over_bytes = self
                .config
                .max_bytes
                .is_some_and(|m| self.stats.bytes + incoming_bytes > m);
            if !(over_entries || over_bytes) {
                return;
            }
            let candidates = self.entries.iter().map(Entry::candidate).enumerate();
            let Some(victim) = select_victim(self.config.policy, self.tick, candidates) else {
                return;
            };
            self.remove_at(victim);
            self.stats.evictions += 1;
        }
    }

    fn push(&mut self, entry: Entry) {
        self.stats.bytes += entry.volume.nbytes();
        self.entries.push(entry);
        self.stats.entries = self.entries.len();
    }

    fn remove_at(&mut self, idx: usize) {
        let entry = self.entries.swap_remove(idx);
        self.stats.bytes -= entry.volume.nbytes();
        self.stats.entries = self.entries.len();
    }
}

#[cfg(test)]
#[path = "volume_tests.rs"]
mod tests;
