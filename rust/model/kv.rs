//! One sequence's KV memory for a layer range: its ring buffers plus the rules that cut an
//! append into pieces (chunk size, anchor boundary, span boundaries).
//!
//! This is the per-sequence half of a forward pass (llama.cpp keeps per-sequence memory apart
//! from the batch and the compute context the same way): a batched step borrows several
//! `SequenceKv`s and one set of work buffers ([`super::StepBuffers`]).

use super::rings::LayerRings;
use super::{ModelConfig, ModelError};
use crate::ring::{KvDtype, KvSlice, SpanType};

/// Positions per semantic span: spans open at multiples of this (and at `n_sys`), small
/// enough that span-aware eviction frees the window in reasonable steps, and fixed so the
/// span layout never depends on chunking. Smaller windows use half their length.
pub const SPAN_TOKENS: u64 = 256;

/// Sizes of a sequence's ring buffer and of the pieces an append is cut into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionConfig {
    /// Physical KV slots per layer (default 4096; at most the trained context).
    pub slots: usize,
    /// Recall slots reserved at the top of the ring (default 128).
    pub recall: usize,
    /// Locked anchor slots for the system prompt (default 0).
    pub n_sys: usize,
    /// Rows appended together in one piece (default 256). Results never depend on it.
    pub max_chunk: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            slots: 4096,
            recall: 128,
            n_sys: 0,
            max_chunk: 256,
        }
    }
}

/// The KV rings of one sequence over `[layer_lo, layer_hi)`: one for the range's global
/// layers and, for a model with sliding-window layers, one that holds only the window
/// ([`LayerRings`]).
#[derive(Debug)]
pub struct SequenceKv {
    layer_lo: usize,
    layer_hi: usize,
    rings: LayerRings,
}

impl SequenceKv {
    /// Empty rings (clock 0) for `[layer_lo, layer_hi)` of a model shaped like `c`.
    pub fn new(
        c: &ModelConfig,
        layer_lo: usize,
        layer_hi: usize,
        cfg: &SessionConfig,
        kv_dtype: KvDtype,
    ) -> Result<Self, ModelError> {
        Ok(SequenceKv {
            layer_lo,
            layer_hi,
            rings: LayerRings::new(c, layer_lo, layer_hi, cfg, kv_dtype)?,
        })
    }

    /// `(layer_lo, layer_hi)`.
    pub fn layer_range(&self) -> (usize, usize) {
        (self.layer_lo, self.layer_hi)
    }

    /// Positions held so far (the rings' clock).
    pub fn clock(&self) -> u64 {
        self.rings.clock()
    }

    /// The rings (read-only).
    pub fn rings(&self) -> &LayerRings {
        &self.rings
    }

    /// The rings, for the forward pass's append protocol.
    pub fn rings_mut(&mut self) -> &mut LayerRings {
        &mut self.rings
    }

    /// Rows appended together in one piece.
    pub fn max_chunk(&self) -> usize {
        self.rings.max_chunk()
    }

    /// Forgets every position (clock 0) without giving the allocation back.
    pub fn reset(&mut self) {
        self.rings.reset();
    }

    /// Undoes every position after `saved` (probe tokens, rejected drafts); bit-exact.
    pub fn rollback(&mut self, saved: u64) -> Result<(), ModelError> {
        self.rings.rollback(saved)
    }

    /// Where the next piece of an append starting at the current clock ends, and whether it
    /// opens a new span. Pieces never cross `max_chunk`, the anchor boundary `n_sys`, or a
    /// multiple of the span length; spans open at those fixed positions (or when the span type
    /// changes), so the span layout — and with it span-aware eviction — never depends on
    /// how a caller chunked or batched its input, nor on whether positions were replayed or
    /// prefilled.
    pub(crate) fn next_piece(&self, remaining: usize, span: SpanType) -> (usize, bool) {
        let clock = self.rings.clock();
        let n_sys = self.rings.n_sys() as u64;
        let span_tokens = self.rings.span_tokens();
        let mut end = clock + remaining.min(self.rings.max_chunk()) as u64;
        end = end.min((clock / span_tokens + 1) * span_tokens);
        if clock < n_sys {
            end = end.min(n_sys);
        }
        let open_same = self
            .rings
            .spans()
            .last()
            .is_some_and(|s| s.end_clock == clock && s.span_type == span);
        let new_span = clock.is_multiple_of(span_tokens) || clock == n_sys || !open_same;
        ((end - clock) as usize, new_span)
    }

    /// Appends the first `kv_len` positions of a volume slab (layout
    /// `(layers, kv_heads, stride, head_dim)`) through the rings' own append path, in the
    /// same pieces and spans prefill would use, so the rings end up exactly as a cold prefill
    /// leaves them. On error the sequence is back where it started.
    pub fn append_volume(
        &mut self,
        keys: &[f32],
        vals: &[f32],
        stride: usize,
        kv_len: usize,
        span: SpanType,
    ) -> Result<(), ModelError> {
        self.append_blocks(&[(keys.into(), vals.into())], stride, kv_len, span)
    }

    /// Like [`append_volume`](Self::append_volume), for a volume held in consecutive blocks
    /// of `block` positions (the last may hold fewer), each `(keys, values)` laid out
    /// `(layers, kv_heads, positions, head_dim)`: the first `kv_len` positions of their
    /// concatenation, written straight from the blocks.
    pub fn append_blocks(
        &mut self,
        blocks: &[(KvSlice<'_>, KvSlice<'_>)],
        block: usize,
        kv_len: usize,
        span: SpanType,
    ) -> Result<(), ModelError> {
        let layers = self.layer_hi - self.layer_lo;
        let per_position = layers * self.rings.row_len();
        let mut positions = 0;
        for (b, (keys, vals)) in blocks.iter().enumerate() {
            let held = keys.len() / per_position.max(1);
            let last = b + 1 == blocks.len();
            let whole = held * per_position == keys.len() && vals.len() == keys.len();
            if !whole || held == 0 || held > block || (!last && held != block) {
                return Err(ModelError::Input(format!(
                    "block {b} of the volume holds {} floats: not {layers} layers of \
                     {} floats for {block} positions (fewer only in the last block)",
                    keys.len(),
                    per_position / layers.max(1)
                )));
            }
            positions += held;
        }
        if kv_len == 0 || kv_len > positions {
            return Err(ModelError::Input(format!(
                "{kv_len} positions of a {layers}-layer volume of {positions} positions"
            )));
        }
        let saved = self.rings.clock();
        let mut from = 0;
        while from < kv_len {
            let (n, new_span) = self.next_piece(kv_len - from, span);
            self.rings.begin_append(n, span, new_span)?;
            let written = (0..layers)
                .try_for_each(|layer| self.rings.write_pending_blocks(layer, blocks, block, from));
            if let Err(e) = written.and_then(|()| self.rings.commit_append()) {
                self.rings.abort_append();
                let _ = self.rings.rollback(saved);
                return Err(e);
            }
            from += n;
        }
        Ok(())
    }
}
