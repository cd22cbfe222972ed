//! `forward_range`: one session's live state for a layer range, and the forward pass over it.

use std::sync::Arc;

use rayon::prelude::*;

use super::ops::{add_in_place, rms_norm, rope_angles, rope_apply, swiglu};
use super::{LlamaWeights, ModelError};
use crate::attention::{attend, AttnDims};
use crate::quant::{matmul_f32, QMatrix, QuantScratch};
use crate::ring::{DynamicRingBuffer, RingConfig, SpanType};

/// Sizes of a session's ring buffer and work buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionConfig {
    /// Physical KV slots per layer (default 4096; at most the trained context).
    pub slots: usize,
    /// Recall slots reserved at the top of the ring (default 128).
    pub recall: usize,
    /// Locked anchor slots for the system prompt (default 0).
    pub n_sys: usize,
    /// Rows computed together in one prefill chunk (default 256). Results never depend on it.
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

/// What a range consumes: token ids at the entry range, hidden states elsewhere.
#[derive(Clone, Copy, Debug)]
pub enum ChunkInput<'a> {
    /// Token ids (entry range only).
    Tokens(&'a [u32]),
    /// Residual-stream rows, `n × hidden`, from the previous range (never the entry range).
    Hidden(&'a [f32]),
}

impl ChunkInput<'_> {
    fn rows(&self, hidden: usize) -> usize {
        match self {
            ChunkInput::Tokens(t) => t.len(),
            ChunkInput::Hidden(h) => h.len() / hidden,
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
    /// Logits of every row (parity tests read every prompt position).
    All,
}

/// Per-session work buffers, sized once for `max_chunk` rows (no allocation per token).
struct Workspace {
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
    logit_row: Vec<f32>,
    scores: Vec<f32>,
    quant: QuantScratch,
}

/// One session's live state for the layer range `[layer_lo, layer_hi)`.
pub struct RangeSession {
    weights: Arc<LlamaWeights>,
    layer_lo: usize,
    layer_hi: usize,
    ring: DynamicRingBuffer,
    max_chunk: usize,
    ws: Workspace,
}

impl RangeSession {
    /// A fresh session (clock 0) over `[layer_lo, layer_hi)` of `weights`.
    pub fn new(
        weights: Arc<LlamaWeights>,
        layer_lo: usize,
        layer_hi: usize,
        cfg: &SessionConfig,
    ) -> Result<Self, ModelError> {
        let c = weights.config().clone();
        if layer_lo >= layer_hi || layer_hi > c.n_layers {
            return Err(ModelError::Input(format!(
                "layer range {layer_lo}..{layer_hi} is not a non-empty part of 0..{}",
                c.n_layers
            )));
        }
        if cfg.slots > c.context_len {
            return Err(ModelError::Input(format!(
                "{} slots exceed the trained context of {} positions: relative distances \
                 must stay inside it",
                cfg.slots, c.context_len
            )));
        }
        if cfg.max_chunk == 0 {
            return Err(ModelError::Input("max_chunk must be at least 1".into()));
        }
        let ring = DynamicRingBuffer::new(RingConfig {
            n_layers: layer_hi - layer_lo,
            kv_heads: c.n_kv_heads,
            head_dim: c.head_dim(),
            slots: cfg.slots,
            recall: cfg.recall,
            n_sys: cfg.n_sys,
            max_chunk: cfg.max_chunk,
            ..RingConfig::default()
        })
        .map_err(|e| ModelError::Ring(e.to_string()))?;
        let n = cfg.max_chunk;
        let half = c.head_dim() / 2;
        let zeros = |len: usize| vec![0.0f32; len];
        let ws = Workspace {
            x: zeros(n * c.hidden),
            h: zeros(n * c.hidden),
            q: zeros(n * c.hidden),
            q_fixed: zeros(n * c.hidden),
            k: zeros(n * c.kv_dim()),
            v: zeros(n * c.kv_dim()),
            attn: zeros(n * c.hidden),
            proj: zeros(n * c.hidden),
            gate: zeros(n * c.ffn),
            up: zeros(n * c.ffn),
            cos_w: zeros(n * half),
            sin_w: zeros(n * half),
            cos_f: zeros(n * half),
            sin_f: zeros(n * half),
            logit_row: zeros(c.hidden),
            scores: zeros(cfg.slots + n),
            quant: QuantScratch::default(),
        };
        Ok(RangeSession {
            weights,
            layer_lo,
            layer_hi,
            ring,
            max_chunk: n,
            ws,
        })
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

    /// Positions processed so far (the ring's clock).
    pub fn clock(&self) -> u64 {
        self.ring.clock()
    }

    /// The live KV ring (read-only).
    pub fn ring(&self) -> &DynamicRingBuffer {
        &self.ring
    }

    /// The live KV ring, for splicing a replayed volume.
    pub fn ring_mut(&mut self) -> &mut DynamicRingBuffer {
        &mut self.ring
    }

    /// The weights this session runs.
    pub fn weights(&self) -> &Arc<LlamaWeights> {
        &self.weights
    }

    /// Rows computed together in one prefill chunk.
    pub fn max_chunk(&self) -> usize {
        self.max_chunk
    }

    /// Forgets every position (clock 0) without giving the allocation back.
    pub fn reset(&mut self) {
        self.ring.reset();
    }

    /// Appends precomputed K/V rows (a replayed volume) exactly as prefill would have written
    /// them: `keys`/`vals` are in the volume layout `(layers, kv_heads, total, head_dim)` and
    /// rows `[from, to)` of it are appended, opening a new span when `new_span`.
    pub fn append_volume_rows(
        &mut self,
        keys: &[f32],
        vals: &[f32],
        total: usize,
        from: usize,
        to: usize,
        span: SpanType,
        new_span: bool,
    ) -> Result<(), ModelError> {
        let c = self.weights.config();
        let (kvh, hd) = (c.n_kv_heads, c.head_dim());
        let layers = self.layer_hi - self.layer_lo;
        let n = to - from;
        if from >= to || to > total || keys.len() != layers * kvh * total * hd || vals.len() != keys.len() {
            return Err(ModelError::Input(format!(
                "volume rows {from}..{to} of {total} do not fit a {layers}-layer slab of {} floats",
                keys.len()
            )));
        }
        if n > self.max_chunk {
            return Err(ModelError::Input(format!("{n} rows exceed max_chunk {}", self.max_chunk)));
        }
        self.ring
            .begin_append(n, span, new_span)
            .map_err(|e| ModelError::Ring(e.to_string()))?;
        let kv_dim = kvh * hd;
        for layer in 0..layers {
            // Volume layout (layer, head, pos, dim) → ring rows (pos, head, dim).
            for (dst, src) in [(&mut self.ws.k, keys), (&mut self.ws.v, vals)] {
                for p in 0..n {
                    for h in 0..kvh {
                        let at = ((layer * kvh + h) * total + from + p) * hd;
                        dst[p * kv_dim + h * hd..p * kv_dim + (h + 1) * hd]
                            .copy_from_slice(&src[at..at + hd]);
                    }
                }
            }
            if let Err(e) = self.ring.write_pending(layer, &self.ws.k[..n * kv_dim], &self.ws.v[..n * kv_dim]) {
                self.ring.abort_append();
                return Err(ModelError::Ring(e.to_string()));
            }
        }
        self.ring.commit_append();
        Ok(())
    }

    /// Undoes every position after `saved` (probe tokens); bit-exact.
    pub fn rollback(&mut self, saved: u64) -> Result<(), ModelError> {
        self.ring
            .rollback_clock(saved)
            .map_err(|e| ModelError::Ring(e.to_string()))
    }

    /// Runs `input` through the range, appending its positions to the ring.
    ///
    /// Writes the range's output residual rows (`n × hidden`) to `hidden_out` and, for the exit
    /// range, the requested logits rows (`× vocab`) to `logits_out`. On error nothing changes.
    pub fn forward(
        &mut self,
        input: ChunkInput<'_>,
        span: SpanType,
        new_span: bool,
        logits: LogitsWanted,
        hidden_out: &mut Vec<f32>,
        logits_out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let c = self.weights.config().clone();
        self.validate_input(&input, logits)?;
        let n = input.rows(c.hidden);
        hidden_out.clear();
        hidden_out.reserve(n * c.hidden);
        logits_out.clear();
        let saved = self.ring.clock();
        let mut start = 0;
        while start < n {
            let len = (n - start).min(self.max_chunk);
            let piece = match input {
                ChunkInput::Tokens(t) => ChunkInput::Tokens(&t[start..start + len]),
                ChunkInput::Hidden(h) => {
                    ChunkInput::Hidden(&h[start * c.hidden..(start + len) * c.hidden])
                }
            };
            let first_piece = start == 0;
            let last_piece = start + len == n;
            let piece_logits = match logits {
                LogitsWanted::All => LogitsWanted::All,
                LogitsWanted::Last if last_piece => LogitsWanted::Last,
                _ => LogitsWanted::None,
            };
            // Later pieces extend the span the first piece opened: chunking stays invisible.
            let piece_new_span = new_span && first_piece;
            if let Err(e) =
                self.forward_chunk(piece, span, piece_new_span, piece_logits, logits_out)
            {
                // Leave the session as it was: undo the pieces that did run.
                let _ = self.ring.rollback_clock(saved);
                hidden_out.clear();
                logits_out.clear();
                return Err(e);
            }
            hidden_out.extend_from_slice(&self.ws.x[..len * c.hidden]);
            start += len;
        }
        Ok(())
    }

    fn validate_input(&self, input: &ChunkInput<'_>, logits: LogitsWanted) -> Result<(), ModelError> {
        let c = self.weights.config();
        match input {
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
        if logits != LogitsWanted::None && !self.is_exit() {
            return Err(ModelError::Input(format!(
                "layers {}..{} are not the exit range: no logits",
                self.layer_lo, self.layer_hi
            )));
        }
        Ok(())
    }

    /// One chunk of at most `max_chunk` rows through every layer of the range.
    fn forward_chunk(
        &mut self,
        input: ChunkInput<'_>,
        span: SpanType,
        new_span: bool,
        logits: LogitsWanted,
        logits_out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let weights = Arc::clone(&self.weights);
        let c = weights.config();
        let (hidden, kv_dim, hd) = (c.hidden, c.kv_dim(), c.head_dim());
        let half = hd / 2;
        let n = input.rows(hidden);
        self.ring
            .begin_append(n, span, new_span)
            .map_err(|e| ModelError::Ring(e.to_string()))?;
        let result = self.run_layers(&weights, input, n, logits, logits_out);
        match result {
            Ok(()) => {
                self.ring.commit_append();
                Ok(())
            }
            Err(e) => {
                self.ring.abort_append();
                Err(e)
            }
        }
    }

    /// The layers of one chunk after `begin_append`; the caller commits or aborts.
    fn run_layers(
        &mut self,
        weights: &LlamaWeights,
        input: ChunkInput<'_>,
        n: usize,
        logits: LogitsWanted,
        logits_out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let c = weights.config();
        let (hidden, kv_dim, hd) = (c.hidden, c.kv_dim(), c.head_dim());
        let half = hd / 2;
        let ws = &mut self.ws;
        match input {
            ChunkInput::Tokens(ids) => weights
                .embedding()?
                .embed(ids, &mut ws.x[..n * hidden])
                .map_err(|e| ModelError::Weights(e.to_string()))?,
            ChunkInput::Hidden(h) => ws.x[..n * hidden].copy_from_slice(h),
        }
        // RoPE angles: window rotation at the absolute clock, fixed-segment rotation at the
        // StreamingLLM cache position (identical until the window first wraps).
        let mut fixed_differs = false;
        for i in 0..n {
            let pos = self.ring.pending_clock(i);
            let cache_pos = self.ring.pending_cache_pos(i);
            let r = i * half..(i + 1) * half;
            rope_angles(pos, hd, c.rope_base, &mut ws.cos_w[r.clone()], &mut ws.sin_w[r.clone()]);
            if cache_pos != pos {
                fixed_differs = true;
            }
            rope_angles(cache_pos, hd, c.rope_base, &mut ws.cos_f[r.clone()], &mut ws.sin_f[r]);
        }
        let dims = AttnDims {
            n_q_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: hd,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        for layer in self.layer_lo..self.layer_hi {
            let lw = weights.layer(layer)?;
            let ring_layer = layer - self.layer_lo;
            rms_norm(&ws.x[..n * hidden], lw.attn_norm, c.rms_eps, &mut ws.h[..n * hidden]);
            matmul(&lw.wq, &ws.h, n, &mut ws.q[..n * hidden], lw.bq, &mut ws.quant)?;
            matmul(&lw.wk, &ws.h, n, &mut ws.k[..n * kv_dim], lw.bk, &mut ws.quant)?;
            matmul(&lw.wv, &ws.h, n, &mut ws.v[..n * kv_dim], lw.bv, &mut ws.quant)?;
            for i in 0..n {
                let r = i * half..(i + 1) * half;
                let (cw, sw) = (&ws.cos_w[r.clone()], &ws.sin_w[r.clone()]);
                rope_apply(&mut ws.k[i * kv_dim..(i + 1) * kv_dim], hd, cw, sw);
                let q_row = &mut ws.q[i * hidden..(i + 1) * hidden];
                if fixed_differs {
                    let qf = &mut ws.q_fixed[i * hidden..(i + 1) * hidden];
                    qf.copy_from_slice(q_row);
                    rope_apply(qf, hd, &ws.cos_f[r.clone()], &ws.sin_f[r]);
                }
                rope_apply(q_row, hd, cw, sw);
            }
            let q_fixed = if fixed_differs { &ws.q_fixed } else { &ws.q };
            {
                let ring = &self.ring;
                let (ring_k, ring_v) = ring.layer_kv(ring_layer);
                let fixed = ring.fixed_slots();
                let (q, k, v) = (&ws.q, &ws.k, &ws.v);
                let attend_row = |i: usize, out: &mut [f32], scores: &mut Vec<f32>| {
                    let window = ring.pending_window(i);
                    let need = fixed.len() + window.len() + i + 1;
                    if scores.len() < need {
                        scores.resize(need, 0.0);
                    }
                    attend(
                        &q_fixed[i * hidden..(i + 1) * hidden],
                        &q[i * hidden..(i + 1) * hidden],
                        ring_k,
                        ring_v,
                        fixed,
                        window,
                        &k[..(i + 1) * kv_dim],
                        &v[..(i + 1) * kv_dim],
                        i + 1,
                        dims,
                        scale,
                        scores,
                        out,
                    )
                };
                if n == 1 {
                    attend_row(0, &mut ws.attn[..hidden], &mut ws.scores);
                } else {
                    ws.attn[..n * hidden]
                        .par_chunks_mut(hidden)
                        .enumerate()
                        .for_each_init(Vec::new, |scores, (i, out)| attend_row(i, out, scores));
                }
            }
            self.ring
                .write_pending(ring_layer, &ws.k[..n * kv_dim], &ws.v[..n * kv_dim])
                .map_err(|e| ModelError::Ring(e.to_string()))?;
            matmul(&lw.wo, &ws.attn, n, &mut ws.proj[..n * hidden], None, &mut ws.quant)?;
            add_in_place(&mut ws.x[..n * hidden], &ws.proj[..n * hidden]);
            rms_norm(&ws.x[..n * hidden], lw.ffn_norm, c.rms_eps, &mut ws.h[..n * hidden]);
            matmul(&lw.w_gate, &ws.h, n, &mut ws.gate[..n * c.ffn], None, &mut ws.quant)?;
            matmul(&lw.w_up, &ws.h, n, &mut ws.up[..n * c.ffn], None, &mut ws.quant)?;
            swiglu(&mut ws.gate[..n * c.ffn], &ws.up[..n * c.ffn]);
            matmul(&lw.w_down, &ws.gate, n, &mut ws.proj[..n * hidden], None, &mut ws.quant)?;
            add_in_place(&mut ws.x[..n * hidden], &ws.proj[..n * hidden]);
        }
        let rows = match logits {
            LogitsWanted::None => 0..0,
            LogitsWanted::Last => n - 1..n,
            LogitsWanted::All => 0..n,
        };
        if !rows.is_empty() {
            let head = weights.lm_head()?;
            for i in rows {
                rms_norm(
                    &ws.x[i * hidden..(i + 1) * hidden],
                    weights.output_norm(),
                    c.rms_eps,
                    &mut ws.logit_row,
                );
                let at = logits_out.len();
                logits_out.resize(at + c.vocab, 0.0);
                matmul(&head, &ws.logit_row, 1, &mut logits_out[at..], None, &mut ws.quant)?;
            }
        }
        Ok(())
    }
}

/// `out = W · x (+ bias)` for `n` rows of `x`.
fn matmul(
    w: &QMatrix<'_>,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    bias: Option<&[f32]>,
    scratch: &mut QuantScratch,
) -> Result<(), ModelError> {
    matmul_f32(w, &x[..n * w.cols()], n, out, scratch)
        .map_err(|e| ModelError::Weights(e.to_string()))?;
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(b.len()) {
            add_in_place(row, b);
        }
    }
    Ok(())
}
