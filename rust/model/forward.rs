//! `forward_range` for a batch: several sequences' rows through one layer range in one pass.
//!
//! The weights are read once per pass for every row of the batch (the matmuls take all rows
//! together), while attention stays per sequence, over that sequence's own ring. Every kernel
//! is batch-invariant — a row's result never depends on which other rows share the pass —
//! so a sequence's hidden states and logits are bit-identical whether it runs alone, in a
//! batch, chunked or whole.
//!
//! The three parts are kept apart, as llama.cpp keeps batch, context and per-sequence memory
//! apart: [`LayerRange`] (weights + which layers), [`SequenceKv`] (one sequence's ring) and
//! [`StepBuffers`] (work buffers, one set serving the whole batch, grown on demand and then
//! reused, so steady-state steps allocate nothing).

use std::sync::Arc;

use super::config::{Activation, RopeStyle};
use super::kv::SequenceKv;
use super::ops::{
    add_in_place, geglu_tanh, rms_norm, rms_norm_in_place, rope_angles, rope_apply,
    rope_apply_halves, rope_inv_freq, scale_in_place, swiglu,
};
use super::{LlamaWeights, ModelConfig, ModelError, Precision};
use crate::attention::{attend_batch, shareable_window, AttnScratch, PendingChunk, SharedPrefix};
use crate::quant::{
    fold_refined, matmul_many_prefetching, GgmlType, QMatrix, QuantScratch, QuantizedInput,
    SidePrefetch,
};
use crate::ring::{DynamicRingBuffer, KvSlice, SpanType};

/// What a range consumes: token ids at the entry range, hidden states elsewhere.
#[derive(Clone, Copy, Debug)]
pub enum ChunkInput<'a> {
    /// Token ids (entry range only).
    Tokens(&'a [u32]),
    /// Residual-stream rows, `n × hidden`, from the previous range (never the entry range).
    Hidden(&'a [f32]),
}

impl<'a> ChunkInput<'a> {
    fn rows(&self, hidden: usize) -> usize {
        match self {
            ChunkInput::Tokens(t) => t.len(),
            ChunkInput::Hidden(h) => h.len() / hidden,
        }
    }

    fn slice(&self, hidden: usize, start: usize, len: usize) -> ChunkInput<'a> {
        match *self {
            ChunkInput::Tokens(t) => ChunkInput::Tokens(&t[start..start + len]),
            ChunkInput::Hidden(h) => ChunkInput::Hidden(&h[start * hidden..(start + len) * hidden]),
        }
    }
}

/// Which rows of an exit range get LM-head logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// No logits (prefill chunks before the last one; never the exit range's decode).
    None,
    /// Logits of the last row only.
    Last,
    /// Logits of every row (parity tests, speculative verification).
    All,
}

/// One sequence's part of a batched forward pass.
pub struct Segment<'a> {
    /// The sequence's KV; its rows are appended at its current clock.
    pub kv: &'a mut SequenceKv,
    /// The rows to run.
    pub input: ChunkInput<'a>,
    /// The semantic span the rows belong to.
    pub span: SpanType,
    /// Which rows get logits (exit range only).
    pub logits: LogitsWanted,
    /// Receives the range's output residual rows (`n × hidden`).
    pub hidden_out: &'a mut Vec<f32>,
    /// Receives the requested logits rows (`× vocab`).
    pub logits_out: &'a mut Vec<f32>,
    /// Another segment of the batch (`chunk`: its index) whose sequence has the same tokens
    /// at clocks `0..clocks`: attention reads those K/V rows from its ring (one copy in the
    /// caches for every sequence sharing a system prompt), with the same result.
    pub shared_prefix: Option<SharedPrefix>,
}

/// The layers `[layer_lo, layer_hi)` of some weights: the unit a station runs.
#[derive(Clone)]
pub struct LayerRange {
    weights: Arc<LlamaWeights>,
    layer_lo: usize,
    layer_hi: usize,
}

impl LayerRange {
    /// The range `[layer_lo, layer_hi)`; it must be a non-empty part of the model.
    pub fn new(
        weights: Arc<LlamaWeights>,
        layer_lo: usize,
        layer_hi: usize,
    ) -> Result<Self, ModelError> {
        let n = weights.config().n_layers;
        if layer_lo >= layer_hi || layer_hi > n {
            return Err(ModelError::Input(format!(
                "layer range {layer_lo}..{layer_hi} is not a non-empty part of 0..{n}"
            )));
        }
        if !weights.holds(layer_lo, layer_hi) {
            let (lo, hi) = weights.layers_held();
            return Err(ModelError::Input(format!(
                "these weights hold layers {lo}..{hi}, not all of {layer_lo}..{layer_hi}"
            )));
        }
        if layer_hi == n {
            // The exit range makes the head's copy now, not in its first request.
            weights.lm_head()?;
        }
        Ok(LayerRange {
            weights,
            layer_lo,
            layer_hi,
        })
    }

    /// The weights.
    pub fn weights(&self) -> &Arc<LlamaWeights> {
        &self.weights
    }

    /// First layer of the range.
    pub fn layer_lo(&self) -> usize {
        self.layer_lo
    }

    /// One past the last layer of the range.
    pub fn layer_hi(&self) -> usize {
        self.layer_hi
    }

    /// True when this range embeds token ids.
    pub fn is_entry(&self) -> bool {
        self.layer_lo == 0
    }

    /// True when this range applies the final norm and the LM head.
    pub fn is_exit(&self) -> bool {
        self.layer_hi == self.weights.config().n_layers
    }

    /// An empty KV ring for one sequence over this range.
    pub fn new_kv(&self, cfg: &super::SessionConfig) -> Result<SequenceKv, ModelError> {
        SequenceKv::new(
            self.weights.config(),
            self.layer_lo,
            self.layer_hi,
            cfg,
            self.weights.kv_dtype(),
        )
    }

    /// Runs every segment's rows through the range, appending them to its sequence's ring.
    ///
    /// Each segment is cut into the pieces its own ring allows (see
    /// `SequenceKv::next_piece`); every round runs the next piece of every unfinished
    /// segment together. On error nothing changes: every ring is rolled back to where it was
    /// and the outputs are cleared.
    pub fn forward_batch(
        &self,
        segments: &mut [Segment<'_>],
        bufs: &mut StepBuffers,
    ) -> Result<(), ModelError> {
        super::run_on_pool(|| self.forward_batch_in_pool(segments, bufs))
    }

    /// [`Self::forward_batch`], with `alongside` run on the pool while the forward runs
    /// (whichever worker is free takes it): work the step needs after the forward that does
    /// not depend on it, such as the next tokens' grammar masks. It must not run a pass.
    pub fn forward_batch_alongside<A: Send>(
        &self,
        segments: &mut [Segment<'_>],
        bufs: &mut StepBuffers,
        alongside: impl FnOnce() -> A + Send,
    ) -> (Result<(), ModelError>, A) {
        super::run_on_pool(|| rayon::join(|| self.forward_batch_in_pool(segments, bufs), alongside))
    }

    fn forward_batch_in_pool(
        &self,
        segments: &mut [Segment<'_>],
        bufs: &mut StepBuffers,
    ) -> Result<(), ModelError> {
        let hidden = self.weights.config().hidden;
        for (i, seg) in segments.iter().enumerate() {
            self.validate(seg)?;
            if let Some(sp) = seg
                .shared_prefix
                .filter(|sp| sp.chunk >= segments.len() || sp.chunk == i)
            {
                return Err(ModelError::Input(format!(
                    "segment {i} shares a prefix with segment {}: not another of the {} segments",
                    sp.chunk,
                    segments.len()
                )));
            }
        }
        let saved: Vec<u64> = segments.iter().map(|s| s.kv.clock()).collect();
        let total_rows: Vec<usize> = segments.iter().map(|s| s.input.rows(hidden)).collect();
        let vocab = self.weights.config().vocab;
        for (seg, &n) in segments.iter_mut().zip(&total_rows) {
            seg.hidden_out.clear();
            seg.logits_out.clear();
            // The outputs grow with the caller's row count: reserve them fallibly up front, so
            // an input too large to answer is refused instead of aborting the process.
            let logit_rows = match seg.logits {
                LogitsWanted::All => n,
                LogitsWanted::Last => 1,
                LogitsWanted::None => 0,
            };
            reserve_output(seg.hidden_out, n, hidden)?;
            if self.is_exit() {
                reserve_output(seg.logits_out, logit_rows, vocab)?;
            }
        }
        let mut done = vec![0usize; segments.len()];
        let mut round: Vec<Piece> = Vec::with_capacity(segments.len());
        loop {
            round.clear();
            for (index, seg) in segments.iter().enumerate() {
                let remaining = total_rows[index] - done[index];
                if remaining == 0 {
                    continue;
                }
                let (len, new_span) = seg.kv.next_piece(remaining, seg.span);
                let last = done[index] + len == total_rows[index];
                let logits = match seg.logits {
                    LogitsWanted::All => LogitsWanted::All,
                    LogitsWanted::Last if last => LogitsWanted::Last,
                    _ => LogitsWanted::None,
                };
                round.push(Piece {
                    index,
                    start: done[index],
                    len,
                    new_span,
                    logits,
                });
            }
            if round.is_empty() {
                return Ok(());
            }
            if let Err(e) = self.run_round(segments, &round, bufs) {
                for (seg, &clock) in segments.iter_mut().zip(&saved) {
                    let _ = seg.kv.rollback(clock);
                    seg.hidden_out.clear();
                    seg.logits_out.clear();
                }
                return Err(e);
            }
            let mut row = 0;
            for p in &round {
                let seg = &mut segments[p.index];
                seg.hidden_out
                    .extend_from_slice(&bufs.x[row * hidden..(row + p.len) * hidden]);
                done[p.index] += p.len;
                row += p.len;
            }
        }
    }

    fn validate(&self, seg: &Segment<'_>) -> Result<(), ModelError> {
        let c = self.weights.config();
        if seg.kv.layer_range() != (self.layer_lo, self.layer_hi) {
            let (lo, hi) = seg.kv.layer_range();
            return Err(ModelError::Input(format!(
                "a KV ring of layers {lo}..{hi} cannot run layers {}..{}",
                self.layer_lo, self.layer_hi
            )));
        }
        match seg.input {
            ChunkInput::Tokens(t) => {
                if !self.is_entry() {
                    return Err(ModelError::Input(format!(
                        "layers {}..{} take hidden states, not token ids",
                        self.layer_lo, self.layer_hi
                    )));
                }
                if t.is_empty() {
                    return Err(ModelError::Input("no tokens to run".into()));
                }
                if let Some(bad) = t.iter().find(|&&id| id as usize >= c.vocab) {
                    return Err(ModelError::Input(format!(
                        "token id {bad} is outside the vocabulary of {}",
                        c.vocab
                    )));
                }
            }
            ChunkInput::Hidden(h) => {
                if self.is_entry() {
                    return Err(ModelError::Input(
                        "the entry range (layer 0) takes token ids, not hidden states".into(),
                    ));
                }
                if h.is_empty() || h.len() % c.hidden != 0 {
                    return Err(ModelError::Input(format!(
                        "hidden states must be n × {} floats, got {}",
                        c.hidden,
                        h.len()
                    )));
                }
                if let Some(i) = h.iter().position(|v| !v.is_finite()) {
                    return Err(ModelError::Input(format!(
                        "hidden state value {i} is not finite ({})",
                        h[i]
                    )));
                }
            }
        }
        if seg.logits != LogitsWanted::None && !self.is_exit() {
            return Err(ModelError::Input(format!(
                "layers {}..{} are not the exit range: no logits",
                self.layer_lo, self.layer_hi
            )));
        }
        Ok(())
    }

    /// One round: the next piece of each listed segment, appended to its ring and run through
    /// every layer together. On error every ring of the round is as it was.
    fn run_round(
        &self,
        segments: &mut [Segment<'_>],
        round: &[Piece],
        bufs: &mut StepBuffers,
    ) -> Result<(), ModelError> {
        for (k, p) in round.iter().enumerate() {
            let seg = &mut segments[p.index];
            if let Err(e) = seg.kv.rings_mut().begin_append(p.len, seg.span, p.new_span) {
                for q in &round[..k] {
                    segments[q.index].kv.rings_mut().abort_append();
                }
                return Err(e);
            }
        }
        let logits_at: Vec<usize> = round
            .iter()
            .map(|p| segments[p.index].logits_out.len())
            .collect();
        let result = self.run_layers(segments, round, bufs).and_then(|()| {
            for p in round {
                segments[p.index].kv.rings_mut().commit_append()?;
            }
            Ok(())
        });
        if result.is_err() {
            for (p, &at) in round.iter().zip(&logits_at) {
                let seg = &mut segments[p.index];
                // Committed pieces are undone by the caller's rollback; pending ones here.
                seg.kv.rings_mut().abort_append();
                seg.logits_out.truncate(at);
            }
        }
        result
    }

    /// The layers of one round after `begin_append`; the caller commits or aborts.
    fn run_layers(
        &self,
        segments: &mut [Segment<'_>],
        round: &[Piece],
        bufs: &mut StepBuffers,
    ) -> Result<(), ModelError> {
        let weights = &*self.weights;
        let c = weights.config();
        let recipe = c.recipe();
        let (hidden, q_dim, kv_dim, hd, ffn) =
            (c.hidden, c.q_dim(), c.kv_dim(), c.head_dim(), c.ffn);
        let half = hd / 2;
        let n: usize = round.iter().map(|p| p.len).sum();
        let max_keys = round
            .iter()
            .map(|p| segments[p.index].kv.rings().max_keys())
            .max()
            .unwrap_or(0);
        bufs.reserve(c, n, max_keys);
        let b = bufs;
        let quant_err = |e: crate::quant::QuantError| ModelError::Weights(e.to_string());
        let precision = weights.precision();
        let has_local = (self.layer_lo..self.layer_hi).any(|l| c.is_local(l));
        // Llama 3.1/3.2 frequency divisors (`rope_freqs.weight`), on every layer as llama.cpp.
        let rope_factors = weights.rope_factors();
        // Inputs, and RoPE angles: global layers rotate at the absolute clock (window) and
        // at the StreamingLLM cache position (fixed segment; identical until the window
        // first wraps, which is the usual case: then q_fixed is q itself); sliding layers
        // rotate at the clock with their own base.
        let inv_freq = rope_inv_freq(hd, c.rope_base);
        let inv_freq_local = match (has_local, &c.sliding) {
            (true, Some(s)) => Some(rope_inv_freq(hd, s.rope_base)),
            _ => None,
        };
        let mut row = 0;
        let mut fixed_differs = false;
        for p in round {
            let seg = &segments[p.index];
            let piece = seg.input.slice(hidden, p.start, p.len);
            let x = &mut b.x[row * hidden..(row + p.len) * hidden];
            match piece {
                ChunkInput::Tokens(ids) => {
                    weights.embedding()?.embed(ids, x).map_err(quant_err)?;
                    if recipe.scale_embeddings {
                        scale_in_place(x, c.embed_scale());
                    }
                }
                ChunkInput::Hidden(h) => x.copy_from_slice(h),
            }
            let rings = seg.kv.rings();
            for i in 0..p.len {
                let pos = rings.pending_clock(i);
                let cache_pos = rings.pending_cache_pos(i);
                let r = (row + i) * half..(row + i + 1) * half;
                rope_angles(
                    pos,
                    &inv_freq,
                    rope_factors,
                    &mut b.cos_w[r.clone()],
                    &mut b.sin_w[r.clone()],
                );
                if cache_pos == pos {
                    // The same angles (the cache has not wrapped).
                    b.cos_f[r.clone()].copy_from_slice(&b.cos_w[r.clone()]);
                    b.sin_f[r.clone()].copy_from_slice(&b.sin_w[r.clone()]);
                } else {
                    fixed_differs = true;
                    rope_angles(
                        cache_pos,
                        &inv_freq,
                        rope_factors,
                        &mut b.cos_f[r.clone()],
                        &mut b.sin_f[r.clone()],
                    );
                }
                if let Some(local) = &inv_freq_local {
                    rope_angles(
                        pos,
                        local,
                        rope_factors,
                        &mut b.cos_l[r.clone()],
                        &mut b.sin_l[r],
                    );
                }
            }
            row += p.len;
        }
        let rotate = match recipe.rope_style {
            RopeStyle::Adjacent => rope_apply,
            RopeStyle::Halves => rope_apply_halves,
        };
        for layer in self.layer_lo..self.layer_hi {
            let lw = weights.layer(layer)?;
            let ring_layer = layer - self.layer_lo;
            let window = c.window_of(layer);
            rms_norm(
                &b.x[..n * hidden],
                lw.attn_norm,
                c.rms_eps,
                &mut b.h[..n * hidden],
            );
            {
                let mut p = Projector::new(
                    &b.h[..n * hidden],
                    n,
                    precision,
                    &mut b.mm,
                    &[&lw.wq, &lw.wk, &lw.wv],
                )?;
                p.apply_many(&mut [
                    (&lw.wq, &mut b.q[..n * q_dim]),
                    (&lw.wk, &mut b.k[..n * kv_dim]),
                    (&lw.wv, &mut b.v[..n * kv_dim]),
                ])?;
            }
            add_bias(&mut b.q[..n * q_dim], lw.bq);
            add_bias(&mut b.k[..n * kv_dim], lw.bk);
            add_bias(&mut b.v[..n * kv_dim], lw.bv);
            if let (Some(qn), Some(kn)) = (lw.q_norm, lw.k_norm) {
                rms_norm_in_place(&mut b.q[..n * q_dim], qn, c.rms_eps);
                rms_norm_in_place(&mut b.k[..n * kv_dim], kn, c.rms_eps);
            }
            // The chunk's own rows are attended as the ring will store them, so a position
            // scores the same whether it is still local or already in the ring (chunked ≡
            // whole).
            let kv_dtype = weights.kv_dtype();
            // Sliding layers have no anchors or recall rows: one rotation serves every key.
            let layer_fixed = fixed_differs && window.is_none();
            for i in 0..n {
                let r = i * half..(i + 1) * half;
                let (cw, sw) = if window.is_some() {
                    (&b.cos_l[r.clone()], &b.sin_l[r.clone()])
                } else {
                    (&b.cos_w[r.clone()], &b.sin_w[r.clone()])
                };
                rotate(&mut b.k[i * kv_dim..(i + 1) * kv_dim], hd, cw, sw);
                let q_row = &mut b.q[i * q_dim..(i + 1) * q_dim];
                if layer_fixed {
                    let qf = &mut b.q_fixed[i * q_dim..(i + 1) * q_dim];
                    qf.copy_from_slice(q_row);
                    rotate(qf, hd, &b.cos_f[r.clone()], &b.sin_f[r]);
                }
                rotate(q_row, hd, cw, sw);
            }
            kv_dtype.round_slice(&mut b.k[..n * kv_dim]);
            kv_dtype.round_slice(&mut b.v[..n * kv_dim]);
            {
                let q_fixed = if layer_fixed { &b.q_fixed } else { &b.q };
                let mut chunks = Vec::with_capacity(round.len());
                let mut ring_index = 0;
                let mut row = 0;
                for p in round {
                    let (qr, kr) = (
                        row * q_dim..(row + p.len) * q_dim,
                        row * kv_dim..(row + p.len) * kv_dim,
                    );
                    // Every sequence of the range places a layer in the same ring and index.
                    let (ring, index) = segments[p.index].kv.rings().layer(ring_layer);
                    ring_index = index;
                    chunks.push(PendingChunk {
                        ring,
                        q_fixed: &q_fixed[qr.clone()],
                        q_window: &b.q[qr],
                        local_k: &b.k[kr.clone()],
                        local_v: &b.v[kr],
                        window,
                        shared_prefix: round_shared_prefix(segments, round, p),
                    });
                    row += p.len;
                }
                attend_batch(
                    &chunks,
                    ring_index,
                    c.n_heads,
                    c.attn_scale,
                    &mut b.attn_scratch,
                    &mut b.attn[..n * q_dim],
                )
                .map_err(|e| ModelError::Ring(e.to_string()))?;
            }
            let mut row = 0;
            for p in round {
                let kr = row * kv_dim..(row + p.len) * kv_dim;
                segments[p.index].kv.rings_mut().write_pending(
                    ring_layer,
                    &b.k[kr.clone()],
                    &b.v[kr],
                )?;
                row += p.len;
            }
            Projector::new(&b.attn[..n * q_dim], n, precision, &mut b.mm, &[&lw.wo])?
                .apply(&lw.wo, &mut b.proj[..n * hidden])?;
            if let Some(w) = lw.post_attn_norm {
                rms_norm_in_place(&mut b.proj[..n * hidden], w, c.rms_eps);
            }
            add_in_place(&mut b.x[..n * hidden], &b.proj[..n * hidden]);
            rms_norm(
                &b.x[..n * hidden],
                lw.ffn_norm,
                c.rms_eps,
                &mut b.h[..n * hidden],
            );
            // With several rows the FFN is compute-bound and the next layer's attention
            // memory-bound: its K/V history comes into cache while the FFN computes, on
            // CPUs where that overlaps (`SidePrefetch::pays_off`).
            b.kv_ahead.clear();
            if n >= PREFETCH_KV_FROM_ROWS && layer + 1 < self.layer_hi && SidePrefetch::pays_off() {
                list_history(
                    &mut b.kv_ahead,
                    segments,
                    round,
                    ring_layer + 1,
                    c.window_of(layer + 1),
                );
                b.kv_ahead.spread_over(2 * ffn + hidden);
            }
            {
                let mut p = Projector::new(
                    &b.h[..n * hidden],
                    n,
                    precision,
                    &mut b.mm,
                    &[&lw.w_gate, &lw.w_up],
                )?;
                p.apply_many_prefetching(
                    &mut [
                        (&lw.w_gate, &mut b.gate[..n * ffn]),
                        (&lw.w_up, &mut b.up[..n * ffn]),
                    ],
                    &b.kv_ahead,
                )?;
            }
            match recipe.activation {
                Activation::Silu => swiglu(&mut b.gate[..n * ffn], &b.up[..n * ffn]),
                Activation::GeluTanh => geglu_tanh(&mut b.gate[..n * ffn], &b.up[..n * ffn]),
            }
            Projector::new(&b.gate[..n * ffn], n, precision, &mut b.mm, &[&lw.w_down])?
                .apply_many_prefetching(
                    &mut [(&lw.w_down, &mut b.proj[..n * hidden])],
                    &b.kv_ahead,
                )?;
            if let Some(w) = lw.post_ffn_norm {
                rms_norm_in_place(&mut b.proj[..n * hidden], w, c.rms_eps);
            }
            add_in_place(&mut b.x[..n * hidden], &b.proj[..n * hidden]);
        }
        self.lm_head(segments, round, b)
    }

    /// Logits of the rows each piece asked for, appended to its segment's `logits_out`.
    fn lm_head(
        &self,
        segments: &mut [Segment<'_>],
        round: &[Piece],
        b: &mut StepBuffers,
    ) -> Result<(), ModelError> {
        let weights = &*self.weights;
        let c = weights.config();
        let hidden = c.hidden;
        // Gather the wanted rows, normalised, into `h` (rows of the batch, in round order).
        let mut wanted = 0;
        let mut row = 0;
        for p in round {
            let rows = match p.logits {
                LogitsWanted::None => 0..0,
                LogitsWanted::Last => p.len - 1..p.len,
                LogitsWanted::All => 0..p.len,
            };
            for r in rows {
                let src = (row + r) * hidden;
                rms_norm(
                    &b.x[src..src + hidden],
                    weights.output_norm(),
                    c.rms_eps,
                    &mut b.h[wanted * hidden..(wanted + 1) * hidden],
                );
                wanted += 1;
            }
            row += p.len;
        }
        if wanted == 0 {
            return Ok(());
        }
        let head = weights.lm_head()?;
        b.logits.resize(wanted * c.vocab, 0.0);
        // In blocks of rows, so the refined product's scratch stays small.
        for (i, out) in b.logits.chunks_mut(LOGIT_ROWS * c.vocab).enumerate() {
            let r = out.len() / c.vocab;
            let x = &b.h[i * LOGIT_ROWS * hidden..(i * LOGIT_ROWS + r) * hidden];
            Projector::new(x, r, weights.precision(), &mut b.mm, &[&head])?.apply(&head, out)?;
        }
        let mut at = 0;
        for p in round {
            let count = match p.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => p.len,
            };
            segments[p.index]
                .logits_out
                .extend_from_slice(&b.logits[at * c.vocab..(at + count) * c.vocab]);
            at += count;
        }
        Ok(())
    }
}

/// Reserves `rows × width` f32 of output, or refuses the input if that cannot be allocated.
pub(super) fn reserve_output(
    out: &mut Vec<f32>,
    rows: usize,
    width: usize,
) -> Result<(), ModelError> {
    let too_large = || {
        ModelError::Input(format!(
            "{rows} rows need {} bytes of output, which cannot be allocated",
            rows.saturating_mul(width).saturating_mul(4)
        ))
    };
    let len = rows.checked_mul(width).ok_or_else(too_large)?;
    out.try_reserve_exact(len).map_err(|_| too_large())
}

/// The next piece of one segment in a round.
struct Piece {
    index: usize,
    start: usize,
    len: usize,
    new_span: bool,
    logits: LogitsWanted,
}

/// Rows of logits computed per LM-head call (bounds the refined product's scratch).
const LOGIT_ROWS: usize = 16;

/// Work buffers of a forward pass, shared by every sequence of a batch. They grow to the
/// largest round seen and are then reused, so steady-state steps allocate nothing.
pub struct StepBuffers {
    rows: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    q_fixed: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    cos_w: Vec<f32>,
    sin_w: Vec<f32>,
    cos_f: Vec<f32>,
    sin_f: Vec<f32>,
    /// Angles at the clock with the sliding layers' RoPE base.
    cos_l: Vec<f32>,
    sin_l: Vec<f32>,
    logits: Vec<f32>,
    mm: MatmulScratch,
    attn_scratch: AttnScratch,
    /// The next layer's K/V rows, prefetched during this layer's FFN.
    kv_ahead: SidePrefetch,
}

impl StepBuffers {
    /// Buffers for rounds of up to `rows` rows over rings of up to `max_keys` keys (they
    /// grow later if a round needs more).
    pub fn new(c: &ModelConfig, rows: usize, max_keys: usize) -> StepBuffers {
        let mut b = StepBuffers {
            rows: 0,
            x: Vec::new(),
            h: Vec::new(),
            q: Vec::new(),
            q_fixed: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            attn: Vec::new(),
            proj: Vec::new(),
            gate: Vec::new(),
            up: Vec::new(),
            cos_w: Vec::new(),
            sin_w: Vec::new(),
            cos_f: Vec::new(),
            sin_f: Vec::new(),
            cos_l: Vec::new(),
            sin_l: Vec::new(),
            logits: Vec::new(),
            mm: MatmulScratch::default(),
            attn_scratch: AttnScratch::new(1, c.n_heads, 1),
            kv_ahead: SidePrefetch::new(),
        };
        super::runtime_pool().install(|| b.reserve(c, rows, max_keys));
        b
    }

    fn reserve(&mut self, c: &ModelConfig, rows: usize, max_keys: usize) {
        let threads = rayon::current_num_threads();
        self.attn_scratch.reserve(threads, c.n_heads, max_keys);
        if rows <= self.rows {
            return;
        }
        let half = c.head_dim() / 2;
        let grow = |v: &mut Vec<f32>, len: usize| v.resize(len, 0.0);
        grow(&mut self.x, rows * c.hidden);
        grow(&mut self.h, rows * c.hidden);
        grow(&mut self.q, rows * c.q_dim());
        grow(&mut self.q_fixed, rows * c.q_dim());
        grow(&mut self.k, rows * c.kv_dim());
        grow(&mut self.v, rows * c.kv_dim());
        grow(&mut self.attn, rows * c.q_dim());
        grow(&mut self.proj, rows * c.hidden);
        grow(&mut self.gate, rows * c.ffn);
        grow(&mut self.up, rows * c.ffn);
        grow(&mut self.cos_w, rows * half);
        grow(&mut self.sin_w, rows * half);
        grow(&mut self.cos_f, rows * half);
        grow(&mut self.sin_f, rows * half);
        grow(&mut self.cos_l, rows * half);
        grow(&mut self.sin_l, rows * half);
        let width = c.ffn.max(c.hidden).max(c.q_dim());
        self.mm.quant = QuantScratch::with_capacity(2 * rows, width);
        let need = 2 * rows * width;
        self.mm
            .stacked
            .reserve(need.saturating_sub(self.mm.stacked.len()));
        self.mm
            .full
            .reserve(need.saturating_sub(self.mm.full.len()));
        self.rows = rows;
    }
}

/// Scratch of the projections: quantization buffers and the refined product's rows.
#[derive(Default)]
struct MatmulScratch {
    quant: QuantScratch,
    stacked: Vec<f32>,
    full: Vec<f32>,
}

/// One quantized input applied to several matrices (q/k/v share one, gate/up share one).
struct Projector<'a> {
    input: QuantizedInput<'a>,
    full: &'a mut Vec<f32>,
}

impl<'a> Projector<'a> {
    /// Quantizes `x` (`n` rows) once, at the weights' precision, into the activation blocks
    /// the matrices `ws` (those it will be applied to) need.
    fn new(
        x: &'a [f32],
        n: usize,
        precision: Precision,
        scratch: &'a mut MatmulScratch,
        ws: &[&QMatrix<'_>],
    ) -> Result<Self, ModelError> {
        let cols = x.len() / n;
        let refined = precision == Precision::Refined;
        let MatmulScratch {
            quant,
            stacked,
            full,
        } = scratch;
        let mut dtypes = [GgmlType::F32; 4];
        for (d, w) in dtypes.iter_mut().zip(ws) {
            *d = w.dtype();
        }
        let dtypes = &dtypes[..ws.len().min(4)];
        let residual = refined.then_some(stacked);
        let input = QuantizedInput::quantize_for(x, n, cols, dtypes, residual, quant)
            .map_err(|e| ModelError::Weights(e.to_string()))?;
        Ok(Projector { input, full })
    }

    /// `out_i = W_i·x` for every pair, as one parallel region.
    fn apply_many(
        &mut self,
        products: &mut [(&QMatrix<'_>, &mut [f32])],
    ) -> Result<(), ModelError> {
        self.apply_many_prefetching(products, &SidePrefetch::new())
    }

    /// [`Projector::apply_many`], prefetching `side` as the kernels go.
    fn apply_many_prefetching(
        &mut self,
        products: &mut [(&QMatrix<'_>, &mut [f32])],
        side: &SidePrefetch,
    ) -> Result<(), ModelError> {
        let err = |e: crate::quant::QuantError| ModelError::Weights(e.to_string());
        let folded = |w: &QMatrix<'_>| self.input.product_tokens(w.dtype()) > self.input.n_tokens();
        if !products.iter().any(|(w, _)| folded(w)) {
            return matmul_many_prefetching(products, &self.input, side).map_err(err);
        }
        // A refined input's product with a k-quant has two rows per token (value, residual):
        // those go to a stretch of the scratch each, folded into their outputs afterwards;
        // the other matrices write their outputs directly.
        let need: usize = products
            .iter()
            .filter(|(w, _)| folded(w))
            .map(|(_, out)| 2 * out.len())
            .sum();
        if self.full.len() < need {
            self.full.resize(need, 0.0);
        }
        let mut rest = &mut self.full[..need];
        let mut targets = Vec::with_capacity(products.len());
        for (w, out) in products.iter_mut() {
            if folded(w) {
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(2 * out.len());
                targets.push((*w, mine));
                rest = tail;
            } else {
                targets.push((*w, &mut **out));
            }
        }
        matmul_many_prefetching(&mut targets, &self.input, side).map_err(err)?;
        drop(targets);
        let mut rest = &self.full[..need];
        for (w, out) in products.iter_mut() {
            if folded(w) {
                let (mine, tail) = rest.split_at(2 * out.len());
                fold_refined(mine, out);
                rest = tail;
            }
        }
        Ok(())
    }

    /// `out = W·x` (`n × rows`).
    fn apply(&mut self, w: &QMatrix<'_>, out: &mut [f32]) -> Result<(), ModelError> {
        self.apply_many(&mut [(w, out)])
    }
}

/// Rows of a round from which the FFN prefetches the next layer's K/V history. With fewer,
/// the matmuls stream weights at the memory's rate and the prefetches only compete with
/// them (measured on Zen 4: 2 rows −5 %, 4 rows +2–4 %, 8 rows +4–11 % tokens/s).
const PREFETCH_KV_FROM_ROWS: usize = 4;

/// Lists the K/V rows that ring layer `ring_layer` of every piece's sequence holds for its
/// attention.
fn list_history(
    side: &mut SidePrefetch,
    segments: &[Segment<'_>],
    round: &[Piece],
    ring_layer: usize,
    window: Option<usize>,
) {
    for p in round {
        let (ring, index) = segments[p.index].kv.rings().layer(ring_layer);
        // Rows read from another sequence's ring come into the caches through its listing.
        let shared = round_shared_prefix(segments, round, p).map_or(0, |sp| {
            let (leader, _) = segments[round[sp.chunk].index].kv.rings().layer(ring_layer);
            shareable_window(ring, leader, sp.clocks)
        });
        list_ring_history(side, ring, index, window, shared);
    }
}

/// Piece `p`'s shared prefix within `round` (`chunk`: the leader's piece in the round), when
/// its segment has one and the leader runs in the same round.
fn round_shared_prefix(
    segments: &[Segment<'_>],
    round: &[Piece],
    p: &Piece,
) -> Option<SharedPrefix> {
    let sp = segments[p.index].shared_prefix?;
    let chunk = round.iter().position(|q| q.index == sp.chunk)?;
    Some(SharedPrefix {
        chunk,
        clocks: sp.clocks,
    })
}

/// Lists the K and V rows of `ring`'s layer `index` that attention reads: the fixed slots,
/// then the window's (a sliding layer's last `window` of them; all but the first `shared`,
/// which attention reads from another ring), as runs of consecutive slots.
pub(super) fn list_ring_history(
    side: &mut SidePrefetch,
    ring: &DynamicRingBuffer,
    index: usize,
    window: Option<usize>,
    shared: usize,
) {
    let (k, v) = ring.layer_kv(index);
    let (k, v, value_bytes) = match (k, v) {
        (KvSlice::F16(k), KvSlice::F16(v)) => (k.as_ptr().cast::<u8>(), v.as_ptr().cast::<u8>(), 2),
        (KvSlice::F32(k), KvSlice::F32(v)) => (k.as_ptr().cast::<u8>(), v.as_ptr().cast::<u8>(), 4),
        _ => return,
    };
    let row_bytes = ring.config().row_len() * value_bytes;
    let window_slots = ring.window_slots();
    let visible = window.map_or(window_slots.len(), |w| w.min(window_slots.len()));
    // The shared clocks are the window's first: those the visible part holds are skipped.
    let first_visible = window_slots.len() - visible;
    let visible = visible - shared.saturating_sub(first_visible).min(visible);
    let slots = ring
        .fixed_slots()
        .iter()
        .chain(&window_slots[window_slots.len() - visible..]);
    let mut push = |first: u32, end: u32| {
        let (at, bytes) = (
            first as usize * row_bytes,
            (end - first) as usize * row_bytes,
        );
        side.push(k.wrapping_add(at), bytes);
        side.push(v.wrapping_add(at), bytes);
    };
    let mut run: Option<(u32, u32)> = None;
    for &s in slots {
        run = match run {
            Some((first, end)) if s == end => Some((first, end + 1)),
            Some((first, end)) => {
                push(first, end);
                Some((s, s + 1))
            }
            None => Some((s, s + 1)),
        };
    }
    if let Some((first, end)) = run {
        push(first, end);
    }
}

fn add_bias(rows: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in rows.chunks_exact_mut(b.len()) {
            add_in_place(row, b);
        }
    }
}
