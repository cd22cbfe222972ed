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
use std::sync::{Arc, Weak};

use crate::eviction::{pisot_drift, select_victim, EvictionCandidate, EvictionPolicy};

#[cfg(target_arch = "x86_64")]
mod avx2;
mod captured;
mod data;
mod error;
mod key;
mod slab;
#[cfg(test)]
mod tests;

pub use captured::AmplituhedronVolume;
pub use data::{OwnedVolumeData, VolumeData};
pub use error::{CacheStats, CaptureOutcome, DamageOutcome, VolumeError};
pub use key::VolumeKey;
pub use slab::{all_finite, copy_all_finite, SlabShape};

use data::{checked_slab, entry_bytes, IncomingVolume};
use key::PrefixIdentity;

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
