//! `NativeLlamaPipeline`: a layer range, its volume cache, and the seed's `amplituhedron_*`
//! calls (seed 000 §2), capturing from and splicing into a session's live ring.

use std::sync::Arc;

use super::SequenceKv;
use super::{LlamaWeights, ModelError};
use crate::ring::{KvDtype, KvSlice, SpanType};
use crate::volume::{
    AmplituhedronCache, AmplituhedronVolume, CacheConfig, CacheStats, CaptureOutcome,
    DamageOutcome, VolumeData, VolumeKey, BLOCK_POSITIONS,
};

/// What a replay did to the session.
#[derive(Clone, Debug, PartialEq)]
pub enum ReplayOutcome {
    /// No usable volume: the session is untouched (clock 0).
    Miss,
    /// The whole prompt was spliced in: the range's tail residual at the last position and,
    /// on the exit range, that position's logits (so the first token needs no model run).
    Hit {
        tail: Vec<f32>,
        logits: Option<Vec<f32>>,
    },
    /// Only the first `kv_len` positions were spliced in (the volume had been erased once
    /// after damage): the caller prefills the rest.
    Partial { kv_len: usize },
}

/// A layer range with its own volume cache.
pub struct NativeLlamaPipeline {
    weights: Arc<LlamaWeights>,
    layer_lo: usize,
    layer_hi: usize,
    cache: AmplituhedronCache,
    /// Shortest shared prefix worth replaying after an exact miss (0: exact replay only).
    min_prefix_reuse: usize,
    /// Key and value slabs gathered from a session for a capture, kept between captures: a
    /// fresh multi-megabyte buffer per capture costs a page fault per 4 KiB written. f32
    /// sessions fill the f32 pair, f16 sessions the bit patterns (their volumes store f16).
    capture_slabs: (Vec<f32>, Vec<f32>),
    capture_bits: (Vec<u16>, Vec<u16>),
}

/// Default of [`NativeLlamaPipeline::amplituhedron_set_min_prefix_reuse`]: below this many
/// shared positions a partial replay saves too little to be worth a lookup.
pub const DEFAULT_MIN_PREFIX_REUSE: usize = 16;

impl NativeLlamaPipeline {
    /// A pipeline over `[layer_lo, layer_hi)` with a volume cache configured by `cache`.
    pub fn new(
        weights: Arc<LlamaWeights>,
        layer_lo: usize,
        layer_hi: usize,
        cache: CacheConfig,
    ) -> Result<Self, ModelError> {
        let n = weights.config().n_layers;
        if layer_lo >= layer_hi || layer_hi > n {
            return Err(ModelError::Input(format!(
                "layer range {layer_lo}..{layer_hi} is not a non-empty part of 0..{n}"
            )));
        }
        let mut cache =
            AmplituhedronCache::new(cache).map_err(|e| ModelError::Volume(e.to_string()))?;
        // Volumes of other weights or config (e.g. left in a cache directory) never hit.
        cache.retain_model(weights.fingerprint());
        Ok(NativeLlamaPipeline {
            weights,
            layer_lo,
            layer_hi,
            cache,
            min_prefix_reuse: DEFAULT_MIN_PREFIX_REUSE,
            capture_slabs: (Vec::new(), Vec::new()),
            capture_bits: (Vec::new(), Vec::new()),
        })
    }

    /// The weights.
    pub fn weights(&self) -> &Arc<LlamaWeights> {
        &self.weights
    }

    /// `(layer_lo, layer_hi)`.
    pub fn layer_range(&self) -> (usize, usize) {
        (self.layer_lo, self.layer_hi)
    }

    /// The volume cache (read-only).
    pub fn cache(&self) -> &AmplituhedronCache {
        &self.cache
    }

    /// The volume cache.
    pub fn cache_mut(&mut self) -> &mut AmplituhedronCache {
        &mut self.cache
    }

    fn key<'a>(&self, tokens: &'a [u32], salt: Option<&'a str>) -> VolumeKey<'a> {
        VolumeKey {
            model_fingerprint: self.weights.fingerprint(),
            tokens,
            layer_lo: self.layer_lo as u16,
            layer_hi: self.layer_hi as u16,
            salt,
        }
    }

    fn check_kv(&self, kv: &SequenceKv) -> Result<(), ModelError> {
        let c = self.weights.config();
        if kv.layer_range() != (self.layer_lo, self.layer_hi) || kv.rings().row_len() != c.kv_dim()
        {
            let (lo, hi) = kv.layer_range();
            return Err(ModelError::Input(format!(
                "the session holds layers {lo}..{hi} of another model or range than this \
                 pipeline ({}..{})",
                self.layer_lo, self.layer_hi
            )));
        }
        Ok(())
    }

    fn is_exit(&self) -> bool {
        self.layer_hi == self.weights.config().n_layers
    }

    /// `amplituhedron_enable`.
    pub fn amplituhedron_enable(&mut self, on: bool) {
        self.cache.enable(on);
    }

    /// `amplituhedron_set_max_entries`.
    pub fn amplituhedron_set_max_entries(&mut self, n: usize) -> Result<(), ModelError> {
        self.cache
            .set_max_entries(n)
            .map_err(|e| ModelError::Volume(e.to_string()))
    }

    /// `amplituhedron_set_max_prefix_len`.
    pub fn amplituhedron_set_max_prefix_len(&mut self, n: usize) -> Result<(), ModelError> {
        self.cache
            .set_max_prefix_len(n)
            .map_err(|e| ModelError::Volume(e.to_string()))
    }

    /// `amplituhedron_set_max_bytes` (None: unbounded).
    pub fn amplituhedron_set_max_bytes(&mut self, n: Option<usize>) -> Result<(), ModelError> {
        self.cache
            .set_max_bytes(n)
            .map_err(|e| ModelError::Volume(e.to_string()))
    }

    /// Longest-prefix replay: after an exact miss, reuse a cached volume sharing at least
    /// `n` leading tokens with the prompt (0 turns it off: exact-prompt replay only).
    pub fn amplituhedron_set_min_prefix_reuse(&mut self, n: usize) {
        self.min_prefix_reuse = n;
    }

    /// The current longest-prefix threshold (0: off).
    pub fn min_prefix_reuse(&self) -> usize {
        self.min_prefix_reuse
    }

    /// `amplituhedron_clear`.
    pub fn amplituhedron_clear(&mut self) {
        self.cache.clear();
    }

    /// `amplituhedron_stats`.
    pub fn amplituhedron_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Applies the outcomes of volume writes that finished (see
    /// [`AmplituhedronCache::settle`]); before reading stats.
    pub fn amplituhedron_settle(&mut self) {
        self.cache.settle();
    }

    /// Waits until every queued volume write is on disk.
    pub fn amplituhedron_flush(&mut self) {
        self.cache.flush();
    }

    /// `amplituhedron_tail`: the tail residual stored under `prefix_hash`, if any.
    pub fn amplituhedron_tail(&self, prefix_hash: u64) -> Option<Vec<f32>> {
        self.cache.tail(prefix_hash)
    }

    /// Fault injection for tests and failure drills: poisons one position of the cached
    /// volume of `tokens` (see [`AmplituhedronCache::inject_fault`]).
    pub fn amplituhedron_inject_fault(
        &mut self,
        tokens: &[u32],
        position: usize,
        salt: Option<&str>,
    ) -> Result<bool, ModelError> {
        let key = self.key(tokens, salt);
        self.cache
            .inject_fault(&key, position)
            .map_err(|e| ModelError::Volume(e.to_string()))
    }

    /// `amplituhedron_capture`: freezes positions `[0, tokens.len())` of the session's live
    /// ring plus `tail` (and the exit range's `logits`) as a volume.
    ///
    /// The session may already have decoded past the prefix (capture runs off the latency
    /// path); the prefix positions must still be resident in the ring.
    pub fn amplituhedron_capture(
        &mut self,
        session: &SequenceKv,
        tokens: &[u32],
        tail: &[f32],
        logits: Option<&[f32]>,
        salt: Option<&str>,
    ) -> Result<CaptureOutcome, ModelError> {
        self.check_kv(session)?;
        let c = self.weights.config();
        if tokens.is_empty() {
            return Err(ModelError::Input(
                "an empty prefix has no volume (clinamen_swerve = 1)".into(),
            ));
        }
        if (session.clock() as usize) < tokens.len() {
            return Err(ModelError::Input(format!(
                "the session holds {} positions, fewer than the {}-token prefix",
                session.clock(),
                tokens.len()
            )));
        }
        if tail.len() != c.hidden {
            return Err(ModelError::Input(format!(
                "the tail residual has {} floats, expected {}",
                tail.len(),
                c.hidden
            )));
        }
        if logits.is_some() && !self.is_exit() {
            return Err(ModelError::Input(
                "only the exit range stores logits".into(),
            ));
        }
        let n = tokens.len();
        let layers = self.layer_hi - self.layer_lo;
        let kv_shape = [layers, c.n_kv_heads, n, c.head_dim()];
        let key = self.key(tokens, salt);
        let volume_err = |e: crate::volume::VolumeError| ModelError::Volume(e.to_string());
        let slab = layers * c.n_kv_heads * n * c.head_dim();
        let entry_bytes = AmplituhedronCache::entry_bytes(
            2 * slab * self.weights.kv_dtype().bytes(),
            tail.len(),
            logits.map_or(0, <[f32]>::len),
            n,
        );
        // Disabled, too long, too large or already cached: reported without gathering a slab.
        if let Some(outcome) = self.cache.decline(&key, entry_bytes) {
            return Ok(outcome);
        }
        // Sliding-window layers keep only their window: a prefix they no longer hold whole
        // cannot be captured exactly, so it is skipped as too long for this session.
        if let Some(max) = session.rings().capture_limit().filter(|&max| n > max) {
            return Ok(CaptureOutcome::SkippedTooLong { prefix_len: n, max });
        }
        // Reading writes every value of both slabs: only a grown part is zeroed here.
        let (kv_keys, kv_vals) = match self.weights.kv_dtype() {
            KvDtype::F32 => {
                let (keys, vals) = &mut self.capture_slabs;
                keys.resize(slab, 0.0);
                vals.resize(slab, 0.0);
                session.rings().read_prefix(n, keys, vals)?;
                (KvSlice::F32(keys), KvSlice::F32(vals))
            }
            KvDtype::F16 => {
                let (keys, vals) = &mut self.capture_bits;
                keys.resize(slab, 0);
                vals.resize(slab, 0);
                session.rings().read_prefix_bits(n, keys, vals)?;
                (KvSlice::F16(keys), KvSlice::F16(vals))
            }
        };
        let data = VolumeData {
            kv_shape,
            tail,
            kv_keys,
            kv_vals,
            logits,
        };
        self.cache.capture(&key, data).map_err(volume_err)
    }

    /// `amplituhedron_replay`: splices the volume of `tokens` into a fresh session.
    ///
    /// A damaged volume takes the erasure path (SPEC §2): damage at the trailing position
    /// trims it once and the shorter volume is replayed (`Partial`); deeper damage clears the
    /// entry (`Miss`). The session is untouched on a miss.
    pub fn amplituhedron_replay(
        &mut self,
        session: &mut SequenceKv,
        tokens: &[u32],
        salt: Option<&str>,
    ) -> Result<ReplayOutcome, ModelError> {
        self.check_kv(session)?;
        if tokens.is_empty() {
            return Err(ModelError::Input("an empty prefix has no volume".into()));
        }
        if session.clock() != 0 {
            return Err(ModelError::Input(format!(
                "replay needs a fresh session, this one is at position {}",
                session.clock()
            )));
        }
        let key = self.key(tokens, salt);
        let volume_err = |e: crate::volume::VolumeError| ModelError::Volume(e.to_string());
        // At most two rounds: the volume as stored, then once more after a trailing trim.
        for _ in 0..2 {
            let Some(vol) = self.cache.replay(&key).map_err(volume_err)? else {
                return self.replay_longest_prefix(session, &key);
            };
            if let Some(bad) = vol.first_non_finite_position() {
                match self.cache.report_damage(&key, bad).map_err(volume_err)? {
                    DamageOutcome::Trimmed { .. } => continue,
                    DamageOutcome::Cleared | DamageOutcome::Absent => {
                        return Ok(ReplayOutcome::Miss)
                    }
                }
            }
            let kv_len = vol.kv_len();
            splice(session, &vol, kv_len)?;
            return Ok(match vol.tail() {
                Some(tail) if kv_len == tokens.len() => ReplayOutcome::Hit {
                    tail: tail.to_vec(),
                    logits: vol.logits().map(<[f32]>::to_vec),
                },
                _ => ReplayOutcome::Partial { kv_len },
            });
        }
        Ok(ReplayOutcome::Miss)
    }

    /// After an exact miss: splice the longest cached shared prefix (SPEC §2, beyond the
    /// seeds), so e.g. a new question under a cached system prompt prefills only itself.
    fn replay_longest_prefix(
        &mut self,
        session: &mut SequenceKv,
        key: &VolumeKey<'_>,
    ) -> Result<ReplayOutcome, ModelError> {
        if self.min_prefix_reuse == 0 {
            return Ok(ReplayOutcome::Miss);
        }
        let volume_err = |e: crate::volume::VolumeError| ModelError::Volume(e.to_string());
        let Some((vol, usable)) = self
            .cache
            .replay_longest_prefix(key, self.min_prefix_reuse)
            .map_err(volume_err)?
        else {
            return Ok(ReplayOutcome::Miss);
        };
        if let Some(bad) = vol.first_non_finite_position().filter(|&p| p < usable) {
            // Damage inside the shared part: the erasure path of the volume's own entry.
            let own = VolumeKey {
                tokens: vol.tokens(),
                ..*key
            };
            self.cache.report_damage(&own, bad).map_err(volume_err)?;
            return Ok(ReplayOutcome::Miss);
        }
        splice(session, &vol, usable)?;
        Ok(ReplayOutcome::Partial { kv_len: usable })
    }
}

/// Writes positions `[0, kv_len)` of `vol` into a fresh sequence straight from its blocks,
/// through the ring's own append path in the same span pieces prefill uses, so the ring state
/// (table, spans) equals a cold prefill's exactly.
fn splice(
    session: &mut SequenceKv,
    vol: &AmplituhedronVolume,
    kv_len: usize,
) -> Result<(), ModelError> {
    let blocks: Vec<_> = vol.blocks().iter().map(|b| (b.keys(), b.vals())).collect();
    session.append_blocks(&blocks, BLOCK_POSITIONS, kv_len, SpanType::User)
}
