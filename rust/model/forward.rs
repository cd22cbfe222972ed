//! `forward_range`: one session's live state for a layer range, and the forward pass over it.

use std::sync::Arc;

use super::ops::{add_in_place, rms_norm, rope_angles, rope_apply, swiglu};
use super::{LlamaWeights, ModelError, Precision};
use crate::attention::{attend_chunk, AttnScratch};
use crate::quant::{fold_refined, matmul, QMatrix, QuantScratch, QuantizedInput};
use crate::ring::{DynamicRingBuffer, RingConfig, SpanType};

/// Positions per semantic span: spans open at multiples of this (and at `n_sys`), small
/// enough that span-aware eviction frees the window in reasonable steps, and fixed so the
/// span layout never depends on chunking. Smaller windows use half their length.
pub const SPAN_TOKENS: u64 = 256;

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
    mm: MatmulScratch,
    attn_scratch: AttnScratch,
}

/// One session's live state for the layer range `[layer_lo, layer_hi)`.
pub struct RangeSession {
    weights: Arc<LlamaWeights>,
    layer_lo: usize,
    layer_hi: usize,
    ring: DynamicRingBuffer,
    max_chunk: usize,
    /// Span length of this session: `SPAN_TOKENS`, or half the window if that is smaller.
    span_tokens: u64,
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
        let mut ring_cfg = RingConfig::new(layer_hi - layer_lo, c.n_kv_heads, c.head_dim());
        ring_cfg.slots = cfg.slots;
        ring_cfg.recall = cfg.recall;
        ring_cfg.n_sys = cfg.n_sys;
        ring_cfg.max_positions = Some(c.context_len);
        // A chunk never spans more than the window (the ring's rule) nor more than a span.
        let span_tokens = SPAN_TOKENS.min(ring_cfg.window_len() as u64 / 2).max(1);
        ring_cfg.max_chunk = cfg.max_chunk.min(span_tokens as usize).max(1);
        let ring = DynamicRingBuffer::new(ring_cfg).map_err(|e| ModelError::Ring(e.to_string()))?;
        let n = ring.config().max_chunk;
        let half = c.head_dim() / 2;
        let zeros = |len: usize| vec![0.0f32; len];
        let attn_scratch =
            super::runtime_pool().install(|| AttnScratch::for_ring(&ring, c.n_heads));
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
            mm: MatmulScratch {
                quant: QuantScratch::with_capacity(2 * n, c.ffn.max(c.hidden)),
                stacked: Vec::with_capacity(2 * n * c.ffn.max(c.hidden)),
                full: Vec::with_capacity(2 * n * c.ffn.max(c.hidden)),
            },
            attn_scratch,
        };
        Ok(RangeSession {
            weights,
            layer_lo,
            layer_hi,
            ring,
            max_chunk: n,
            span_tokens,
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

    /// Appends the first `kv_len` positions of a volume slab (layout
    /// `(layers, kv_heads, stride, head_dim)`) through the ring's own append path, in the
    /// same pieces and spans prefill would use, so the ring ends up exactly as a cold prefill
    /// leaves it. On error the session is back where it started.
    pub fn append_volume(
        &mut self,
        keys: &[f32],
        vals: &[f32],
        stride: usize,
        kv_len: usize,
        span: SpanType,
    ) -> Result<(), ModelError> {
        let c = self.weights.config();
        let (kvh, hd) = (c.n_kv_heads, c.head_dim());
        let layers = self.layer_hi - self.layer_lo;
        if kv_len == 0
            || kv_len > stride
            || keys.len() != layers * kvh * stride * hd
            || vals.len() != keys.len()
        {
            return Err(ModelError::Input(format!(
                "{kv_len} positions of a {layers}-layer slab with stride {stride} do not fit \
                 {} floats",
                keys.len()
            )));
        }
        let saved = self.ring.clock();
        let mut from = 0;
        while from < kv_len {
            let (n, new_span) = self.next_piece(kv_len - from, span);
            self.ring
                .begin_append(n, span, new_span)
                .map_err(|e| ModelError::Ring(e.to_string()))?;
            for layer in 0..layers {
                let written = self
                    .ring
                    .write_pending_slab(layer, keys, vals, stride, from);
                if let Err(e) = written {
                    self.ring.abort_append();
                    let _ = self.ring.rollback_clock(saved);
                    return Err(ModelError::Ring(e.to_string()));
                }
            }
            if let Err(e) = self.ring.commit_append() {
                self.ring.abort_append();
                let _ = self.ring.rollback_clock(saved);
                return Err(ModelError::Ring(e.to_string()));
            }
            from += n;
        }
        Ok(())
    }

    /// Undoes every position after `saved` (probe tokens); bit-exact.
    pub fn rollback(&mut self, saved: u64) -> Result<(), ModelError> {
        self.ring
            .rollback_clock(saved)
            .map_err(|e| ModelError::Ring(e.to_string()))
    }

    /// Where the next piece of an append starting at the current clock ends, and whether it
    /// opens a new span. Pieces never cross `max_chunk`, the anchor boundary `n_sys`, or a
    /// multiple of the span length; spans open at those fixed positions (or when the span type
    /// changes), so the span layout — and with it span-aware eviction — never depends on
    /// how a caller chunked its input, nor on whether positions were replayed or prefilled.
    fn next_piece(&self, remaining: usize, span: SpanType) -> (usize, bool) {
        let clock = self.ring.clock();
        let n_sys = self.ring.n_sys() as u64;
        let mut end = clock + remaining.min(self.max_chunk) as u64;
        end = end.min((clock / self.span_tokens + 1) * self.span_tokens);
        if clock < n_sys {
            end = end.min(n_sys);
        }
        let open_same = self
            .ring
            .spans()
            .last()
            .is_some_and(|s| s.end_clock == clock && s.span_type == span);
        let new_span = clock.is_multiple_of(self.span_tokens) || clock == n_sys || !open_same;
        ((end - clock) as usize, new_span)
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
        super::runtime_pool()
            .install(|| self.forward_in_pool(input, span, logits, hidden_out, logits_out))
    }

    fn forward_in_pool(
        &mut self,
        input: ChunkInput<'_>,
        span: SpanType,
        logits: LogitsWanted,
        hidden_out: &mut Vec<f32>,
        logits_out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let hidden = self.weights.config().hidden;
        self.validate_input(&input, logits)?;
        let n = input.rows(hidden);
        hidden_out.clear();
        hidden_out.reserve(n * hidden);
        logits_out.clear();
        let saved = self.ring.clock();
        let mut start = 0;
        while start < n {
            let (len, new_span) = self.next_piece(n - start, span);
            let piece = match input {
                ChunkInput::Tokens(t) => ChunkInput::Tokens(&t[start..start + len]),
                ChunkInput::Hidden(h) => {
                    ChunkInput::Hidden(&h[start * hidden..(start + len) * hidden])
                }
            };
            let piece_logits = match logits {
                LogitsWanted::All => LogitsWanted::All,
                LogitsWanted::Last if start + len == n => LogitsWanted::Last,
                _ => LogitsWanted::None,
            };
            if let Err(e) = self.forward_chunk(piece, span, new_span, piece_logits, logits_out) {
                // Leave the session as it was: undo the pieces that did run.
                let _ = self.ring.rollback_clock(saved);
                hidden_out.clear();
                logits_out.clear();
                return Err(e);
            }
            hidden_out.extend_from_slice(&self.ws.x[..len * hidden]);
            start += len;
        }
        Ok(())
    }

    fn validate_input(
        &self,
        input: &ChunkInput<'_>,
        logits: LogitsWanted,
    ) -> Result<(), ModelError> {
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

    /// One piece (at most `max_chunk` rows, one span) through every layer of the range.
    fn forward_chunk(
        &mut self,
        input: ChunkInput<'_>,
        span: SpanType,
        new_span: bool,
        logits: LogitsWanted,
        logits_out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let weights = Arc::clone(&self.weights);
        let n = input.rows(weights.config().hidden);
        self.ring
            .begin_append(n, span, new_span)
            .map_err(|e| ModelError::Ring(e.to_string()))?;
        let at = logits_out.len();
        let result = self
            .run_layers(&weights, input, n, logits, logits_out)
            .and_then(|()| {
                self.ring
                    .commit_append()
                    .map_err(|e| ModelError::Ring(e.to_string()))
            });
        if result.is_err() {
            self.ring.abort_append();
            logits_out.truncate(at);
        }
        result
    }

    /// The layers of one piece after `begin_append`; the caller commits or aborts.
    fn run_layers(
        &mut self,
        weights: &LlamaWeights,
        input: ChunkInput<'_>,
        n: usize,
        logits: LogitsWanted,
        logits_out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let c = weights.config();
        let (hidden, kv_dim, hd, ffn) = (c.hidden, c.kv_dim(), c.head_dim(), c.ffn);
        let half = hd / 2;
        let ws = &mut self.ws;
        let quant_err = |e: crate::quant::QuantError| ModelError::Weights(e.to_string());
        let precision = weights.precision();
        match input {
            ChunkInput::Tokens(ids) => weights
                .embedding()?
                .embed(ids, &mut ws.x[..n * hidden])
                .map_err(quant_err)?,
            ChunkInput::Hidden(h) => ws.x[..n * hidden].copy_from_slice(h),
        }
        // RoPE angles: window rotation at the absolute clock, fixed-segment rotation at the
        // StreamingLLM cache position (identical until the window first wraps).
        let mut fixed_differs = false;
        for i in 0..n {
            let pos = self.ring.pending_clock(i);
            let cache_pos = self.ring.pending_cache_pos(i);
            let r = i * half..(i + 1) * half;
            rope_angles(
                pos,
                hd,
                c.rope_base,
                &mut ws.cos_w[r.clone()],
                &mut ws.sin_w[r.clone()],
            );
            fixed_differs |= cache_pos != pos;
            rope_angles(
                cache_pos,
                hd,
                c.rope_base,
                &mut ws.cos_f[r.clone()],
                &mut ws.sin_f[r],
            );
        }
        let scale = 1.0 / (hd as f32).sqrt();
        for layer in self.layer_lo..self.layer_hi {
            let lw = weights.layer(layer)?;
            let ring_layer = layer - self.layer_lo;
            rms_norm(
                &ws.x[..n * hidden],
                lw.attn_norm,
                c.rms_eps,
                &mut ws.h[..n * hidden],
            );
            {
                let mut p = Projector::new(&ws.h[..n * hidden], n, precision, &mut ws.mm)?;
                p.apply(&lw.wq, &mut ws.q[..n * hidden])?;
                p.apply(&lw.wk, &mut ws.k[..n * kv_dim])?;
                p.apply(&lw.wv, &mut ws.v[..n * kv_dim])?;
            }
            add_bias(&mut ws.q[..n * hidden], lw.bq);
            add_bias(&mut ws.k[..n * kv_dim], lw.bk);
            add_bias(&mut ws.v[..n * kv_dim], lw.bv);
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
            attend_chunk(
                &self.ring,
                ring_layer,
                &q_fixed[..n * hidden],
                &ws.q[..n * hidden],
                &ws.k[..n * kv_dim],
                &ws.v[..n * kv_dim],
                c.n_heads,
                scale,
                &mut ws.attn_scratch,
                &mut ws.attn[..n * hidden],
            )
            .map_err(|e| ModelError::Ring(e.to_string()))?;
            self.ring
                .write_pending(ring_layer, &ws.k[..n * kv_dim], &ws.v[..n * kv_dim])
                .map_err(|e| ModelError::Ring(e.to_string()))?;
            Projector::new(&ws.attn[..n * hidden], n, precision, &mut ws.mm)?
                .apply(&lw.wo, &mut ws.proj[..n * hidden])?;
            add_in_place(&mut ws.x[..n * hidden], &ws.proj[..n * hidden]);
            rms_norm(
                &ws.x[..n * hidden],
                lw.ffn_norm,
                c.rms_eps,
                &mut ws.h[..n * hidden],
            );
            {
                let mut p = Projector::new(&ws.h[..n * hidden], n, precision, &mut ws.mm)?;
                p.apply(&lw.w_gate, &mut ws.gate[..n * ffn])?;
                p.apply(&lw.w_up, &mut ws.up[..n * ffn])?;
            }
            swiglu(&mut ws.gate[..n * ffn], &ws.up[..n * ffn]);
            Projector::new(&ws.gate[..n * ffn], n, precision, &mut ws.mm)?
                .apply(&lw.w_down, &mut ws.proj[..n * hidden])?;
            add_in_place(&mut ws.x[..n * hidden], &ws.proj[..n * hidden]);
        }
        let rows = match logits {
            LogitsWanted::None => 0..0,
            LogitsWanted::Last => n - 1..n,
            LogitsWanted::All => 0..n,
        };
        if !rows.is_empty() {
            let head = weights.lm_head()?;
            let (first, count) = (rows.start, rows.len());
            rms_norm(
                &ws.x[first * hidden..rows.end * hidden],
                weights.output_norm(),
                c.rms_eps,
                &mut ws.h[..count * hidden],
            );
            let at = logits_out.len();
            logits_out.resize(at + count * c.vocab, 0.0);
            // In blocks of rows, so the refined product's scratch stays small.
            for (i, out) in logits_out[at..]
                .chunks_mut(LOGIT_ROWS * c.vocab)
                .enumerate()
            {
                let r = out.len() / c.vocab;
                let x = &ws.h[i * LOGIT_ROWS * hidden..(i * LOGIT_ROWS + r) * hidden];
                Projector::new(x, r, precision, &mut ws.mm)?.apply(&head, out)?;
            }
        }
        Ok(())
    }
}

/// Rows of logits computed per LM-head call (bounds the refined product's scratch).
const LOGIT_ROWS: usize = 16;

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
    refined: bool,
    full: &'a mut Vec<f32>,
}

impl<'a> Projector<'a> {
    /// Quantizes `x` (`n` rows) once, at the weights' precision.
    fn new(
        x: &'a [f32],
        n: usize,
        precision: Precision,
        scratch: &'a mut MatmulScratch,
    ) -> Result<Self, ModelError> {
        let cols = x.len() / n;
        let refined = precision == Precision::Refined;
        let MatmulScratch {
            quant,
            stacked,
            full,
        } = scratch;
        let input = if refined {
            QuantizedInput::quantize_refined(x, n, cols, stacked, quant)
        } else {
            QuantizedInput::quantize(x, n, cols, quant)
        }
        .map_err(|e| ModelError::Weights(e.to_string()))?;
        Ok(Projector {
            input,
            refined,
            full,
        })
    }

    /// `out = W·x` (`n × rows`).
    fn apply(&mut self, w: &QMatrix<'_>, out: &mut [f32]) -> Result<(), ModelError> {
        let err = |e: crate::quant::QuantError| ModelError::Weights(e.to_string());
        if self.refined {
            self.full.resize(2 * out.len(), 0.0);
            matmul(w, &self.input, self.full).map_err(err)?;
            fold_refined(self.full, out);
            Ok(())
        } else {
            matmul(w, &self.input, out).map_err(err)
        }
    }
}

fn add_bias(rows: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in rows.chunks_exact_mut(b.len()) {
            add_in_place(row, b);
        }
    }
}
