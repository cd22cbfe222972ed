//! The volume cache: prefilled KV slabs keyed by prompt prefix (SPEC §2, §13; seed 000 §2–3).
//!
//! After a prompt is prefilled, a station **captures** an [`AmplituhedronVolume`]: its KV
//! for positions `[0, prefix_len)` over its layer range, the tail residual of the last
//! prefix position and (exit station) that position's logits. A later session with the same
//! prefix **replays** it instead of prefilling; a session whose prompt merely starts like a
//! cached one replays the longest shared prefix and prefills the rest.
//!
//! # Rules
//! - A hit needs the model fingerprint, layer range, tenant salt, the full 32-byte BLAKE3
//!   digest **and** the token ids to match; no hash ever decides a hit on its own.
//! - An empty prefix never makes a volume (Lean `clinamen_swerve = 1`); damaged
//!   (non-finite) data never makes a volume; bad input is an error that changes nothing.
//! - Memory is bounded by `max_entries` and `max_bytes` after every operation, the cache
//!   directory by `max_disk_bytes`; victims are chosen by [`crate::eviction`] (the same
//!   policy for both), never the entry being stored.
//! - Erasure (Lean `topological_erasure`): damage at the trailing covered position trims
//!   that position once; any other damage clears that one entry, never the whole cache. A
//!   damaged entry's file is deleted either way.
//!
//! # Design
//! **Index.** Exact probes go through a map from `(lookup hash, layer range)` to entries and
//! compare fingerprint, salt, digest and ids; longest-prefix probes walk a radix tree over
//! the ids ([`index`]), one per model, layer range and tenant, whose edges are blocks of
//! [`BLOCK_POSITIONS`] ids. Neither cost grows with the number of entries (beyond the
//! logarithm of a node's fan-out), and eviction picks its victim from an ordered queue.
//!
//! **Shared blocks.** KV is stored in blocks of [`BLOCK_POSITIONS`] positions. A full block is
//! fixed by the ids up to its end, so it belongs to a tree node, and every resident volume
//! through that node holds the same block: a system prompt shared by many cached prompts is
//! stored once. Replay writes a volume into a session block by block through the ring's own
//! append path (the ring's span layout does not depend on how appends are chunked), and
//! erasure never edits a block: a trimmed volume keeps its blocks with one position fewer
//! covered, and an injected fault replaces the block in that one volume only.
//!
//! **Disk.** With a cache directory, every captured volume is also written to a file
//! ([`disk`]): atomically, checked again before it is served, deleted if it fails. The
//! directory outlives the process: a cache opened on it indexes the files' headers at once
//! and maps a file's payload when it is first hit. Memory and disk are two tiers of one
//! index: an entry evicted from memory stays on disk (and is mapped back on its next hit),
//! an entry evicted from disk stays in memory while it is resident.
//!
//! # Sizes
//! [`AmplituhedronVolume::nbytes`] is exactly
//! `b × 2 × prefix_len × layers × kv_heads × head_dim + 4 × (tail_len + logits_len + prefix_len)`:
//! the two KV slabs at `b` bytes a value (4 as f32; 2 as f16, which is how a volume an f16
//! session captures stores them: the ring's own bit patterns, so replay into an f16 ring is a
//! copy), the f32 tail and logits, and the u32 token ids. The slab term is the Lean
//! `volume = states × constraints` (`prefix_len × layers`) times `2 × kv_heads × head_dim`.
//! The memory a cache counts against `max_bytes` is that sum over its resident volumes with
//! each shared block counted once; fixed bookkeeping (digests, index nodes) is not counted.
//!
//! # Eviction cost
//! The cost-aware policy weighs a volume by the prefill it saves, in position-layers
//! (`positions × layers`, what prefill's work is proportional to): a volume is worth its own
//! prefill when stored, and every hit adds the positions it served.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, Weak};

use crate::eviction::{over_limits, pisot_drift, EntryFacts, EvictionPolicy, EvictionQueue};

#[cfg(target_arch = "x86_64")]
mod avx2;
mod block;
mod captured;
mod data;
mod disk;
mod error;
mod index;
mod key;
mod slab;
#[cfg(test)]
mod tests;
mod writer;

pub use block::{KvBlock, BLOCK_POSITIONS};
pub use captured::AmplituhedronVolume;
pub use data::{OwnedVolumeData, VolumeData};
pub use error::{CacheStats, CaptureOutcome, DamageOutcome, VolumeError};
pub use key::VolumeKey;
pub use slab::SlabShape;

use data::entry_bytes;
use disk::{DiskStore, Header};
use index::{EntryId, NodeId, PrefixIndex};
use key::{Namespace, PrefixIdentity};
use writer::{DiskWriter, Ticket, Written};

// ---------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------

/// Limits, policy and persistence of an [`AmplituhedronCache`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// Most entries resident in memory at once (default 4).
    pub max_entries: usize,
    /// Longest prefix captured (default 512).
    pub max_prefix_len: usize,
    /// Most bytes resident in memory at once (default: unbounded).
    pub max_bytes: Option<usize>,
    /// Victim choice when memory or disk is full (default: the cost-aware policy, which beat
    /// LRU and Pisot-guard on every trace of the eviction bench).
    pub policy: EvictionPolicy,
    /// Directory keeping every captured volume across restarts (default: none, memory only).
    pub cache_dir: Option<PathBuf>,
    /// Most bytes of volume files in `cache_dir` (default: unbounded).
    pub max_disk_bytes: Option<u64>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            max_entries: 4,
            max_prefix_len: 512,
            max_bytes: None,
            policy: EvictionPolicy::CostAware,
            cache_dir: None,
            max_disk_bytes: None,
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
        if self.max_disk_bytes == Some(0) {
            return Err(VolumeError::InvalidConfig {
                setting: "max_disk_bytes",
            });
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

/// The eviction cost of serving `positions` positions over `layers` layers from the cache:
/// the prefill it saves, in position-layers.
fn prefill_cost(positions: usize, layers: usize) -> f64 {
    (positions * layers) as f64
}

// ---------------------------------------------------------------------------------------
// Entries
// ---------------------------------------------------------------------------------------

/// A cached prefix: in memory, on disk, or both.
#[derive(Debug)]
struct Entry {
    namespace: Namespace,
    lookup_hash: u64,
    digest: [u8; 32],
    tokens: Arc<[u32]>,
    /// The index nodes of its full blocks.
    path: Box<[NodeId]>,
    /// `prefix_len`, or `prefix_len − 1` after an erasure.
    kv_len: usize,
    /// [`AmplituhedronVolume::nbytes`] of the volume.
    nbytes: usize,
    drift: f32,
    resident: Option<Resident>,
    /// The header of its file in the cache directory.
    disk: Option<Header>,
}

#[derive(Debug)]
struct Resident {
    volume: Arc<AmplituhedronVolume>,
    /// Bytes counted for this entry alone (tail, logits, ids and every block not held by an
    /// index node); the blocks its index nodes hold are counted with the nodes.
    own_bytes: usize,
}

impl Entry {
    fn matches(&self, key: &VolumeKey<'_>, id: &PrefixIdentity) -> bool {
        self.lookup_hash == id.lookup_hash
            && self.namespace == Namespace::of(key, id)
            && self.digest == id.digest
            && *self.tokens == *key.tokens
    }

    /// Whether the resident copy lost its trailing position to an erasure.
    fn is_erased(&self) -> bool {
        self.kv_len < self.tokens.len()
    }

    fn facts(&self, bytes: usize) -> EntryFacts {
        EntryFacts {
            drift: self.drift,
            bytes,
            cost: prefill_cost(self.kv_len, self.namespace.layers()),
        }
    }
}

/// The cache directory: its files' eviction queue, and the writes still under way.
#[derive(Debug)]
struct DiskTier {
    store: Arc<DiskStore>,
    /// Entries whose file is written (the queued writes are not in it yet).
    queue: EvictionQueue<EntryId>,
    writer: DiskWriter,
    /// Entries whose write is queued: the serial of that write and its file's header.
    pending: HashMap<EntryId, (u64, Header)>,
    /// Bytes of the queued writes, reserved against `max_disk_bytes`.
    pending_bytes: u64,
    serial: u64,
}

// ---------------------------------------------------------------------------------------
// The cache
// ---------------------------------------------------------------------------------------

/// A station's bounded cache of prefix volumes, in memory and optionally on disk.
#[derive(Debug)]
pub struct AmplituhedronCache {
    config: CacheConfig,
    enabled: bool,
    entries: Vec<Option<Entry>>,
    free_ids: Vec<EntryId>,
    /// Entries by `(lookup hash, layer_lo, layer_hi)`: an exact probe's candidates, and the
    /// slot a capture checks for drift.
    slots: HashMap<(u64, u16, u16), Vec<EntryId>>,
    index: PrefixIndex,
    /// Resident entries, in eviction order.
    memory: EvictionQueue<EntryId>,
    disk: Option<DiskTier>,
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
    /// An enabled cache; fails if a limit is zero or the cache directory cannot be opened.
    ///
    /// With a `cache_dir`, the directory is created if needed and locked, files left by
    /// unfinished writes are deleted, and every volume file whose header checks out is
    /// indexed (the others are deleted), oldest first, evicting down to `max_disk_bytes`.
    pub fn new(config: CacheConfig) -> Result<Self, VolumeError> {
        config.validate()?;
        let mut cache = AmplituhedronCache {
            memory: EvictionQueue::new(config.policy),
            disk: None,
            config,
            enabled: true,
            entries: Vec::new(),
            free_ids: Vec::new(),
            slots: HashMap::new(),
            index: PrefixIndex::default(),
            tick: 0,
            stats: CacheStats::default(),
            last_hit: Weak::new(),
        };
        if let Some(dir) = cache.config.cache_dir.clone() {
            cache.open_dir(dir)?;
        }
        Ok(cache)
    }

    fn open_dir(&mut self, dir: PathBuf) -> Result<(), VolumeError> {
        let (store, scan) = DiskStore::open(&dir).map_err(|e| VolumeError::CacheDir {
            path: dir.display().to_string(),
            reason: e.to_string(),
        })?;
        self.stats.disk_rejected += scan.rejected as u64;
        let mut files = scan.files;
        files.sort_by_key(|f| f.modified);
        let mut queue = EvictionQueue::new(self.config.policy);
        for f in files {
            let h = f.header;
            let bytes = h.file_len();
            let nbytes = entry_bytes(
                2 * h.kv_dtype.bytes()
                    * h.namespace.layers()
                    * h.kv_heads
                    * h.tokens.len()
                    * h.head_dim,
                h.tail_len,
                h.logits_len,
                h.tokens.len(),
            );
            let e = self.add_entry(Entry {
                namespace: h.namespace,
                lookup_hash: crate::keys::digest_prefix_u64(&h.digest),
                digest: h.digest,
                tokens: Arc::clone(&h.tokens),
                path: Box::new([]),
                kv_len: h.tokens.len(),
                nbytes,
                drift: h.drift,
                resident: None,
                disk: Some(h),
            });
            self.tick += 1;
            queue.insert(e, self.entry(e).facts(bytes as usize), self.tick);
            self.stats.disk_bytes += bytes;
        }
        let store = Arc::new(store);
        let writer = DiskWriter::spawn(Arc::clone(&store)).map_err(|e| VolumeError::CacheDir {
            path: self
                .config
                .cache_dir
                .clone()
                .unwrap_or_default()
                .display()
                .to_string(),
            reason: format!("cannot start its writer thread: {e}"),
        })?;
        self.disk = Some(DiskTier {
            store,
            queue,
            writer,
            pending: HashMap::new(),
            pending_bytes: 0,
            serial: 0,
        });
        self.evict_disk_to_fit(0);
        Ok(())
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

    /// Current limits, policy and directory.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// Sets the entry limit (≥ 1) and evicts down to it at once.
    pub fn set_max_entries(&mut self, n: usize) -> Result<(), VolumeError> {
        check_limit("max_entries", n)?;
        self.config.max_entries = n;
        self.evict_memory_to_fit(0, 0);
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
        self.evict_memory_to_fit(0, 0);
        Ok(())
    }

    /// Sets the eviction policy (of memory and disk alike).
    pub fn set_policy(&mut self, policy: EvictionPolicy) {
        self.config.policy = policy;
        self.memory.set_policy(policy);
        if let Some(d) = &mut self.disk {
            d.queue.set_policy(policy);
        }
    }

    /// Drops every entry, in memory and on disk (counters are kept).
    pub fn clear(&mut self) {
        let all: Vec<EntryId> = self.live_ids().collect();
        for e in all {
            self.remove_entry(e);
        }
        self.last_hit = Weak::new();
    }

    /// Drops every entry, in memory and on disk, of a model other than `fingerprint`
    /// (reloading weights or changing config evicts everything); returns how many went.
    /// Counted as drift.
    pub fn retain_model(&mut self, fingerprint: u64) -> usize {
        let stale: Vec<EntryId> = self
            .live_ids()
            .filter(|&e| self.entry(e).namespace.fingerprint != fingerprint)
            .collect();
        for &e in &stale {
            self.remove_entry(e);
        }
        self.stats.drift_clears += stale.len() as u64;
        stale.len()
    }

    /// Applies the outcomes of volume writes that finished, without waiting. Captures and
    /// lookups do it themselves; call it before reading [`stats`](Self::stats) to see them.
    pub fn settle(&mut self) {
        let finished = match &mut self.disk {
            Some(d) if d.writer.in_flight() > 0 => d.writer.finished(),
            _ => return,
        };
        for w in finished {
            self.apply_written(w);
        }
    }

    /// Waits until every queued volume write is on disk (synced and renamed into place) and
    /// applies the outcomes.
    pub fn flush(&mut self) {
        let finished = match &mut self.disk {
            Some(d) => d.writer.wait_all(),
            None => return,
        };
        for w in finished {
            self.apply_written(w);
        }
    }

    /// Volume writes queued whose outcome is not applied yet.
    pub fn writes_in_flight(&self) -> usize {
        self.disk.as_ref().map_or(0, |d| d.pending.len())
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            entries: self.memory.len(),
            disk_entries: self.disk.as_ref().map_or(0, |d| d.queue.len()),
            ..self.stats
        }
    }

    /// Entries resident in memory.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// Whether no entry is resident in memory.
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// Captures a volume, copying the slabs once into the cache's blocks (with the
    /// finiteness check fused into the copy; blocks the cache already holds are checked, not
    /// copied). Validates everything before touching state. With a cache directory the
    /// volume is also written to disk; a failed write is counted, not an error.
    pub fn capture(
        &mut self,
        key: &VolumeKey<'_>,
        data: VolumeData<'_>,
    ) -> Result<CaptureOutcome, VolumeError> {
        self.capture_identified(key, PrefixIdentity::of(key), data)
    }

    /// [`capture`](Self::capture) of data in owned buffers.
    pub fn capture_owned(
        &mut self,
        key: &VolumeKey<'_>,
        data: OwnedVolumeData,
    ) -> Result<CaptureOutcome, VolumeError> {
        self.capture_identified(key, PrefixIdentity::of(key), data.borrowed())
    }

    /// Looks the key up; a hit needs fingerprint, layer range, salt, digest and token ids to
    /// match. An entry only on disk is mapped and verified first (a file that fails is
    /// deleted: a miss). Errors only for an invalid key (empty prefix or layer range).
    /// Disabled: `None` without counting.
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
    ///
    /// Among volumes sharing equally long prefixes one is picked by a fixed rule (see
    /// [`index`]), not by recency.
    pub fn replay_longest_prefix(
        &mut self,
        key: &VolumeKey<'_>,
        min_reuse: usize,
    ) -> Result<Option<(Arc<AmplituhedronVolume>, usize)>, VolumeError> {
        key.validate()?;
        if !self.enabled {
            return Ok(None);
        }
        self.settle();
        let namespace = Namespace::of(key, &PrefixIdentity::of(key));
        let cap = key.tokens.len() - 1;
        loop {
            let Some((e, shared)) = self.index.longest(namespace, key.tokens) else {
                return Ok(None);
            };
            let usable = shared.min(self.entry(e).kv_len).min(cap);
            if usable < min_reuse.max(1) {
                return Ok(None);
            }
            // A file that fails verification is gone now: look again.
            if let Some(volume) = self.resident_volume(e) {
                self.tick += 1;
                self.touch(e, usable);
                self.stats.prefix_hits += 1;
                return Ok(Some((volume, usable)));
            }
        }
    }

    /// Tail residual of the most recent hit, if its lookup hash is `prefix_hash` and it is
    /// still resident (seed 000 §2: the accessor the replay flow uses after a hit).
    ///
    /// It only ever answers for a volume a full replay verified, so a bare u64 never
    /// decides which volume's data is returned.
    pub fn tail(&self, prefix_hash: u64) -> Option<Vec<f32>> {
        let vol = self.last_hit.upgrade()?;
        if vol.lookup_hash != prefix_hash {
            return None;
        }
        let slot = (vol.lookup_hash, vol.layer_lo(), vol.layer_hi());
        let resident = self.slots.get(&slot)?.iter().any(|&e| {
            self.entry(e)
                .resident
                .as_ref()
                .is_some_and(|r| Arc::ptr_eq(&r.volume, &vol))
        });
        resident.then(|| vol.tail.clone()).flatten()
    }

    /// Fault injection for tests and failure drills: overwrites the key slab of `key`'s
    /// volume at `position` (first layer, head and dimension) with NaN, as memory corruption
    /// would. Only that volume's copy of the block changes (another volume sharing the block
    /// keeps it intact). Returns whether an entry was found. Never used by the runtime itself.
    pub fn inject_fault(
        &mut self,
        key: &VolumeKey<'_>,
        position: usize,
    ) -> Result<bool, VolumeError> {
        key.validate()?;
        let id = PrefixIdentity::of(key);
        let Some(e) = self.find(key, &id) else {
            return Ok(false);
        };
        let Some(vol) = self.resident_volume(e) else {
            return Ok(false);
        };
        if position >= vol.kv_len {
            return Err(VolumeError::DamageOutOfRange {
                position,
                kv_len: vol.kv_len,
            });
        }
        let j = position / BLOCK_POSITIONS;
        let shape = SlabShape {
            positions: vol.blocks[j].positions(),
            ..vol.shape
        };
        let damaged =
            vol.blocks[j].damaged_copy(shape.row_offset(0, 0, position % BLOCK_POSITIONS));
        let extra = damaged.nbytes();
        let mut blocks = vol.blocks.clone();
        blocks[j] = Arc::new(damaged);
        let resident = self
            .entry_mut(e)
            .resident
            .as_mut()
            .expect("made resident above");
        resident.volume = Arc::new(vol.with_blocks(blocks));
        resident.own_bytes += extra;
        self.stats.bytes += extra;
        Ok(true)
    }

    /// Reports damage found at `position` while replaying `key`'s volume (Lean
    /// `topological_erasure`): the trailing covered position of a never-erased volume is
    /// trimmed once; any other damage clears that one entry. Its file, if any, is deleted
    /// either way. Other entries are untouched.
    pub fn report_damage(
        &mut self,
        key: &VolumeKey<'_>,
        position: usize,
    ) -> Result<DamageOutcome, VolumeError> {
        key.validate()?;
        let id = PrefixIdentity::of(key);
        let Some(e) = self.find(key, &id) else {
            return Ok(DamageOutcome::Absent);
        };
        let kv_len = self.entry(e).kv_len;
        if position >= kv_len {
            return Err(VolumeError::DamageOutOfRange { position, kv_len });
        }
        self.stats.erasures += 1;
        let trimmable = position + 1 == kv_len && kv_len > 1 && !self.entry(e).is_erased();
        // Trimming to zero positions would leave an empty volume, which cannot exist.
        let trimmed = match &self.entry(e).resident {
            Some(r) if trimmable => Arc::new(r.volume.trimmed()),
            _ => {
                self.remove_entry(e);
                return Ok(DamageOutcome::Cleared);
            }
        };
        self.drop_file(e);
        let entry = self.entry_mut(e);
        let resident = entry.resident.as_mut().expect("matched above");
        let freed = resident.volume.nbytes() - trimmed.nbytes();
        resident.volume = trimmed;
        resident.own_bytes -= freed;
        entry.kv_len -= 1;
        entry.nbytes -= freed;
        let nbytes = entry.nbytes;
        self.stats.bytes -= freed;
        self.memory.resize(e, nbytes);
        Ok(DamageOutcome::Trimmed { kv_len: kv_len - 1 })
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

    /// The entry size `capture` would report for these lengths (the bytes of both KV slabs,
    /// then the floats of tail and logits and the prefix's token ids).
    pub fn entry_bytes(
        kv_bytes: usize,
        tail_len: usize,
        logits_len: usize,
        prefix_len: usize,
    ) -> usize {
        entry_bytes(kv_bytes, tail_len, logits_len, prefix_len)
    }

    /// The outcome of a capture that stores nothing, if it is one, and the intact entry with
    /// the same content. An erased (trimmed) entry is not "the same content": a fresh capture
    /// replaces it.
    fn skip_outcome(
        &self,
        key: &VolumeKey<'_>,
        id: &PrefixIdentity,
        bytes: usize,
    ) -> (Option<CaptureOutcome>, Option<EntryId>) {
        let prefix_len = key.tokens.len();
        let intact = self.find(key, id).filter(|&e| !self.entry(e).is_erased());
        let skip = if !self.enabled {
            Some(CaptureOutcome::Disabled)
        } else if let Some(e) = intact {
            Some(CaptureOutcome::AlreadyPresent {
                bytes: self.entry(e).nbytes,
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
    fn count_skip(&mut self, outcome: CaptureOutcome, intact: Option<EntryId>) {
        if !self.enabled {
            return;
        }
        self.tick += 1;
        match outcome {
            CaptureOutcome::AlreadyPresent { .. } => {
                if let Some(e) = intact {
                    self.touch(e, 0);
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
        data: VolumeData<'_>,
    ) -> Result<CaptureOutcome, VolumeError> {
        data.validate_shape(key)?;
        self.settle();
        let bytes = data.entry_bytes();

        // Outcomes that store nothing are decided before copying, but the slabs are still
        // checked, so bad input is an error whatever the cache's state.
        let (skip, intact) = self.skip_outcome(key, &id, bytes);
        if let Some(outcome) = skip {
            data.check_slabs(key.layer_lo)?;
            self.count_skip(outcome, intact);
            return Ok(outcome);
        }
        let namespace = Namespace::of(key, &id);
        let cached = self
            .index
            .cached_blocks(&self.index.existing_path(namespace, key.tokens));
        let blocks = data.blocks(&cached, key.layer_lo)?;

        // Valid: from here on state changes.
        self.tick += 1;
        // The erased (trimmed) entry this capture restores, if any.
        if let Some(e) = self.find(key, &id) {
            self.remove_entry(e);
        }
        let cleared = self.clear_drift(key, &id);
        let tail = data.tail.to_vec();
        let volume = Arc::new(AmplituhedronVolume {
            namespace,
            lookup_hash: id.lookup_hash,
            digest: id.digest,
            tokens: key.tokens.into(),
            shape: data.shape(),
            kv_len: key.tokens.len(),
            drift: pisot_drift(&tail),
            tail: Some(tail),
            logits: data.logits.map(<[f32]>::to_vec),
            blocks,
            contiguous: OnceLock::new(),
        });
        debug_assert_eq!(volume.nbytes(), bytes);
        let e = self.add_entry(Entry {
            namespace,
            lookup_hash: id.lookup_hash,
            digest: id.digest,
            tokens: Arc::clone(&volume.tokens),
            path: Box::new([]),
            kv_len: volume.kv_len,
            nbytes: bytes,
            drift: volume.drift,
            resident: None,
            disk: None,
        });
        self.make_resident(e, Arc::clone(&volume));
        self.stats.captures += 1;
        self.persist(e, volume);
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
        self.settle();
        self.tick += 1;
        let hit = self.find(key, id).and_then(|e| {
            let volume = self.resident_volume(e)?;
            self.touch(e, volume.kv_len);
            Some(volume)
        });
        match &hit {
            Some(volume) => {
                self.stats.hits += 1;
                self.last_hit = Arc::downgrade(volume);
            }
            None => self.stats.misses += 1,
        }
        hit
    }

    /// The entry matching `key` exactly, if any.
    fn find(&self, key: &VolumeKey<'_>, id: &PrefixIdentity) -> Option<EntryId> {
        let slot = (id.lookup_hash, key.layer_lo, key.layer_hi);
        self.slots
            .get(&slot)?
            .iter()
            .copied()
            .find(|&e| self.entry(e).matches(key, id))
    }

    /// The resident volume of `e`; an entry only on disk is mapped, verified and made
    /// resident (or served once without staying, if it alone exceeds `max_bytes`). A file
    /// that fails verification is deleted with its entry: `None`.
    fn resident_volume(&mut self, e: EntryId) -> Option<Arc<AmplituhedronVolume>> {
        let entry = self.entry(e);
        if let Some(r) = &entry.resident {
            return Some(Arc::clone(&r.volume));
        }
        let header = entry.disk.clone()?;
        let (path, lookup_hash) = (entry.path.clone(), entry.lookup_hash);
        let store = &self
            .disk
            .as_ref()
            .expect("a file implies a directory")
            .store;
        let Ok(map) = store.map(&header) else {
            self.stats.disk_rejected += 1;
            self.remove_entry(e);
            return None;
        };
        let (mapped, tail, logits) = disk::mapped_parts(&header, &map);
        // Blocks some resident volume already holds are shared rather than mapped twice.
        let blocks = mapped
            .into_iter()
            .enumerate()
            .map(|(j, b)| {
                path.get(j)
                    .and_then(|&n| self.index.block(n).cloned())
                    .unwrap_or_else(|| Arc::new(b))
            })
            .collect();
        let volume = Arc::new(AmplituhedronVolume {
            namespace: header.namespace,
            lookup_hash,
            digest: header.digest,
            tokens: Arc::clone(&header.tokens),
            shape: SlabShape {
                layers: header.namespace.layers(),
                kv_heads: header.kv_heads,
                positions: header.tokens.len(),
                head_dim: header.head_dim,
            },
            kv_len: header.tokens.len(),
            drift: pisot_drift(&tail),
            tail: Some(tail),
            logits,
            blocks,
            contiguous: OnceLock::new(),
        });
        self.stats.disk_hits += 1;
        if self.config.max_bytes.is_none_or(|m| volume.nbytes() <= m) {
            self.make_resident(e, Arc::clone(&volume));
        }
        Some(volume)
    }

    /// Makes `volume` the resident copy of `e` (not resident before): its full blocks go to
    /// its index nodes (or share the blocks they hold), the bytes are counted, and memory is
    /// evicted down to the limits — never `e` itself.
    fn make_resident(&mut self, e: EntryId, volume: Arc<AmplituhedronVolume>) {
        let path = self.entry(e).path.clone();
        let mut own = entry_bytes(
            0,
            volume.tail().map_or(0, <[f32]>::len),
            volume.logits().map_or(0, <[f32]>::len),
            volume.prefix_len(),
        );
        for (j, b) in volume.blocks.iter().enumerate() {
            match path.get(j) {
                Some(&node) => {
                    self.stats.bytes += self.index.share_block(node, b);
                    if !Arc::ptr_eq(self.index.block(node).expect("just shared"), b) {
                        own += b.nbytes();
                    }
                }
                None => own += b.nbytes(),
            }
        }
        self.stats.bytes += own;
        self.entry_mut(e).resident = Some(Resident {
            volume,
            own_bytes: own,
        });
        self.evict_memory_to_fit(1, 0);
        let entry = self.entry(e);
        let facts = entry.facts(entry.nbytes);
        self.memory.insert(e, facts, self.tick);
    }

    /// Queues the write of `e`'s volume to the cache directory, if there is one, evicting
    /// files down to the disk budget first (the queued bytes count against it). The write
    /// happens on the writer thread; until it ends the entry is served from memory. A failed
    /// write is counted; the entry stays in memory.
    fn persist(&mut self, e: EntryId, volume: Arc<AmplituhedronVolume>) {
        if self.disk.is_none() {
            return;
        }
        let header = Header::of(&volume);
        let file_len = header.file_len();
        if self.config.max_disk_bytes.is_some_and(|m| file_len > m) {
            self.stats.disk_skipped_too_large += 1;
            return;
        }
        self.evict_disk_to_fit(file_len);
        let tier = self.disk.as_mut().expect("checked above");
        tier.serial += 1;
        let ticket = Ticket {
            entry: e,
            serial: tier.serial,
            reserved: file_len,
        };
        tier.pending.insert(e, (ticket.serial, header));
        tier.pending_bytes += file_len;
        tier.writer.write(ticket, volume);
    }

    /// Applies how a queued write ended: the entry gets its file (or, if it is no longer in
    /// memory either, goes). A write whose entry went meanwhile changes nothing: its file's
    /// deletion was queued behind it when the entry went.
    fn apply_written(&mut self, w: Written) {
        let tier = self.disk.as_mut().expect("writes imply a directory");
        tier.pending_bytes -= w.ticket.reserved;
        let e = w.ticket.entry;
        if tier.pending.get(&e).map(|&(serial, _)| serial) != Some(w.ticket.serial) {
            return;
        }
        tier.pending.remove(&e);
        match w.result {
            Ok(header) => {
                self.stats.disk_writes += 1;
                self.stats.disk_bytes += header.file_len();
                let entry = self.entries[e as usize].as_mut().expect("live entry");
                tier.queue
                    .insert(e, entry.facts(header.file_len() as usize), self.tick);
                entry.disk = Some(header);
            }
            Err(_) => {
                self.stats.disk_write_failures += 1;
                if self.entry(e).resident.is_none() {
                    self.remove_entry(e);
                }
            }
        }
    }

    /// A hit on `e` served `positions` positions at the current tick.
    fn touch(&mut self, e: EntryId, positions: usize) {
        let saved = prefill_cost(positions, self.entry(e).namespace.layers());
        self.memory.touch(e, self.tick, saved);
        if let Some(d) = &mut self.disk {
            d.queue.touch(e, self.tick, saved);
        }
    }

    /// Drops entries in `key`'s slot that drifted: another fingerprint means the model
    /// changed (every entry of that old fingerprint goes); the same fingerprint with other
    /// ids (or salt) is a u64 collision (that entry goes). Returns how many were dropped.
    fn clear_drift(&mut self, key: &VolumeKey<'_>, id: &PrefixIdentity) -> usize {
        let slot = (id.lookup_hash, key.layer_lo, key.layer_hi);
        let in_slot = self.slots.get(&slot).cloned().unwrap_or_default();
        let mut stale_fingerprints = Vec::new();
        let mut doomed = Vec::new();
        for e in in_slot {
            let entry = self.entry(e);
            if entry.namespace.fingerprint != key.model_fingerprint {
                stale_fingerprints.push(entry.namespace.fingerprint);
            } else if !entry.matches(key, id) {
                doomed.push(e);
            }
        }
        if !stale_fingerprints.is_empty() {
            doomed
                .extend(self.live_ids().filter(|&e| {
                    stale_fingerprints.contains(&self.entry(e).namespace.fingerprint)
                }));
        }
        for &e in &doomed {
            self.remove_entry(e);
        }
        self.stats.drift_clears += doomed.len() as u64;
        doomed.len()
    }

    /// Evicts resident entries by policy until `incoming_entries` more entries and
    /// `incoming_bytes` more bytes fit. An evicted entry with a file stays indexed on disk.
    fn evict_memory_to_fit(&mut self, incoming_entries: usize, incoming_bytes: usize) {
        let (max_entries, max_bytes) = (self.config.max_entries, self.config.max_bytes);
        loop {
            let entries = self.memory.len() + incoming_entries;
            if !over_limits(
                entries,
                self.stats.bytes + incoming_bytes,
                max_entries,
                max_bytes,
            ) {
                return;
            }
            let Some(victim) = self.memory.pop_victim(self.tick) else {
                return;
            };
            self.drop_resident(victim);
            self.stats.evictions += 1;
            if self
                .disk
                .as_ref()
                .is_some_and(|d| d.pending.contains_key(&victim))
            {
                // Its file is being written: wait for it, so the entry keeps a copy (rare:
                // the cache is full and the disk slower than the captures).
                self.flush();
            }
            if self.entries[victim as usize]
                .as_ref()
                .is_some_and(|entry| entry.disk.is_none())
            {
                self.remove_entry(victim);
            }
        }
    }

    /// Deletes files by policy until `incoming` more bytes fit the disk budget. An entry
    /// whose file goes stays indexed while it is resident.
    fn evict_disk_to_fit(&mut self, incoming: u64) {
        let Some(max) = self.config.max_disk_bytes else {
            return;
        };
        while self.stats.disk_bytes + self.disk.as_ref().map_or(0, |d| d.pending_bytes) + incoming
            > max
        {
            let tick = self.tick;
            let Some(victim) = self.disk.as_mut().and_then(|d| d.queue.pop_victim(tick)) else {
                return;
            };
            self.drop_file(victim);
            self.stats.disk_evictions += 1;
            if self.entry(victim).resident.is_none() {
                self.remove_entry(victim);
            }
        }
    }

    /// Lets go of `e`'s resident copy (the entry stays indexed).
    fn drop_resident(&mut self, e: EntryId) {
        let Some(r) = self.entry_mut(e).resident.take() else {
            return;
        };
        self.memory.remove(&e);
        self.stats.bytes -= r.own_bytes;
        let path = self.entry(e).path.clone();
        for &node in path.iter() {
            self.stats.bytes -= self.index.release_block(node);
        }
    }

    /// Deletes `e`'s file, or the file its queued write will leave (the entry stays
    /// indexed). A queued write's file is deleted by the writer, right behind the write. A
    /// written file is deleted at once: while its entry lives no queued operation touches its
    /// name (the writer runs in order, so nothing queued before the write is left).
    fn drop_file(&mut self, e: EntryId) {
        let Some(tier) = self.disk.as_mut() else {
            return;
        };
        if let Some((_, header)) = tier.pending.remove(&e) {
            tier.writer.remove(header);
        }
        let Some(header) = self.entries[e as usize]
            .as_mut()
            .and_then(|x| x.disk.take())
        else {
            return;
        };
        tier.queue.remove(&e);
        tier.store.remove(&header);
        self.stats.disk_bytes -= header.file_len();
    }

    fn add_entry(&mut self, mut entry: Entry) -> EntryId {
        let e = match self.free_ids.pop() {
            Some(e) => e,
            None => {
                self.entries.push(None);
                EntryId::try_from(self.entries.len() - 1).expect("fewer than 2^32 entries")
            }
        };
        entry.path = self.index.insert(entry.namespace, &entry.tokens, e);
        let slot = (
            entry.lookup_hash,
            entry.namespace.layer_lo,
            entry.namespace.layer_hi,
        );
        self.slots.entry(slot).or_default().push(e);
        self.entries[e as usize] = Some(entry);
        e
    }

    /// Removes `e` from memory, disk and the index.
    fn remove_entry(&mut self, e: EntryId) {
        self.drop_resident(e);
        self.drop_file(e);
        let entry = self.entries[e as usize].take().expect("live entry");
        self.index
            .remove(entry.namespace, &entry.tokens, &entry.path);
        let slot = (
            entry.lookup_hash,
            entry.namespace.layer_lo,
            entry.namespace.layer_hi,
        );
        if let Some(ids) = self.slots.get_mut(&slot) {
            ids.retain(|&x| x != e);
            if ids.is_empty() {
                self.slots.remove(&slot);
            }
        }
        self.free_ids.push(e);
    }

    fn live_ids(&self) -> impl Iterator<Item = EntryId> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, x)| x.is_some())
            .map(|(i, _)| i as EntryId)
    }

    fn entry(&self, e: EntryId) -> &Entry {
        self.entries[e as usize].as_ref().expect("live entry")
    }

    fn entry_mut(&mut self, e: EntryId) -> &mut Entry {
        self.entries[e as usize].as_mut().expect("live entry")
    }
}
