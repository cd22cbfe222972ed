//! `MatVecMemo`: an exact-match memo of decode matvecs `y = W·x` (SPEC §2, "death #1").
//!
//! Keyed by (weight id, BLAKE3 of `x`'s f32 little-endian bytes) in the tagged key space of
//! [`crate::keys::CacheKey::Memo`] (tag byte 1), so its keys can never equal a volume key
//! (tag byte 2). Bounded by entries and bytes with the same eviction policies as the volume
//! cache (drift computed on `y`). **Off by default.** The volume cache never routes capture
//! or replay through it.
//!
//! `x` itself is not stored: a 256-bit BLAKE3 digest decides equality (a collision is
//! cryptographically negligible), which halves the memory of every entry. Byte size of an
//! entry = the encoded key (41 bytes) + `4 × y.len()`.

use std::collections::HashMap;
use std::fmt;

use crate::eviction::{over_limits, pisot_drift, EntryFacts, EvictionPolicy, EvictionQueue};
use crate::keys::{f32_digest, CacheKey};

/// Bytes of an encoded memo key: tag (1) + weight id (8) + digest (32).
pub const MEMO_KEY_BYTES: usize = 41;

/// Limits and policy of a [`MatVecMemo`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoConfig {
    /// Most entries resident at once (default 1024).
    pub max_entries: usize,
    /// Most bytes resident at once (default: unbounded).
    pub max_bytes: Option<usize>,
    /// Victim choice when full (default Pisot-guard).
    pub policy: EvictionPolicy,
}

impl Default for MemoConfig {
    fn default() -> Self {
        MemoConfig {
            max_entries: 1024,
            max_bytes: None,
            policy: EvictionPolicy::PisotGuard,
        }
    }
}

/// Bad input to the memo. Returned before any state changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoError {
    /// `y` holds a non-finite value: a damaged result is never memoised.
    NonFiniteOutput {
        /// Index of the first non-finite value.
        index: usize,
    },
    /// A limit that must be at least 1 was 0.
    InvalidConfig {
        /// Which setting.
        setting: &'static str,
    },
}

impl fmt::Display for MemoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoError::NonFiniteOutput { index } => write!(
                f,
                "y has a non-finite value at index {index}: a damaged result is never memoised"
            ),
            MemoError::InvalidConfig { setting } => write!(f, "{setting} must be at least 1"),
        }
    }
}

impl std::error::Error for MemoError {}

/// What a valid [`MatVecMemo::insert`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoInsertOutcome {
    /// A new entry of `bytes` bytes was stored.
    Stored {
        /// The entry's byte size.
        bytes: usize,
    },
    /// The key is already memoised: kept as is (marked used).
    AlreadyPresent {
        /// The resident entry's byte size.
        bytes: usize,
    },
    /// The entry alone is larger than `max_bytes`: not stored.
    SkippedTooLarge {
        /// The entry's byte size.
        bytes: usize,
        /// The configured maximum.
        max: usize,
    },
    /// The memo is disabled: nothing stored, nothing counted.
    Disabled,
}

impl MemoInsertOutcome {
    /// Bytes of the entry now memoised for this key, 0 when none is.
    pub fn cached_bytes(&self) -> usize {
        match *self {
            MemoInsertOutcome::Stored { bytes } | MemoInsertOutcome::AlreadyPresent { bytes } => {
                bytes
            }
            MemoInsertOutcome::SkippedTooLarge { .. } | MemoInsertOutcome::Disabled => 0,
        }
    }
}

/// Counters and occupancy of a [`MatVecMemo`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoStats {
    /// Lookups that found `y`.
    pub hits: u64,
    /// Lookups that did not (while enabled).
    pub misses: u64,
    /// Entries removed to respect the limits.
    pub evictions: u64,
    /// Entries resident now.
    pub entries: usize,
    /// Bytes resident now.
    pub bytes: usize,
}

#[derive(Debug)]
struct MemoEntry {
    y: Vec<f32>,
}

impl MemoEntry {
    fn bytes(&self) -> usize {
        MEMO_KEY_BYTES + 4 * self.y.len()
    }
}

/// Exact-match memo of `y = W·x`, bounded, off by default.
#[derive(Debug)]
pub struct MatVecMemo {
    config: MemoConfig,
    enabled: bool,
    entries: HashMap<CacheKey, MemoEntry>,
    /// The entries in eviction order.
    queue: EvictionQueue<CacheKey>,
    /// Logical clock: bumped on every get and insert while enabled.
    tick: u64,
    stats: MemoStats,
}

impl Default for MatVecMemo {
    fn default() -> Self {
        Self::new(MemoConfig::default()).expect("the default config is valid")
    }
}

impl MatVecMemo {
    /// An empty, **disabled** memo; fails if a limit is zero.
    pub fn new(config: MemoConfig) -> Result<Self, MemoError> {
        check_limit("max_entries", config.max_entries)?;
        if let Some(b) = config.max_bytes {
            check_limit("max_bytes", b)?;
        }
        Ok(MatVecMemo {
            config,
            enabled: false,
            entries: HashMap::new(),
            queue: EvictionQueue::new(config.policy),
            tick: 0,
            stats: MemoStats::default(),
        })
    }

    /// Turns the memo on or off (entries are kept).
    pub fn enable(&mut self, on: bool) {
        self.enabled = on;
    }

    /// Whether the memo is on.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Current limits and policy.
    pub fn config(&self) -> MemoConfig {
        self.config
    }

    /// Sets the entry limit (≥ 1) and evicts down to it at once.
    pub fn set_max_entries(&mut self, n: usize) -> Result<(), MemoError> {
        check_limit("max_entries", n)?;
        self.config.max_entries = n;
        self.evict_to_fit(0, 0);
        Ok(())
    }

    /// Sets the byte limit (`None` = unbounded, else ≥ 1) and evicts down to it at once.
    pub fn set_max_bytes(&mut self, n: Option<usize>) -> Result<(), MemoError> {
        if let Some(b) = n {
            check_limit("max_bytes", b)?;
        }
        self.config.max_bytes = n;
        self.evict_to_fit(0, 0);
        Ok(())
    }

    /// Drops every entry (counters are kept).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.queue.clear();
        self.stats.entries = 0;
        self.stats.bytes = 0;
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> MemoStats {
        self.stats
    }

    /// The memo key of `(weight_id, x)`.
    pub fn key(weight_id: u64, x: &[f32]) -> CacheKey {
        CacheKey::Memo {
            weight_id,
            input_digest: f32_digest(x),
        }
    }

    /// The memoised `y` for `(weight_id, x)`. Disabled: `None` without counting.
    pub fn get(&mut self, weight_id: u64, x: &[f32]) -> Option<&[f32]> {
        if !self.enabled {
            return None;
        }
        self.tick += 1;
        let key = Self::key(weight_id, x);
        match self.entries.get(&key) {
            Some(e) => {
                // A hit saves the matvec: rows × columns multiply-adds.
                self.queue
                    .touch(key, self.tick, (e.y.len() * x.len()) as f64);
                self.stats.hits += 1;
                Some(&e.y)
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Memoises `y = W·x` for `(weight_id, x)`, evicting by policy if full (never the new
    /// entry). A non-finite `y` is refused.
    pub fn insert(
        &mut self,
        weight_id: u64,
        x: &[f32],
        y: &[f32],
    ) -> Result<MemoInsertOutcome, MemoError> {
        if let Some(index) = y.iter().position(|v| !v.is_finite()) {
            return Err(MemoError::NonFiniteOutput { index });
        }
        if !self.enabled {
            return Ok(MemoInsertOutcome::Disabled);
        }
        let bytes = MEMO_KEY_BYTES + 4 * y.len();
        if let Some(max) = self.config.max_bytes.filter(|&m| bytes > m) {
            self.tick += 1;
            return Ok(MemoInsertOutcome::SkippedTooLarge { bytes, max });
        }
        self.tick += 1;
        let key = Self::key(weight_id, x);
        if let Some(e) = self.entries.get(&key) {
            self.queue.touch(key, self.tick, 0.0);
            return Ok(MemoInsertOutcome::AlreadyPresent { bytes: e.bytes() });
        }
        self.evict_to_fit(1, bytes);
        let facts = EntryFacts {
            drift: pisot_drift(y),
            bytes,
            cost: (y.len() * x.len()) as f64,
        };
        self.queue.insert(key, facts, self.tick);
        self.entries.insert(key, MemoEntry { y: y.to_vec() });
        self.stats.bytes += bytes;
        self.stats.entries = self.entries.len();
        Ok(MemoInsertOutcome::Stored { bytes })
    }

    fn evict_to_fit(&mut self, incoming_entries: usize, incoming_bytes: usize) {
        let (max_entries, max_bytes) = (self.config.max_entries, self.config.max_bytes);
        loop {
            let entries = self.entries.len() + incoming_entries;
            if !over_limits(
                entries,
                self.stats.bytes + incoming_bytes,
                max_entries,
                max_bytes,
            ) {
                return;
            }
            let Some(victim) = self.queue.pop_victim(self.tick) else {
                return;
            };
            if let Some(e) = self.entries.remove(&victim) {
                self.stats.bytes -= e.bytes();
            }
            self.stats.entries = self.entries.len();
            self.stats.evictions += 1;
        }
    }
}

fn check_limit(setting: &'static str, value: usize) -> Result<(), MemoError> {
    if value == 0 {
        Err(MemoError::InvalidConfig { setting })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
