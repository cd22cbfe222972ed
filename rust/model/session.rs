//! `RangeSession`: one sequence run alone over a layer range — its KV ring plus its own work
//! buffers. Stations and tests use it; batched serving uses [`LayerRange::forward_batch`]
//! with many [`SequenceKv`]s and one [`StepBuffers`] instead, with identical results.

use std::sync::Arc;

use super::forward::{ChunkInput, LayerRange, LogitsWanted, Segment, StepBuffers};
use super::kv::{SequenceKv, SessionConfig};
use super::rings::LayerRings;
use super::{LlamaWeights, ModelError};
use crate::ring::SpanType;

/// One session's live state for the layer range `[layer_lo, layer_hi)`.
pub struct RangeSession {
    range: LayerRange,
    kv: SequenceKv,
    bufs: StepBuffers,
}

impl RangeSession {
    /// A fresh session (clock 0) over `[layer_lo, layer_hi)` of `weights`.
    pub fn new(
        weights: Arc<LlamaWeights>,
        layer_lo: usize,
        layer_hi: usize,
        cfg: &SessionConfig,
    ) -> Result<Self, ModelError> {
        let range = LayerRange::new(weights, layer_lo, layer_hi)?;
        let kv = range.new_kv(cfg)?;
        // Work buffers for one row: a round grows them to its rows (`StepBuffers::reserve`),
        // so a session that only decodes (most of a station's) never holds a chunk's worth
        // (62.5 MB for a 256-row chunk at 7B, written at creation).
        let bufs = StepBuffers::new(range.weights().config(), 1, kv.rings().max_keys());
        Ok(RangeSession { range, kv, bufs })
    }

    /// The layer range this session runs.
    pub fn range(&self) -> &LayerRange {
        &self.range
    }

    /// The session's KV.
    pub fn kv(&self) -> &SequenceKv {
        &self.kv
    }

    /// The session's KV, mutably.
    pub fn kv_mut(&mut self) -> &mut SequenceKv {
        &mut self.kv
    }

    /// First layer of the range.
    pub fn layer_lo(&self) -> usize {
        self.range.layer_lo()
    }

    /// One past the last layer of the range.
    pub fn layer_hi(&self) -> usize {
        self.range.layer_hi()
    }

    /// True when this range embeds token ids.
    pub fn is_entry(&self) -> bool {
        self.range.is_entry()
    }

    /// True when this range applies the final norm and the LM head.
    pub fn is_exit(&self) -> bool {
        self.range.is_exit()
    }

    /// Positions processed so far (the ring's clock).
    pub fn clock(&self) -> u64 {
        self.kv.clock()
    }

    /// The live KV rings (read-only).
    pub fn rings(&self) -> &LayerRings {
        self.kv.rings()
    }

    /// Physical KV slots of each layer of the range (sliding layers keep only their window).
    pub fn kv_slots(&self) -> Vec<usize> {
        self.kv.rings().slots_per_layer()
    }

    /// The weights this session runs.
    pub fn weights(&self) -> &Arc<LlamaWeights> {
        self.range.weights()
    }

    /// Rows computed together in one prefill piece.
    pub fn max_chunk(&self) -> usize {
        self.kv.max_chunk()
    }

    /// The session's KV for a batched pass over `range` (with [`LayerRange::forward_batch`]
    /// and one shared [`StepBuffers`]): refused unless the session runs the same weights
    /// (the same mapping, not just an equal model) and the same layers.
    pub fn kv_for(&mut self, range: &LayerRange) -> Result<&mut SequenceKv, ModelError> {
        if !Arc::ptr_eq(self.range.weights(), range.weights()) {
            return Err(ModelError::Input(
                "the session runs other weights than the batch".into(),
            ));
        }
        if (self.layer_lo(), self.layer_hi()) != (range.layer_lo(), range.layer_hi()) {
            return Err(ModelError::Input(format!(
                "the session runs layers {}..{}, the batch {}..{}",
                self.layer_lo(),
                self.layer_hi(),
                range.layer_lo(),
                range.layer_hi()
            )));
        }
        Ok(&mut self.kv)
    }

    /// Forgets every position (clock 0) without giving the allocation back.
    pub fn reset(&mut self) {
        self.kv.reset();
    }

    /// See [`SequenceKv::append_volume`].
    pub fn append_volume(
        &mut self,
        keys: &[f32],
        vals: &[f32],
        stride: usize,
        kv_len: usize,
        span: SpanType,
    ) -> Result<(), ModelError> {
        self.kv.append_volume(keys, vals, stride, kv_len, span)
    }

    /// Undoes every position after `saved` (probe tokens); bit-exact.
    pub fn rollback(&mut self, saved: u64) -> Result<(), ModelError> {
        self.kv.rollback(saved)
    }

    /// Runs `input` through the range, appending its positions to the ring as `span`.
    ///
    /// Writes the range's output residual rows (`n × hidden`) to `hidden_out` and, for the exit
    /// range, the requested logits rows (`× vocab`) to `logits_out`. On error nothing changes.
    pub fn forward(
        &mut self,
        input: ChunkInput<'_>,
        span: SpanType,
        logits: LogitsWanted,
        hidden_out: &mut Vec<f32>,
        logits_out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let mut segment = [Segment {
            kv: &mut self.kv,
            input,
            span,
            logits,
            hidden_out,
            logits_out,
            shared_prefix: None,
        }];
        self.range.forward_batch(&mut segment, &mut self.bufs)
    }
}
