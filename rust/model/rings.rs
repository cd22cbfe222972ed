//! A layer range's KV memory: one ring for its global-attention layers and one for its
//! sliding-window layers, driven together through the ring's append protocol.
//!
//! Both rings see every append with the same clock, pieces and spans. The global ring has the
//! session's geometry (slots, recall, anchors). The local ring holds only what a sliding
//! layer can still attend to: no anchors, no recall, `window + span − 1` slots rounded up
//! to `window + span`. Its FIFO evicts whole spans of at most `span` positions, so after
//! appending clock `c` it still holds every key from `c − window + 1`; the attention kernel
//! masks anything older ([`crate::attention::PendingChunk::window`]). Keys are cached rotated
//! at their absolute positions and every query is rotated at its own clock, so relative RoPE
//! distances are exact however often the local ring wraps.
//!
//! Volumes keep the slab of every layer for the whole prefix (layout `(layers, kv_heads,
//! n, head_dim)` in range order), so longest-prefix replay can cut any volume anywhere. A
//! prefix is capturable only while the local ring still holds all of it — the first
//! `window + span` positions, minus whatever was decoded since; longer prefixes are declined
//! (llama.cpp's own SWA cache cannot restore a longer prefix either).

use super::{ModelConfig, ModelError, SessionConfig, SPAN_TOKENS};
use crate::ring::{
    DynamicRingBuffer, KvDtype, KvSlice, RingConfig, RingError, SemanticSpan, SpanType,
};

/// Which of a range's rings holds a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingKind {
    /// Global attention: the session's ring geometry.
    Global,
    /// Sliding-window attention: the window plus one span.
    Local,
}

/// The rings of one sequence over a layer range.
#[derive(Debug)]
pub struct LayerRings {
    global: Option<DynamicRingBuffer>,
    local: Option<DynamicRingBuffer>,
    /// Per range layer: its ring and its index there.
    place: Vec<(RingKind, usize)>,
    /// Keys a sliding layer sees (0 when the range has none).
    window: usize,
    max_chunk: usize,
    span_tokens: u64,
}

fn ring_err(e: RingError) -> ModelError {
    ModelError::Ring(e.to_string())
}

impl LayerRings {
    /// Empty rings (clock 0) for layers `[layer_lo, layer_hi)` of a model shaped like `c`.
    pub fn new(
        c: &ModelConfig,
        layer_lo: usize,
        layer_hi: usize,
        sizes: &SessionConfig,
        kv_dtype: KvDtype,
    ) -> Result<Self, ModelError> {
        if layer_lo >= layer_hi || layer_hi > c.n_layers {
            return Err(ModelError::Input(format!(
                "layer range {layer_lo}..{layer_hi} is not a non-empty part of 0..{}",
                c.n_layers
            )));
        }
        if sizes.slots > c.context_len {
            return Err(ModelError::Input(format!(
                "{} slots exceed the trained context of {} positions: relative distances \
                 must stay inside it",
                sizes.slots, c.context_len
            )));
        }
        if sizes.max_chunk == 0 {
            return Err(ModelError::Input("max_chunk must be at least 1".into()));
        }
        let mut global_cfg = RingConfig::new(1, c.n_kv_heads, c.head_dim());
        global_cfg.slots = sizes.slots;
        global_cfg.recall = sizes.recall;
        global_cfg.n_sys = sizes.n_sys;
        global_cfg.max_positions = Some(c.context_len);
        global_cfg.kv_dtype = kv_dtype;
        // Spans (and pieces) depend only on the session's sizes, never on which layers a
        // range holds, so every station of a mesh cuts an append the same way.
        let span_tokens = SPAN_TOKENS.min(global_cfg.window_len() as u64 / 2).max(1);
        let max_chunk = sizes.max_chunk.min(span_tokens as usize).max(1);
        global_cfg.max_chunk = max_chunk;
        let mut place = Vec::with_capacity(layer_hi - layer_lo);
        let (mut n_global, mut n_local) = (0, 0);
        for layer in layer_lo..layer_hi {
            if c.is_local(layer) {
                place.push((RingKind::Local, n_local));
                n_local += 1;
            } else {
                place.push((RingKind::Global, n_global));
                n_global += 1;
            }
        }
        let global = if n_global > 0 {
            global_cfg.n_layers = n_global;
            Some(DynamicRingBuffer::new(global_cfg).map_err(ring_err)?)
        } else {
            // Validate the sizes even when no layer of this range attends globally.
            global_cfg.validate().map_err(ring_err)?;
            None
        };
        let window = c.sliding.as_ref().map_or(0, |s| s.window);
        let local = if n_local > 0 {
            let slots = (window + span_tokens as usize)
                .min(c.context_len)
                .max(max_chunk);
            let local_cfg = RingConfig {
                n_layers: n_local,
                slots,
                recall: 0,
                n_sys: 0,
                max_chunk,
                max_positions: Some(c.context_len),
                kv_dtype,
                ..RingConfig::new(n_local, c.n_kv_heads, c.head_dim())
            };
            Some(DynamicRingBuffer::new(local_cfg).map_err(ring_err)?)
        } else {
            None
        };
        Ok(LayerRings {
            global,
            local,
            place,
            window,
            max_chunk,
            span_tokens,
        })
    }

    /// Every ring of the range, the global one first.
    pub fn all(&self) -> impl Iterator<Item = &DynamicRingBuffer> {
        self.global.iter().chain(self.local.iter())
    }

    fn rings_mut(&mut self) -> impl Iterator<Item = &mut DynamicRingBuffer> {
        self.global.iter_mut().chain(self.local.iter_mut())
    }

    /// The ring whose clock and spans stand for the range (both rings agree on them).
    fn primary(&self) -> &DynamicRingBuffer {
        self.global
            .as_ref()
            .or(self.local.as_ref())
            .expect("a range has at least one layer")
    }

    /// f32 per position of one layer's K (or V): `kv_heads × head_dim`.
    pub fn row_len(&self) -> usize {
        self.primary().config().row_len()
    }

    /// Largest piece appended at once.
    pub fn max_chunk(&self) -> usize {
        self.max_chunk
    }

    /// Span length: `SPAN_TOKENS`, or half the global window if that is smaller.
    pub fn span_tokens(&self) -> u64 {
        self.span_tokens
    }

    /// Positions held so far.
    pub fn clock(&self) -> u64 {
        self.primary().clock()
    }

    /// Anchor slots of the global ring (0 when the range has only sliding layers).
    pub fn n_sys(&self) -> usize {
        self.global.as_ref().map_or(0, DynamicRingBuffer::n_sys)
    }

    /// Semantic spans of the visible positions.
    pub fn spans(&self) -> impl ExactSizeIterator<Item = SemanticSpan> + '_ {
        self.primary().spans()
    }

    /// Physical KV slots of each layer of the range, in range order.
    pub fn slots_per_layer(&self) -> Vec<usize> {
        self.place
            .iter()
            .map(|&(kind, _)| self.ring(kind).slots())
            .collect()
    }

    /// Most keys a query can see (scratch sizing): the larger ring plus a chunk.
    pub fn max_keys(&self) -> usize {
        self.all().map(|r| r.slots()).max().unwrap_or(0) + self.max_chunk
    }

    /// Keys a sliding layer sees (`None` for a global layer). `layer` is range-relative.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        (self.place[layer].0 == RingKind::Local).then_some(self.window)
    }

    fn ring(&self, kind: RingKind) -> &DynamicRingBuffer {
        match kind {
            RingKind::Global => self.global.as_ref(),
            RingKind::Local => self.local.as_ref(),
        }
        .expect("a layer's ring exists")
    }

    fn ring_mut(&mut self, kind: RingKind) -> &mut DynamicRingBuffer {
        match kind {
            RingKind::Global => self.global.as_mut(),
            RingKind::Local => self.local.as_mut(),
        }
        .expect("a layer's ring exists")
    }

    /// The ring holding range layer `layer` and its index there.
    pub fn layer(&self, layer: usize) -> (&DynamicRingBuffer, usize) {
        let (kind, index) = self.place[layer];
        (self.ring(kind), index)
    }

    /// Forgets every position (clock 0), keeping the allocations.
    pub fn reset(&mut self) {
        self.rings_mut().for_each(DynamicRingBuffer::reset);
    }

    /// Undoes every position after `saved`, bit-exact; all or nothing.
    pub fn rollback(&mut self, saved: u64) -> Result<(), ModelError> {
        // Every ring's limit is checked first, so a refusal changes nothing.
        for r in self.all() {
            r.check_rollback(saved).map_err(ring_err)?;
        }
        for r in self.rings_mut() {
            r.rollback_clock(saved).map_err(ring_err)?;
        }
        Ok(())
    }

    /// Step 1 of the append protocol on every ring (nothing visible changes).
    pub fn begin_append(
        &mut self,
        n: usize,
        span: SpanType,
        new_span: bool,
    ) -> Result<(), ModelError> {
        if let Some(g) = self.global.as_mut() {
            g.begin_append(n, span, new_span).map_err(ring_err)?;
        }
        if let Some(l) = self.local.as_mut() {
            if let Err(e) = l.begin_append(n, span, new_span) {
                if let Some(g) = self.global.as_mut() {
                    g.abort_append();
                }
                return Err(ring_err(e));
            }
        }
        Ok(())
    }

    /// Clock of pending row `i`.
    pub fn pending_clock(&self, i: usize) -> u64 {
        self.primary().pending_clock(i)
    }

    /// StreamingLLM cache position of pending row `i` in the global ring (the rotation of
    /// its `q_fixed`; equal to its clock when the range has no global layer).
    pub fn pending_cache_pos(&self, i: usize) -> u64 {
        self.primary().pending_cache_pos(i)
    }

    /// Writes range layer `layer`'s rows of the pending chunk (`n × kv_heads × head_dim`).
    pub fn write_pending(
        &mut self,
        layer: usize,
        keys: &[f32],
        vals: &[f32],
    ) -> Result<(), ModelError> {
        let (kind, index) = self.place[layer];
        self.ring_mut(kind)
            .write_pending(index, keys, vals)
            .map_err(ring_err)
    }

    /// Writes range layer `layer`'s pending rows from positions `offset..` of a volume held
    /// in blocks (see [`DynamicRingBuffer::write_pending_blocks`]) with every range layer.
    pub fn write_pending_blocks(
        &mut self,
        layer: usize,
        blocks: &[(KvSlice<'_>, KvSlice<'_>)],
        block: usize,
        offset: usize,
    ) -> Result<(), ModelError> {
        let (kind, index) = self.place[layer];
        let layers = self.place.len();
        self.ring_mut(kind)
            .write_pending_layer_blocks(index, blocks, block, offset, (layers, layer))
            .map_err(ring_err)
    }

    /// Writes range layer `layer`'s pending rows from positions `offset..` of its slab
    /// `(kv_heads, total, head_dim)`.
    pub fn write_pending_slab(
        &mut self,
        layer: usize,
        keys: &[f32],
        vals: &[f32],
        total: usize,
        offset: usize,
    ) -> Result<(), ModelError> {
        let (kind, index) = self.place[layer];
        self.ring_mut(kind)
            .write_pending_layer_slab(index, keys, vals, total, offset)
            .map_err(ring_err)
    }

    /// Step 4: publishes the pending append on every ring.
    pub fn commit_append(&mut self) -> Result<(), ModelError> {
        let clock0 = self.clock();
        if let Some(g) = self.global.as_mut() {
            g.commit_append().map_err(ring_err)?;
        }
        if let Some(l) = self.local.as_mut() {
            if let Err(e) = l.commit_append() {
                l.abort_append();
                if let Some(g) = self.global.as_mut() {
                    let _ = g.rollback_clock(clock0);
                }
                return Err(ring_err(e));
            }
        }
        Ok(())
    }

    /// Drops the pending append on every ring.
    pub fn abort_append(&mut self) {
        self.rings_mut().for_each(DynamicRingBuffer::abort_append);
    }

    /// Copies positions `[0, n)` of every layer into `keys`/`vals`, volume layout
    /// `(layers, kv_heads, n, head_dim)` in range order, widened to f32. A prefix that a
    /// sliding layer's ring no longer holds whole is refused with [`ModelError::Volume`],
    /// saying why.
    pub fn read_prefix(
        &self,
        n: usize,
        keys: &mut [f32],
        vals: &mut [f32],
    ) -> Result<(), ModelError> {
        self.read_prefix_with(n, keys, vals, DynamicRingBuffer::read_logical)
    }

    /// [`read_prefix`](Self::read_prefix) as the f16 bit patterns an f16 session stores.
    pub fn read_prefix_bits(
        &self,
        n: usize,
        keys: &mut [u16],
        vals: &mut [u16],
    ) -> Result<(), ModelError> {
        self.read_prefix_with(n, keys, vals, DynamicRingBuffer::read_logical_bits)
    }

    fn read_prefix_with<T>(
        &self,
        n: usize,
        keys: &mut [T],
        vals: &mut [T],
        read: impl Fn(
            &DynamicRingBuffer,
            usize,
            usize,
            usize,
            &mut [T],
            &mut [T],
        ) -> Result<(), RingError>,
    ) -> Result<(), ModelError> {
        let block = self.row_len() * n;
        if keys.len() != block * self.place.len() || vals.len() != keys.len() {
            return Err(ModelError::Input(format!(
                "a {n}-position slab of {} layers is {} floats, got {}",
                self.place.len(),
                block * self.place.len(),
                keys.len()
            )));
        }
        if let Some(l) = &self.local {
            let resident = self.capturable_prefix(l);
            if n > resident {
                return Err(ModelError::Volume(format!(
                    "sliding-window layers keep only their last {} positions and now hold a \
                     prefix of at most {resident}: a {n}-token prefix cannot be captured exactly",
                    l.slots()
                )));
            }
        }
        for (i, (k, v)) in keys
            .chunks_exact_mut(block.max(1))
            .zip(vals.chunks_exact_mut(block.max(1)))
            .enumerate()
        {
            let (ring, index) = self.layer(i);
            read(ring, index, index + 1, n, k, v).map_err(ring_err)?;
        }
        Ok(())
    }

    /// Longest prefix `[0, p)` whose positions a sliding layer's ring still holds.
    fn capturable_prefix(&self, local: &DynamicRingBuffer) -> usize {
        let clock = local.clock() as usize;
        let slots = local.slots();
        if clock <= slots {
            clock
        } else {
            0
        }
    }

    /// The longest prefix this range can capture now (`None`: no limit but the clock).
    pub fn capture_limit(&self) -> Option<usize> {
        self.local.as_ref().map(|l| self.capturable_prefix(l))
    }
}
