//! Bad input ([`VolumeError`]) and what a valid call did ([`CaptureOutcome`],
//! [`DamageOutcome`], [`CacheStats`]).

use std::fmt;
use std::ops::Range;

/// Bad input to the volume cache (or a cache directory that cannot be opened). Returned
/// before any state changes.
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
    /// The key and value slabs are stored in different types (f32 and f16).
    KvDtypeMismatch,
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
    /// The cache directory cannot be opened (created, locked or listed).
    CacheDir {
        /// The directory.
        path: String,
        /// What failed.
        reason: String,
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
            VolumeError::KvDtypeMismatch => {
                f.write_str("kv_keys and kv_vals must be stored in the same type (f32 or f16)")
            }
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
            VolumeError::CacheDir { path, reason } => {
                write!(f, "cannot open the cache directory {path}: {reason}")
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
    /// Entries removed from memory to respect `max_entries` / `max_bytes` (an entry also on
    /// disk stays there).
    pub evictions: u64,
    /// Entries resident in memory now.
    pub entries: usize,
    /// Bytes resident in memory now: each shared KV block counted once, so at most the sum of
    /// the resident volumes' [`nbytes`](super::AmplituhedronVolume::nbytes).
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
    /// Volume files in the cache directory now.
    pub disk_entries: usize,
    /// Bytes of those files.
    pub disk_bytes: u64,
    /// Hits (exact or prefix) served by mapping a verified file.
    pub disk_hits: u64,
    /// Volumes written to disk.
    pub disk_writes: u64,
    /// Writes that failed (a full disk, an I/O error); the volume stays in memory.
    pub disk_write_failures: u64,
    /// Volumes not written because their file alone exceeds `max_disk_bytes`.
    pub disk_skipped_too_large: u64,
    /// Files removed to respect `max_disk_bytes`.
    pub disk_evictions: u64,
    /// Files deleted because they failed a check (or were left by an unfinished write).
    pub disk_rejected: u64,
}

impl CacheStats {
    /// Every counter by name, in a fixed order (the bindings' and the station's dict form).
    pub fn as_pairs(&self) -> [(&'static str, u64); 19] {
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
            ("disk_entries", self.disk_entries as u64),
            ("disk_bytes", self.disk_bytes),
            ("disk_hits", self.disk_hits),
            ("disk_writes", self.disk_writes),
            ("disk_write_failures", self.disk_write_failures),
            ("disk_skipped_too_large", self.disk_skipped_too_large),
            ("disk_evictions", self.disk_evictions),
            ("disk_rejected", self.disk_rejected),
        ]
    }
}
