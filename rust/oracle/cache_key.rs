//! The Lean model of the two cache key spaces (Lean `CacheKey`, `keyTag`, `encodeKey`):
//! matvec-memo keys ("death1") and volume-cache keys ("death2"), serialised tag first so they
//! can never collide. The tags are the crate's real constants, [`crate::keys::MEMO_TAG`] and
//! [`crate::keys::VOLUME_TAG`], so the parity suite checks what the caches actually use. The
//! encoding here is the Lean one (a list of fields); the live caches' byte keys belong to the
//! cache modules.

use crate::keys::{MEMO_TAG, VOLUME_TAG};

/// A key of one of the two caches, as the Lean models it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeanCacheKey {
    /// MatVecMemo key (Lean `death1`), by the hash of the input vector.
    Memo {
        /// Hash of the matvec input.
        input_hash: u64,
    },
    /// Volume-cache key (Lean `death2`): model, prefix and layer range `[layer_lo, layer_hi)`.
    Volume {
        /// Hash of the model's content.
        model_fingerprint: u64,
        /// The wire prefix hash.
        prefix_hash: u64,
        /// First layer of the station's range.
        layer_lo: u16,
        /// One past the last layer of the range.
        layer_hi: u16,
    },
}

impl LeanCacheKey {
    /// The tag byte written first in the serialised key (Lean `keyTag`).
    pub fn tag(&self) -> u8 {
        match self {
            Self::Memo { .. } => MEMO_TAG,
            Self::Volume { .. } => VOLUME_TAG,
        }
    }

    /// The serialised key as fields, tag first (Lean `encodeKey`):
    /// memo `h ↦ [1, h]`, volume `(fp, ph, lo, hi) ↦ [2, fp, ph, lo, hi]`.
    pub fn encode(&self) -> Vec<u64> {
        let tag = u64::from(self.tag());
        match *self {
            Self::Memo { input_hash } => vec![tag, input_hash],
            Self::Volume {
                model_fingerprint,
                prefix_hash,
                layer_lo,
                layer_hi,
            } => vec![
                tag,
                model_fingerprint,
                prefix_hash,
                u64::from(layer_lo),
                u64::from(layer_hi),
            ],
        }
    }
}

#[cfg(test)]
mod tests;
