//! The live KV cache of one session on one station: a fixed-size ring buffer
//! (`DynamicRingBuffer`) with three tiers, an indirection table of active slots, semantic
//! spans, a rollback journal, and the chunked-append protocol the model runtime drives.
//!
//! # Geometry
//!
//! Per layer there are `slots` physical rows; a row holds `kv_heads × head_dim` values for K
//! and the same for V (layout `[slot][kv_head][head_dim]`), stored as f16 (the default) or
//! f32 ([`KvDtype`]); values cross the API as f32. Everything is allocated once, zeroed, at
//! creation (a zeroed `vec!` lets the OS hand out lazy zero pages) and never resized.
//!
//! - Tier 1, anchors `[0, n_sys)`: written only by the first `n_sys` positions (the system
//!   prompt), by prefill or by [`DynamicRingBuffer::splice`]; never evicted.
//! - Tier 2, FIFO window `[n_sys, window_end)`, `window_end = slots − recall`, length
//!   `W = window_end − n_sys`: clock `c ≥ n_sys` lives in physical slot
//!   `n_sys + (c − n_sys) mod W` (clock `c < n_sys` in slot `c`).
//! - Tier 3, recall `[window_end, slots)`: written only by [`DynamicRingBuffer::inject_recall`].
//!
//! # The active-slot table
//!
//! Attention iterates `active_slots()` in order: **recall entries, anchors, then window entries
//! in clock order (oldest first)**. Recall comes first (not between anchors and window) so that
//! anchors, window and the chunk's own rows always form one contiguous clock-ordered run: the
//! kernel's reduction sequence is then the same whether an anchor row is already in the ring or
//! still a chunk-local row, which is what makes chunked prefill bit-identical to one-at-a-time.
//! [`DynamicRingBuffer::fixed_slots`] is the recall + anchor prefix of the table.
//!
//! # Spans and eviction
//!
//! Every position belongs to one [`SemanticSpan`]; an append starts a new span or extends the
//! open one. A position at clock `n_sys` always starts a new span (a span never straddles the
//! anchor/window boundary, so anchor spans are exactly the locked ones). A window span may not
//! be longer than `W`. When the window wraps and clock `c` overwrites the slot of `c − W`, the
//! whole span of `c − W` leaves the table (if it is still visible); [`prune_oldest_spans`]
//! evicts oldest whole window spans. Eviction is therefore always of the oldest spans, so the
//! visible window is the contiguous clock range `[window_lo, clock)`, which starts on a span
//! boundary — a span is never partly visible.
//!
//! # Rollback
//!
//! [`rollback_clock`] undoes appended positions: clock, spans, table and KV bytes. A position
//! that did not overwrite anything gets its slot zeroed (it was never written before); a
//! position that overwrote an older row (clock ≥ `window_end`) restores it from the undo
//! journal, which also remembers the span that overwrite evicted. The journal keeps the last
//! `undo_capacity` overwriting positions per layer (plus `max_chunk` rows of staging for the
//! pending chunk, so [`abort_append`] can always restore). Rolling back further than the
//! journal covers, below a [`prune_oldest_spans`] call, or to a future clock is an error that
//! changes nothing. The recall tier is not part of the rollback history.
//!
//! # RoPE as the window slides (the model applies the rotation; this module keeps positions)
//!
//! Keys are cached **already rotated at their absolute clock position** (anchors at
//! `0..n_sys`, window rows at their clock). RoPE scores depend only on the relative distance
//! `query position − key position`, and a visible window key is always within `W` positions of
//! the query, so window keys need nothing special: the query is rotated at its own clock
//! (`q_window`, also used for the chunk's local rows).
//!
//! Anchors sit at positions `0..n_sys`, which after many wraps are arbitrarily far behind the
//! query. They are scored with a second rotation of the query, `q_fixed`, at its StreamingLLM
//! cache position (see [`DynamicRingBuffer::cache_pos`]):
//! `cache_pos(c) = c` while `c < window_end`, else `n_sys + W − 1 = window_end − 1`. The oldest
//! possible visible window key of a query at `c ≥ window_end` is at distance `W − 1`, and anchor
//! `a` is at distance `window_end − 1 − a ∈ [W, window_end − 1]`: the anchors appear just before
//! the window, exactly as if the evicted middle had never existed. Before the first wrap
//! `cache_pos(c) = c`, so `q_fixed == q_window` and the result equals plain causal attention.
//! No cached key is ever re-rotated, so rollback stays exact.
//!
//! Relative distances stay `≤ window_end − 1 < slots`, so the model must have
//! `slots ≤ trained context` (set [`RingConfig::max_positions`] to have the ring check it).
//!
//! Edge cases:
//! - **Recall rows** are cached exactly as given (the caller rotates them at whatever positions
//!   it chose when it captured them) and are scored with `q_fixed`, like anchors.
//! - **`n_sys = 0`**: no anchors; `cache_pos` still saturates at `W − 1`, which only matters for
//!   recall rows.
//! - **Clocks beyond `u32`**: clocks and span bounds are `u64`; physical slots and cache
//!   positions are `< slots` and fit `u32`. The model should compute angles in f64 from the
//!   integer position (`pos as f64 * inv_freq`); the f64 angle error grows like `pos · 2⁻⁵³`
//!   rad (≈ 5e-7 rad at `pos = 2³²`, below f32 resolution of the rotated values), and both the
//!   cached key and the query carry it, so very long streams degrade gradually, never abruptly.
//!
//! # Chunked-append protocol (one prefill chunk or one decode step)
//!
//! 1. [`begin_append`]`(n, span, new_span)` validates and plans; nothing visible changes.
//! 2. Per row `i`: [`pending_clock`], [`pending_cache_pos`], [`fixed_slots`],
//!    [`pending_window`] (window entries visible to row `i`, in clock order) and
//!    [`pending_local_start`] (the first chunk row visible to row `i`; row `i` attends to
//!    chunk rows `pending_local_start(i)..=i` — the start is 0 unless the chunk's own
//!    overwrites evicted a span that the chunk had extended).
//! 3. Per layer: read [`layer_kv`], run attention for every row, then [`write_pending`].
//! 4. [`commit_append`] (or [`abort_append`]).
//!
//! The visible set of row `i` is exactly what it would see if the tokens were appended one at
//! a time, so a query's output does not depend on how the prompt was chunked.
//!
//! [`prune_oldest_spans`]: DynamicRingBuffer::prune_oldest_spans
//! [`rollback_clock`]: DynamicRingBuffer::rollback_clock
//! [`abort_append`]: DynamicRingBuffer::abort_append
//! [`begin_append`]: DynamicRingBuffer::begin_append
//! [`pending_clock`]: DynamicRingBuffer::pending_clock
//! [`pending_cache_pos`]: DynamicRingBuffer::pending_cache_pos
//! [`fixed_slots`]: DynamicRingBuffer::fixed_slots
//! [`pending_window`]: DynamicRingBuffer::pending_window
//! [`pending_local_start`]: DynamicRingBuffer::pending_local_start
//! [`layer_kv`]: DynamicRingBuffer::layer_kv
//! [`write_pending`]: DynamicRingBuffer::write_pending
//! [`commit_append`]: DynamicRingBuffer::commit_append

use std::collections::VecDeque;
use std::fmt;

mod store;

use store::KvStore;
pub use store::{KvDtype, KvSlice};

/// What a run of positions is, semantically. Pruning evicts whole spans.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpanType {
    /// System prompt / tool definitions.
    System = 0,
    /// A user message.
    User = 1,
    /// Model reasoning.
    Thought = 2,
    /// A tool invocation emitted by the model.
    ToolCall = 3,
    /// A tool's output fed back to the model.
    ToolResult = 4,
    /// One sentence of the model's response.
    ResponseSentence = 5,
    /// End-of-turn marker.
    TurnEnd = 6,
}

impl SpanType {
    /// Every span type, in discriminant order.
    pub const ALL: [SpanType; 7] = [
        SpanType::System,
        SpanType::User,
        SpanType::Thought,
        SpanType::ToolCall,
        SpanType::ToolResult,
        SpanType::ResponseSentence,
        SpanType::TurnEnd,
    ];

    /// The span type with discriminant `value`, if any.
    pub fn from_u8(value: u8) -> Option<SpanType> {
        SpanType::ALL.get(usize::from(value)).copied()
    }
}

/// A contiguous run of positions of one [`SpanType`]: clocks `[start_clock, end_clock)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SemanticSpan {
    /// What the span is.
    pub span_type: SpanType,
    /// First clock of the span.
    pub start_clock: u64,
    /// One past the last clock of the span (exclusive).
    pub end_clock: u64,
    /// Physical slot of the first position.
    pub start_slot: u32,
    /// Number of positions (`end_clock − start_clock`).
    pub slot_count: u32,
}

/// Sizes of a ring buffer. [`RingConfig::new`] gives the defaults of the design.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingConfig {
    /// Layers held (the station's layer range).
    pub n_layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Physical slots per layer (default 4096).
    pub slots: usize,
    /// Recall slots at the top (default 128).
    pub recall: usize,
    /// Anchor slots at the bottom, fixed at creation (default 0).
    pub n_sys: usize,
    /// Most rows one [`DynamicRingBuffer::begin_append`] may plan (default 512); must not
    /// exceed the window length.
    pub max_chunk: usize,
    /// Overwriting positions the rollback journal keeps (default 64).
    pub undo_capacity: usize,
    /// The model's trained context, if the ring should check `slots ≤ max_positions`.
    pub max_positions: Option<usize>,
    /// How K and V are stored (default f16).
    pub kv_dtype: KvDtype,
}

impl RingConfig {
    /// Defaults of the design: 4096 slots, 128 recall, no anchors, chunks of ≤ 512 rows, a
    /// 64-position undo journal.
    pub fn new(n_layers: usize, kv_heads: usize, head_dim: usize) -> RingConfig {
        RingConfig {
            n_layers,
            kv_heads,
            head_dim,
            slots: 4096,
            recall: 128,
            n_sys: 0,
            max_chunk: 512,
            undo_capacity: 64,
            max_positions: None,
            kv_dtype: KvDtype::default(),
        }
    }

    /// First slot of the recall tier (one past the window).
    pub fn window_end(&self) -> usize {
        self.slots.saturating_sub(self.recall)
    }

    /// Window length `W = window_end − n_sys`.
    pub fn window_len(&self) -> usize {
        self.window_end().saturating_sub(self.n_sys)
    }

    /// f32 per slot row of one of K or V: `kv_heads × head_dim`.
    pub fn row_len(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Checks every size rule; the error says which one failed.
    pub fn validate(&self) -> Result<(), RingError> {
        let bad = |reason: String| Err(RingError::InvalidConfig(reason));
        if self.n_layers == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return bad(format!(
                "n_layers, kv_heads and head_dim must be positive (got {}, {}, {})",
                self.n_layers, self.kv_heads, self.head_dim
            ));
        }
        if self.slots > u32::MAX as usize {
            return bad(format!("slots = {} does not fit u32", self.slots));
        }
        if self.recall >= self.slots {
            return bad(format!(
                "recall = {} leaves no window in {} slots",
                self.recall, self.slots
            ));
        }
        if self.n_sys >= self.window_end() {
            return bad(format!(
                "n_sys = {} must be below window_end = slots − recall = {} (the window would be empty)",
                self.n_sys,
                self.window_end()
            ));
        }
        if self.max_chunk == 0 || self.max_chunk > self.window_len() {
            return bad(format!(
                "max_chunk = {} must be in 1..={} (the window length)",
                self.max_chunk,
                self.window_len()
            ));
        }
        if let Some(max_positions) = self.max_positions {
            if self.slots > max_positions {
                return bad(format!(
                    "slots = {} exceeds the model's trained context {max_positions}",
                    self.slots
                ));
            }
        }
        let journal_rows = self.undo_capacity.checked_add(self.max_chunk);
        let sizes = self
            .row_len()
            .checked_mul(self.slots)
            .and_then(|per_layer| per_layer.checked_mul(self.n_layers))
            .zip(
                journal_rows
                    .and_then(|rows| rows.checked_mul(self.n_layers)?.checked_mul(self.row_len())),
            );
        if sizes.is_none() {
            return bad("the buffer sizes overflow usize".to_string());
        }
        Ok(())
    }
}

/// Everything that can go wrong with a ring-buffer operation. An operation that returns an
/// error has changed nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RingError {
    /// The configuration breaks a size rule (the message says which).
    InvalidConfig(String),
    /// An append of zero positions.
    EmptyAppend,
    /// A chunk larger than `max_chunk`.
    ChunkTooLarge {
        /// Rows requested.
        n: usize,
        /// The configured limit.
        max_chunk: usize,
    },
    /// `new_span = false` but there is no open span to extend (empty ring, or the last span
    /// was evicted).
    NoOpenSpan,
    /// The append would make a window span longer than the window.
    SpanLongerThanWindow {
        /// Length the span would reach.
        span_len: u64,
        /// The window length.
        window: usize,
    },
    /// An append is planned; commit or abort it first.
    AppendPending,
    /// No append is planned.
    NoPendingAppend,
    /// A layer index outside the ring (or an empty / reversed layer range).
    LayerOutOfRange {
        /// The offending layer (or range end).
        layer: usize,
        /// Layers the ring holds.
        n_layers: usize,
    },
    /// `write_pending` was already called for this layer in the pending append.
    LayerAlreadyWritten {
        /// The layer.
        layer: usize,
    },
    /// `commit_append` before every layer was written.
    LayerNotWritten {
        /// The first unwritten layer.
        layer: usize,
    },
    /// A buffer of the wrong length.
    ShapeMismatch {
        /// Which argument.
        what: &'static str,
        /// Expected length in f32.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// Rollback to a clock after the current one.
    FutureClock {
        /// Requested clock.
        saved: u64,
        /// Current clock.
        clock: u64,
    },
    /// Rollback further back than the history allows (journal size, or a prune in between).
    RollbackTooFar {
        /// Requested clock.
        saved: u64,
        /// Oldest clock that can still be restored.
        oldest: u64,
    },
    /// More recall rows than free recall slots.
    RecallOverflow {
        /// Rows requested.
        requested: usize,
        /// Free recall slots.
        free: usize,
    },
    /// A logical position at or beyond the clock was requested.
    PositionNotWritten {
        /// The position.
        position: u64,
        /// Current clock.
        clock: u64,
    },
    /// A logical position whose slot has since been overwritten by the wrapping window.
    PositionOverwritten {
        /// The first overwritten position requested.
        position: u64,
    },
    /// A spliced slab holds a NaN or infinity.
    NonFinite {
        /// First logical position (relative to the slab) with a non-finite value.
        position: usize,
    },
}

impl fmt::Display for RingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RingError::InvalidConfig(reason) => write!(f, "invalid ring config: {reason}"),
            RingError::EmptyAppend => write!(f, "an append needs at least one position"),
            RingError::ChunkTooLarge { n, max_chunk } => {
                write!(f, "chunk of {n} rows exceeds max_chunk = {max_chunk}")
            }
            RingError::NoOpenSpan => write!(
                f,
                "new_span = false but there is no open span to extend (empty ring or evicted)"
            ),
            RingError::SpanLongerThanWindow { span_len, window } => write!(
                f,
                "span of {span_len} positions is longer than the window ({window} slots)"
            ),
            RingError::AppendPending => {
                write!(
                    f,
                    "an append is pending: commit_append or abort_append first"
                )
            }
            RingError::NoPendingAppend => write!(f, "no append is pending"),
            RingError::LayerOutOfRange { layer, n_layers } => {
                write!(
                    f,
                    "layer {layer} out of range: the ring holds {n_layers} layers"
                )
            }
            RingError::LayerAlreadyWritten { layer } => {
                write!(f, "layer {layer} was already written in this append")
            }
            RingError::LayerNotWritten { layer } => {
                write!(f, "cannot commit: layer {layer} was not written")
            }
            RingError::ShapeMismatch {
                what,
                expected,
                got,
            } => write!(f, "{what}: expected {expected} f32, got {got}"),
            RingError::FutureClock { saved, clock } => write!(
                f,
                "cannot roll back to clock {saved}: it is after the current clock {clock}"
            ),
            RingError::RollbackTooFar { saved, oldest } => write!(
                f,
                "cannot roll back to clock {saved}: the history reaches back only to clock {oldest}"
            ),
            RingError::RecallOverflow { requested, free } => write!(
                f,
                "recall overflow: {requested} rows requested, {free} recall slots free"
            ),
            RingError::PositionNotWritten { position, clock } => write!(
                f,
                "position {position} has not been written (clock is {clock})"
            ),
            RingError::PositionOverwritten { position } => write!(
                f,
                "position {position} has been overwritten by the wrapping window"
            ),
            RingError::NonFinite { position } => {
                write!(f, "non-finite value at logical position {position}")
            }
        }
    }
}

impl std::error::Error for RingError {}

/// What one overwriting position needs for rollback (its KV rows live beside it).
#[derive(Clone, Copy, Debug)]
struct JournalEntry {
    /// The span its overwrite evicted, if any.
    evicted: Option<SemanticSpan>,
}

/// The pending append (all buffers preallocated at creation).
#[derive(Debug)]
struct Plan {
    active: bool,
    n: usize,
    clock0: u64,
    span_type: SpanType,
    new_span: bool,
    /// Per row: the window's first visible clock after rows `0..=i`.
    window_lo: Vec<u64>,
    /// Per row: whether its overwrite evicts the oldest window span.
    evicts: Vec<bool>,
    /// First row whose slot held an older row (all later rows do too).
    first_overwrite: usize,
    /// Per layer: written by `write_pending`.
    written: Vec<bool>,
}

/// Where the rows of a write come from.
#[derive(Clone, Copy)]
enum RowSource<'a> {
    /// Chunk rows `(n, kv_heads, head_dim)`.
    RowMajor { keys: &'a [f32], vals: &'a [f32] },
    /// Rows `offset..offset + n` of layer `slab_layer` of a volume slab
    /// `(layers, kv_heads, total, head_dim)`.
    Slab {
        keys: &'a [f32],
        vals: &'a [f32],
        total: usize,
        offset: usize,
        slab_layer: usize,
    },
    /// Rows `offset..offset + n` of consecutive volume blocks of `block` positions (the last
    /// may hold fewer), each `(keys, values)` laid out `(n_layers, kv_heads, positions,
    /// head_dim)`.
    Blocks {
        blocks: &'a [(KvSlice<'a>, KvSlice<'a>)],
        block: usize,
        offset: usize,
        /// Layers each block holds, and which of them feeds this ring layer.
        slab_layers: usize,
        slab_layer: usize,
    },
}

/// The live KV cache of one session on one station. See the module docs.
#[derive(Debug)]
pub struct DynamicRingBuffer {
    cfg: RingConfig,
    row: usize,
    window_end: usize,
    window_len: usize,
    keys: KvStore,
    vals: KvStore,
    clock: u64,
    /// Active slots: recall, anchors, window (clock order); `table_len` used.
    table: Vec<u32>,
    table_len: usize,
    recall_count: usize,
    /// Anchor spans first (`n_anchor_spans` of them), then visible window spans.
    spans: VecDeque<SemanticSpan>,
    n_anchor_spans: usize,
    journal_keys: KvStore,
    journal_vals: KvStore,
    journal_meta: Vec<JournalEntry>,
    journal_head: usize,
    journal_len: usize,
    /// Rollback never goes below this clock (raised by pruning).
    rollback_floor: u64,
    plan: Plan,
}

impl DynamicRingBuffer {
    /// Allocates the ring (one zeroed allocation per buffer, never resized).
    pub fn new(cfg: RingConfig) -> Result<DynamicRingBuffer, RingError> {
        cfg.validate()?;
        let row = cfg.row_len();
        let window_end = cfg.window_end();
        let window_len = cfg.window_len();
        let kv_len = cfg.n_layers * cfg.slots * row;
        let journal_rows = cfg.undo_capacity + cfg.max_chunk;
        let journal_len = journal_rows * cfg.n_layers * row;
        Ok(DynamicRingBuffer {
            row,
            window_end,
            window_len,
            keys: KvStore::zeros(cfg.kv_dtype, kv_len),
            vals: KvStore::zeros(cfg.kv_dtype, kv_len),
            clock: 0,
            table: vec![0; cfg.slots],
            table_len: 0,
            recall_count: 0,
            // Each visible position belongs to one span: at most n_sys + W spans, +1 while a
            // commit pushes before the next eviction.
            spans: VecDeque::with_capacity(cfg.n_sys + window_len + 1),
            n_anchor_spans: 0,
            journal_keys: KvStore::zeros(cfg.kv_dtype, journal_len),
            journal_vals: KvStore::zeros(cfg.kv_dtype, journal_len),
            journal_meta: vec![JournalEntry { evicted: None }; journal_rows],
            journal_head: 0,
            journal_len: 0,
            rollback_floor: 0,
            plan: Plan {
                active: false,
                n: 0,
                clock0: 0,
                span_type: SpanType::System,
                new_span: true,
                window_lo: vec![0; cfg.max_chunk],
                evicts: vec![false; cfg.max_chunk],
                first_overwrite: 0,
                written: vec![false; cfg.n_layers],
            },
            cfg,
        })
    }

    // ----- geometry and state ------------------------------------------------------------

    /// The configuration.
    pub fn config(&self) -> &RingConfig {
        &self.cfg
    }

    /// Number of positions appended so far (the absolute position of the next token).
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Anchor slots.
    pub fn n_sys(&self) -> usize {
        self.cfg.n_sys
    }

    /// First recall slot (one past the window).
    pub fn window_end(&self) -> usize {
        self.window_end
    }

    /// Window length `W`.
    pub fn window_len(&self) -> usize {
        self.window_len
    }

    /// Physical slots per layer.
    pub fn slots(&self) -> usize {
        self.cfg.slots
    }

    /// Recall rows currently injected.
    pub fn recall_count(&self) -> usize {
        self.recall_count
    }

    /// Physical slot of `clock`: `clock` below `n_sys`, else `n_sys + (clock − n_sys) mod W`.
    pub fn physical_slot(&self, clock: u64) -> u32 {
        let n_sys = self.cfg.n_sys as u64;
        let slot = if clock < n_sys {
            clock
        } else {
            n_sys + (clock - n_sys) % self.window_len as u64
        };
        slot as u32
    }

    /// StreamingLLM cache position of a query at `clock` (the rotation of `q_fixed`):
    /// `clock` while `clock < window_end`, else `window_end − 1`.
    pub fn cache_pos(&self, clock: u64) -> u64 {
        clock.min(self.window_end as u64 - 1)
    }

    /// The active-slot table: recall, anchors, then window entries in clock order.
    pub fn active_slots(&self) -> &[u32] {
        &self.table[..self.table_len]
    }

    /// Recall + anchor entries (scored with `q_fixed`).
    pub fn fixed_slots(&self) -> &[u32] {
        &self.table[..self.fixed_len()]
    }

    /// Window entries in clock order (scored with `q_window`).
    pub fn window_slots(&self) -> &[u32] {
        &self.table[self.fixed_len()..self.table_len]
    }

    /// Semantic spans of the visible positions: anchor spans, then window spans, oldest first.
    pub fn spans(&self) -> impl ExactSizeIterator<Item = SemanticSpan> + '_ {
        self.spans.iter().copied()
    }

    /// Oldest visible window clock (`clock` when the window is empty).
    pub fn window_lo(&self) -> u64 {
        self.spans
            .get(self.n_anchor_spans)
            .map_or(self.clock, |span| span.start_clock)
    }

    /// Oldest clock [`rollback_clock`](Self::rollback_clock) can restore right now.
    pub fn oldest_rollback_clock(&self) -> u64 {
        let wrap = self.window_end as u64;
        let by_journal = self.clock.saturating_sub(self.journal_len as u64);
        if by_journal <= wrap {
            // Positions below window_end need no journal entry.
            self.rollback_floor
        } else {
            by_journal.max(self.rollback_floor)
        }
    }

    /// K and V of one layer, `(slots, kv_heads, head_dim)` each.
    ///
    /// # Panics
    /// If `layer ≥ n_layers`.
    pub fn layer_kv(&self, layer: usize) -> (KvSlice<'_>, KvSlice<'_>) {
        let range = self.layer_range(layer);
        (self.keys.slice(range.clone()), self.vals.slice(range))
    }

    fn layer_range(&self, layer: usize) -> std::ops::Range<usize> {
        assert!(
            layer < self.cfg.n_layers,
            "layer {layer} out of range ({} layers)",
            self.cfg.n_layers
        );
        let per_layer = self.cfg.slots * self.row;
        layer * per_layer..(layer + 1) * per_layer
    }

    fn fixed_len(&self) -> usize {
        self.recall_count + self.anchor_count()
    }

    /// Anchors currently written (`min(clock, n_sys)`).
    pub fn anchor_count(&self) -> usize {
        self.clock.min(self.cfg.n_sys as u64) as usize
    }

    fn row_offset(&self, layer: usize, slot: u32) -> usize {
        (layer * self.cfg.slots + slot as usize) * self.row
    }

    fn journal_offset(&self, entry: usize, layer: usize) -> usize {
        (entry * self.cfg.n_layers + layer) * self.row
    }

    fn journal_rows(&self) -> usize {
        self.journal_meta.len()
    }

    // ----- table -----------------------------------------------------------------------

    /// Rewrites the table from (recall_count, clock, window_lo). Only u32 writes, no KV moves.
    fn refresh_table(&mut self) {
        let mut at = 0;
        for r in 0..self.recall_count {
            self.table[at] = (self.window_end + r) as u32;
            at += 1;
        }
        for a in 0..self.anchor_count() {
            self.table[at] = a as u32;
            at += 1;
        }
        let lo = self.window_lo();
        let count = (self.clock - lo) as usize;
        if count > 0 {
            let start = self.physical_slot(lo) as usize;
            let first_run = count.min(self.window_end - start);
            for s in start..start + first_run {
                self.table[at] = s as u32;
                at += 1;
            }
            for s in self.cfg.n_sys..self.cfg.n_sys + (count - first_run) {
                self.table[at] = s as u32;
                at += 1;
            }
        }
        self.table_len = at;
    }

    // ----- chunked append ----------------------------------------------------------------

    /// Does row `i` of an append at `clock0` start a span?
    fn starts_span(&self, clock0: u64, i: usize, new_span: bool) -> bool {
        (i == 0 && new_span) || (self.cfg.n_sys > 0 && clock0 + i as u64 == self.cfg.n_sys as u64)
    }

    /// Span rules for appending `n` positions at the current clock (no chunk-size rule).
    fn check_spans(&self, n: usize, new_span: bool) -> Result<(), RingError> {
        if n == 0 {
            return Err(RingError::EmptyAppend);
        }
        let clock0 = self.clock;
        let n_sys = self.cfg.n_sys as u64;
        let open = self.spans.back().filter(|span| span.end_clock == clock0);
        if !self.starts_span(clock0, 0, new_span) && open.is_none() {
            return Err(RingError::NoOpenSpan);
        }
        let end = clock0 + n as u64;
        let first_window = clock0.max(n_sys);
        if end > first_window {
            let extends = first_window == clock0 && !self.starts_span(clock0, 0, new_span);
            let start = match (extends, open) {
                (true, Some(span)) => span.start_clock,
                _ => first_window,
            };
            let span_len = end - start;
            if span_len > self.window_len as u64 {
                return Err(RingError::SpanLongerThanWindow {
                    span_len,
                    window: self.window_len,
                });
            }
        }
        Ok(())
    }

    /// Plans an append of `n ≤ max_chunk` positions (step 1 of the protocol). Nothing visible
    /// changes until [`commit_append`](Self::commit_append).
    pub fn begin_append(
        &mut self,
        n: usize,
        span: SpanType,
        new_span: bool,
    ) -> Result<(), RingError> {
        if self.plan.active {
            return Err(RingError::AppendPending);
        }
        if n > self.cfg.max_chunk {
            return Err(RingError::ChunkTooLarge {
                n,
                max_chunk: self.cfg.max_chunk,
            });
        }
        self.check_spans(n, new_span)?;
        let clock0 = self.clock;
        let wrap = self.window_end as u64;
        let w = self.window_len as u64;
        let mut lo = self.window_lo();
        let mut front = self.n_anchor_spans;
        let mut first_overwrite = n;
        for i in 0..n {
            let c = clock0 + i as u64;
            let mut evicts = false;
            if c >= wrap {
                first_overwrite = first_overwrite.min(i);
                let overwritten = c - w;
                if overwritten >= lo {
                    // The oldest visible position is overwritten: its whole span leaves.
                    // It is an existing span (max_chunk ≤ W), never the one being built.
                    lo = self.spans[front].end_clock;
                    front += 1;
                    evicts = true;
                }
            }
            self.plan.window_lo[i] = lo;
            self.plan.evicts[i] = evicts;
        }
        self.plan.written.fill(false);
        self.plan.active = true;
        self.plan.n = n;
        self.plan.clock0 = clock0;
        self.plan.span_type = span;
        self.plan.new_span = new_span;
        self.plan.first_overwrite = first_overwrite;
        Ok(())
    }

    /// Whether an append is planned.
    pub fn has_pending(&self) -> bool {
        self.plan.active
    }

    /// Rows of the pending append (0 when none).
    pub fn pending_len(&self) -> usize {
        if self.plan.active {
            self.plan.n
        } else {
            0
        }
    }

    fn check_row(&self, i: usize) {
        assert!(self.plan.active, "no append is pending");
        assert!(
            i < self.plan.n,
            "row {i} out of range: the pending append has {} rows",
            self.plan.n
        );
    }

    /// Clock (absolute position) of pending row `i`.
    ///
    /// # Panics
    /// If no append is pending or `i` is not one of its rows (as for all `pending_*`).
    pub fn pending_clock(&self, i: usize) -> u64 {
        self.check_row(i);
        self.plan.clock0 + i as u64
    }

    /// StreamingLLM cache position of pending row `i` (rotation of its `q_fixed`).
    pub fn pending_cache_pos(&self, i: usize) -> u64 {
        self.cache_pos(self.pending_clock(i))
    }

    /// Window entries (physical slots, clock order) that pending row `i` attends to.
    pub fn pending_window(&self, i: usize) -> &[u32] {
        self.check_row(i);
        let lo_now = self.window_lo();
        let lo = self.plan.window_lo[i];
        let window = self.window_slots();
        if lo >= self.plan.clock0 {
            &window[window.len()..]
        } else {
            &window[(lo - lo_now) as usize..]
        }
    }

    /// First chunk row visible to pending row `i` (it attends to rows `start..=i`).
    pub fn pending_local_start(&self, i: usize) -> usize {
        self.check_row(i);
        self.plan.window_lo[i].saturating_sub(self.plan.clock0) as usize
    }

    /// Like [`write_pending`](Self::write_pending), but the pending rows are positions
    /// `offset..offset + n` of a volume-layout slab `(n_layers, kv_heads, total, head_dim)`:
    /// a replayed volume is written straight into its slots, with no transposing copy.
    pub fn write_pending_slab(
        &mut self,
        layer: usize,
        keys: &[f32],
        vals: &[f32],
        total: usize,
        offset: usize,
    ) -> Result<(), RingError> {
        let whole = self.cfg.n_layers * self.row * total;
        self.write_slab_rows(layer, keys, vals, total, offset, (whole, layer))
    }

    /// Like [`write_pending_slab`](Self::write_pending_slab), from the slab of this one layer
    /// `(kv_heads, total, head_dim)` (a volume's layers may live in several rings, e.g. the
    /// sliding-window and the global layers of a Gemma range).
    pub fn write_pending_layer_slab(
        &mut self,
        layer: usize,
        keys: &[f32],
        vals: &[f32],
        total: usize,
        offset: usize,
    ) -> Result<(), RingError> {
        self.write_slab_rows(layer, keys, vals, total, offset, (self.row * total, 0))
    }

    /// The pending rows of `layer` from positions `offset..` of layer `slab_layer` of a slab
    /// of `expected` floats.
    fn write_slab_rows(
        &mut self,
        layer: usize,
        keys: &[f32],
        vals: &[f32],
        total: usize,
        offset: usize,
        (expected, slab_layer): (usize, usize),
    ) -> Result<(), RingError> {
        self.check_write(layer)?;
        check_lengths(expected, keys.len(), vals.len())?;
        if offset + self.plan.n > total {
            return Err(RingError::ShapeMismatch {
                what: "slab positions",
                expected: offset + self.plan.n,
                got: total,
            });
        }
        self.write_rows(
            layer,
            RowSource::Slab {
                keys,
                vals,
                total,
                offset,
                slab_layer,
            },
        );
        Ok(())
    }

    /// Like [`write_pending_slab`](Self::write_pending_slab), but the volume is held in
    /// consecutive blocks of `block` positions (the last may hold fewer), each `(keys,
    /// values)` laid out `(n_layers, kv_heads, positions, head_dim)`: pending rows are
    /// positions `offset..offset + n` of their concatenation.
    pub fn write_pending_blocks(
        &mut self,
        layer: usize,
        blocks: &[(KvSlice<'_>, KvSlice<'_>)],
        block: usize,
        offset: usize,
    ) -> Result<(), RingError> {
        self.write_pending_layer_blocks(layer, blocks, block, offset, (self.cfg.n_layers, layer))
    }

    /// Like [`write_pending_blocks`](Self::write_pending_blocks), for blocks that hold
    /// `slab_layers` layers of which `slab_layer` feeds this ring's `layer` (a volume's
    /// layers may live in several rings, e.g. a Gemma range's sliding and global layers).
    pub fn write_pending_layer_blocks(
        &mut self,
        layer: usize,
        blocks: &[(KvSlice<'_>, KvSlice<'_>)],
        block: usize,
        offset: usize,
        (slab_layers, slab_layer): (usize, usize),
    ) -> Result<(), RingError> {
        self.check_write(layer)?;
        if slab_layer >= slab_layers {
            return Err(RingError::LayerOutOfRange {
                layer: slab_layer,
                n_layers: slab_layers,
            });
        }
        let per_position = slab_layers * self.row;
        let mut total = 0;
        for (b, (keys, vals)) in blocks.iter().enumerate() {
            let positions = keys.len() / per_position.max(1);
            let last = b + 1 == blocks.len();
            let fits = if last {
                (1..=block).contains(&positions)
            } else {
                positions == block
            };
            if !fits {
                return Err(RingError::ShapeMismatch {
                    what: "block positions",
                    expected: block,
                    got: positions,
                });
            }
            check_lengths(per_position * positions, keys.len(), vals.len())?;
            total += positions;
        }
        if offset + self.plan.n > total {
            return Err(RingError::ShapeMismatch {
                what: "block positions",
                expected: offset + self.plan.n,
                got: total,
            });
        }
        self.write_rows(
            layer,
            RowSource::Blocks {
                blocks,
                block,
                offset,
                slab_layers,
                slab_layer,
            },
        );
        Ok(())
    }

    /// Writes the pending chunk's K/V rows (`n × kv_heads × head_dim` each) for one layer,
    /// journaling the rows they overwrite.
    pub fn write_pending(
        &mut self,
        layer: usize,
        keys: &[f32],
        vals: &[f32],
    ) -> Result<(), RingError> {
        self.check_write(layer)?;
        let expected = self.plan.n * self.row;
        check_lengths(expected, keys.len(), vals.len())?;
        self.write_rows(layer, RowSource::RowMajor { keys, vals });
        Ok(())
    }

    fn check_write(&self, layer: usize) -> Result<(), RingError> {
        if !self.plan.active {
            return Err(RingError::NoPendingAppend);
        }
        if layer >= self.cfg.n_layers {
            return Err(RingError::LayerOutOfRange {
                layer,
                n_layers: self.cfg.n_layers,
            });
        }
        if self.plan.written[layer] {
            return Err(RingError::LayerAlreadyWritten { layer });
        }
        Ok(())
    }

    fn write_rows(&mut self, layer: usize, source: RowSource<'_>) {
        let row = self.row;
        let head_dim = self.cfg.head_dim;
        for i in 0..self.plan.n {
            let slot = self.physical_slot(self.plan.clock0 + i as u64);
            let dst = self.row_offset(layer, slot);
            if i >= self.plan.first_overwrite {
                let entry =
                    (self.journal_head + i - self.plan.first_overwrite) % self.journal_rows();
                let j = self.journal_offset(entry, layer);
                self.keys.copy_to(dst, &mut self.journal_keys, j, row);
                self.vals.copy_to(dst, &mut self.journal_vals, j, row);
            }
            match source {
                RowSource::RowMajor { keys, vals } => {
                    self.keys.put(dst, &keys[i * row..(i + 1) * row]);
                    self.vals.put(dst, &vals[i * row..(i + 1) * row]);
                }
                RowSource::Slab {
                    keys,
                    vals,
                    total,
                    offset,
                    slab_layer,
                } => {
                    for h in 0..self.cfg.kv_heads {
                        let src =
                            ((slab_layer * self.cfg.kv_heads + h) * total + offset + i) * head_dim;
                        let d = dst + h * head_dim;
                        self.keys.put(d, &keys[src..src + head_dim]);
                        self.vals.put(d, &vals[src..src + head_dim]);
                    }
                }
                RowSource::Blocks {
                    blocks,
                    block,
                    offset,
                    slab_layers,
                    slab_layer,
                } => {
                    let p = offset + i;
                    let (keys, vals) = blocks[p / block];
                    let positions = keys.len() / (slab_layers * row);
                    for h in 0..self.cfg.kv_heads {
                        let src = ((slab_layer * self.cfg.kv_heads + h) * positions + p % block)
                            * head_dim;
                        let d = dst + h * head_dim;
                        self.keys.put_slice(d, keys.slice(src..src + head_dim));
                        self.vals.put_slice(d, vals.slice(src..src + head_dim));
                    }
                }
            }
        }
        self.plan.written[layer] = true;
    }

    /// Publishes the pending append: clock, spans, table, journal (step 4 of the protocol).
    pub fn commit_append(&mut self) -> Result<(), RingError> {
        if !self.plan.active {
            return Err(RingError::NoPendingAppend);
        }
        if let Some(layer) = self.plan.written.iter().position(|written| !written) {
            return Err(RingError::LayerNotWritten { layer });
        }
        let n_sys = self.cfg.n_sys as u64;
        for i in 0..self.plan.n {
            let c = self.plan.clock0 + i as u64;
            let evicted = if self.plan.evicts[i] {
                self.spans.remove(self.n_anchor_spans)
            } else {
                None
            };
            if i >= self.plan.first_overwrite {
                let entry =
                    (self.journal_head + i - self.plan.first_overwrite) % self.journal_rows();
                self.journal_meta[entry] = JournalEntry { evicted };
            }
            if self.starts_span(self.plan.clock0, i, self.plan.new_span) {
                self.spans.push_back(SemanticSpan {
                    span_type: self.plan.span_type,
                    start_clock: c,
                    end_clock: c + 1,
                    start_slot: self.physical_slot(c),
                    slot_count: 1,
                });
                if c < n_sys {
                    self.n_anchor_spans += 1;
                }
            } else {
                let open = self
                    .spans
                    .back_mut()
                    .expect("check_spans guarantees an open span");
                open.end_clock += 1;
                open.slot_count += 1;
            }
        }
        let overwrites = self.plan.n - self.plan.first_overwrite;
        self.journal_head = (self.journal_head + overwrites) % self.journal_rows();
        self.journal_len = (self.journal_len + overwrites).min(self.cfg.undo_capacity);
        self.clock = self.plan.clock0 + self.plan.n as u64;
        self.plan.active = false;
        self.refresh_table();
        Ok(())
    }

    /// Drops the pending append, restoring every row already written. No-op when none.
    pub fn abort_append(&mut self) {
        if !self.plan.active {
            return;
        }
        for layer in 0..self.cfg.n_layers {
            if !self.plan.written[layer] {
                continue;
            }
            for i in 0..self.plan.n {
                let slot = self.physical_slot(self.plan.clock0 + i as u64);
                let entry = (i >= self.plan.first_overwrite).then(|| {
                    (self.journal_head + i - self.plan.first_overwrite) % self.journal_rows()
                });
                self.restore_row(layer, slot, entry);
            }
        }
        self.plan.active = false;
    }

    /// Puts back the content a slot had before an append wrote it: the journaled row, or
    /// zeros for a slot that had never been written.
    fn restore_row(&mut self, layer: usize, slot: u32, journal_entry: Option<usize>) {
        let row = self.row;
        let dst = self.row_offset(layer, slot);
        match journal_entry {
            Some(entry) => {
                let j = self.journal_offset(entry, layer);
                self.journal_keys.copy_to(j, &mut self.keys, dst, row);
                self.journal_vals.copy_to(j, &mut self.vals, dst, row);
            }
            None => {
                self.keys.zero(dst..dst + row);
                self.vals.zero(dst..dst + row);
            }
        }
    }

    // ----- whole-slab operations ---------------------------------------------------------

    /// Appends `n` positions from a volume-layout slab `(n_layers, kv_heads, n, head_dim)`
    /// (any `n`: it is split into chunks of ≤ `max_chunk`). All-or-nothing.
    pub fn append_slab(
        &mut self,
        n: usize,
        keys: &[f32],
        vals: &[f32],
        span: SpanType,
        new_span: bool,
    ) -> Result<(), RingError> {
        if self.plan.active {
            return Err(RingError::AppendPending);
        }
        let expected = self.cfg.n_layers * self.row * n;
        check_lengths(expected, keys.len(), vals.len())?;
        // With the whole append's span rules checked up front, the chunk steps cannot fail.
        self.check_spans(n, new_span)?;
        let mut offset = 0;
        while offset < n {
            let len = (n - offset).min(self.cfg.max_chunk);
            self.begin_append(len, span, new_span && offset == 0)?;
            for layer in 0..self.cfg.n_layers {
                self.write_rows(
                    layer,
                    RowSource::Slab {
                        keys,
                        vals,
                        total: n,
                        offset,
                        slab_layer: layer,
                    },
                );
            }
            self.commit_append()?;
            offset += len;
        }
        Ok(())
    }

    /// Writes a volume slab `(n_layers, kv_heads, n, head_dim)` into positions
    /// `[clock, clock + n)` as one new span, exactly as if those positions had been
    /// prefilled (anchors first, then window). Normally used on a fresh ring (clock 0).
    pub fn splice(
        &mut self,
        n: usize,
        keys: &[f32],
        vals: &[f32],
        span: SpanType,
    ) -> Result<(), RingError> {
        self.append_slab(n, keys, vals, span, true)
    }

    /// [`splice`](Self::splice) that first scans the slab and refuses one holding a NaN or
    /// infinity, reporting the first such logical position (the ring is left untouched).
    pub fn splice_checked(
        &mut self,
        n: usize,
        keys: &[f32],
        vals: &[f32],
        span: SpanType,
    ) -> Result<(), RingError> {
        check_lengths(self.cfg.n_layers * self.row * n, keys.len(), vals.len())?;
        if let Some(position) = first_non_finite_position(keys, vals, n, self.cfg.head_dim) {
            return Err(RingError::NonFinite { position });
        }
        self.splice(n, keys, vals, span)
    }

    /// Copies logical positions `[0, n)` of layers `[layer_lo, layer_hi)` (ring-relative) into
    /// `keys`/`vals` in the volume layout `(layers, kv_heads, n, head_dim)`, widened to f32.
    pub fn read_logical(
        &self,
        layer_lo: usize,
        layer_hi: usize,
        n: usize,
        keys: &mut [f32],
        vals: &mut [f32],
    ) -> Result<(), RingError> {
        self.read_logical_with(layer_lo, layer_hi, n, keys, vals, KvStore::get)
    }

    /// [`read_logical`](Self::read_logical) as f16 bit patterns: an f16 ring's values as they
    /// are stored (an f32 ring's rounded to f16).
    pub fn read_logical_bits(
        &self,
        layer_lo: usize,
        layer_hi: usize,
        n: usize,
        keys: &mut [u16],
        vals: &mut [u16],
    ) -> Result<(), RingError> {
        self.read_logical_with(layer_lo, layer_hi, n, keys, vals, KvStore::get_bits)
    }

    fn read_logical_with<T>(
        &self,
        layer_lo: usize,
        layer_hi: usize,
        n: usize,
        keys: &mut [T],
        vals: &mut [T],
        get: impl Fn(&KvStore, usize, &mut [T]),
    ) -> Result<(), RingError> {
        if self.plan.active {
            return Err(RingError::AppendPending);
        }
        if layer_lo >= layer_hi || layer_hi > self.cfg.n_layers {
            return Err(RingError::LayerOutOfRange {
                layer: layer_hi.max(layer_lo),
                n_layers: self.cfg.n_layers,
            });
        }
        if n as u64 > self.clock {
            return Err(RingError::PositionNotWritten {
                position: self.clock,
                clock: self.clock,
            });
        }
        let n_sys = self.cfg.n_sys as u64;
        // Slot of position p ≥ n_sys still holds p iff p + W ≥ clock.
        if n as u64 > n_sys && n_sys + (self.window_len as u64) < self.clock {
            let first_intact = self.clock - self.window_len as u64;
            if n_sys < first_intact {
                return Err(RingError::PositionOverwritten { position: n_sys });
            }
        }
        let expected = (layer_hi - layer_lo) * self.row * n;
        check_lengths(expected, keys.len(), vals.len())?;
        let head_dim = self.cfg.head_dim;
        for layer in layer_lo..layer_hi {
            for p in 0..n {
                let src = self.row_offset(layer, self.physical_slot(p as u64));
                for h in 0..self.cfg.kv_heads {
                    let dst = (((layer - layer_lo) * self.cfg.kv_heads + h) * n + p) * head_dim;
                    let s = src + h * head_dim;
                    get(&self.keys, s, &mut keys[dst..dst + head_dim]);
                    get(&self.vals, s, &mut vals[dst..dst + head_dim]);
                }
            }
        }
        Ok(())
    }

    // ----- rollback, pruning, recall -----------------------------------------------------

    /// Whether [`rollback_clock`](Self::rollback_clock)`(saved)` would be accepted (it
    /// changes nothing); the error says why not.
    pub fn check_rollback(&self, saved: u64) -> Result<(), RingError> {
        if self.plan.active {
            return Err(RingError::AppendPending);
        }
        if saved > self.clock {
            return Err(RingError::FutureClock {
                saved,
                clock: self.clock,
            });
        }
        let oldest = self.oldest_rollback_clock();
        if saved < oldest {
            return Err(RingError::RollbackTooFar { saved, oldest });
        }
        Ok(())
    }

    /// Undoes every position appended after `saved`: clock, spans, table and KV bytes are
    /// exactly as they were when the clock was `saved`.
    pub fn rollback_clock(&mut self, saved: u64) -> Result<(), RingError> {
        self.check_rollback(saved)?;
        let wrap = self.window_end as u64;
        let n_sys = self.cfg.n_sys as u64;
        while self.clock > saved {
            let c = self.clock - 1;
            let open = self
                .spans
                .back_mut()
                .expect("a visible position has a span");
            debug_assert_eq!(open.end_clock, c + 1);
            if open.start_clock == c {
                self.spans.pop_back();
                if c < n_sys {
                    self.n_anchor_spans -= 1;
                }
            } else {
                open.end_clock -= 1;
                open.slot_count -= 1;
            }
            let slot = self.physical_slot(c);
            let entry = if c >= wrap {
                let entry = (self.journal_head + self.journal_rows() - 1) % self.journal_rows();
                if let Some(evicted) = self.journal_meta[entry].evicted {
                    self.spans.insert(self.n_anchor_spans, evicted);
                }
                self.journal_head = entry;
                self.journal_len -= 1;
                Some(entry)
            } else {
                None
            };
            for layer in 0..self.cfg.n_layers {
                self.restore_row(layer, slot, entry);
            }
            self.clock = c;
        }
        self.refresh_table();
        Ok(())
    }

    /// Evicts the oldest whole window spans until at least `min_tokens` positions left the
    /// table (or the window is empty). Returns the positions evicted. Rollback cannot cross
    /// a prune that evicted something.
    pub fn prune_oldest_spans(&mut self, min_tokens: u64) -> Result<u64, RingError> {
        if self.plan.active {
            return Err(RingError::AppendPending);
        }
        let mut evicted = 0;
        while evicted < min_tokens && self.spans.len() > self.n_anchor_spans {
            let span = self
                .spans
                .remove(self.n_anchor_spans)
                .expect("checked non-empty");
            evicted += span.end_clock - span.start_clock;
        }
        if evicted > 0 {
            self.rollback_floor = self.clock;
            self.refresh_table();
        }
        Ok(evicted)
    }

    /// Adds `n` recall rows `(n_layers, kv_heads, n, head_dim)` (K and V, cached exactly as
    /// given) to tier 3 and the table. Overflowing the recall tier is an error.
    pub fn inject_recall(&mut self, n: usize, keys: &[f32], vals: &[f32]) -> Result<(), RingError> {
        if self.plan.active {
            return Err(RingError::AppendPending);
        }
        let free = self.cfg.recall - self.recall_count;
        if n > free {
            return Err(RingError::RecallOverflow { requested: n, free });
        }
        let expected = self.cfg.n_layers * self.row * n;
        check_lengths(expected, keys.len(), vals.len())?;
        let head_dim = self.cfg.head_dim;
        for layer in 0..self.cfg.n_layers {
            for r in 0..n {
                let slot = (self.window_end + self.recall_count + r) as u32;
                let dst = self.row_offset(layer, slot);
                for h in 0..self.cfg.kv_heads {
                    let src = ((layer * self.cfg.kv_heads + h) * n + r) * head_dim;
                    let d = dst + h * head_dim;
                    self.keys.put(d, &keys[src..src + head_dim]);
                    self.vals.put(d, &vals[src..src + head_dim]);
                }
            }
        }
        self.recall_count += n;
        self.refresh_table();
        Ok(())
    }

    /// Forgets every position, span and recall entry (clock 0), keeping the allocation, so a
    /// session can be reused without paying for fresh pages. Stale KV bytes stay in the
    /// slots but nothing references them: the table is empty. Drops a pending append.
    pub fn reset(&mut self) {
        self.plan.active = false;
        self.plan.n = 0;
        self.clock = 0;
        self.recall_count = 0;
        self.spans.clear();
        self.n_anchor_spans = 0;
        self.journal_head = 0;
        self.journal_len = 0;
        self.rollback_floor = 0;
        self.refresh_table();
    }

    /// Removes every recall entry from the table.
    pub fn clear_recall(&mut self) -> Result<(), RingError> {
        if self.plan.active {
            return Err(RingError::AppendPending);
        }
        self.recall_count = 0;
        self.refresh_table();
        Ok(())
    }
}

/// Both K and V buffers must hold exactly `expected` f32.
fn check_lengths(expected: usize, keys: usize, vals: usize) -> Result<(), RingError> {
    for (what, got) in [("keys", keys), ("vals", vals)] {
        if got != expected {
            return Err(RingError::ShapeMismatch {
                what,
                expected,
                got,
            });
        }
    }
    Ok(())
}

/// First logical position `p < n` of a volume slab `(layers, kv_heads, n, head_dim)` (K or V)
/// holding a non-finite value.
pub fn first_non_finite_position(
    keys: &[f32],
    vals: &[f32],
    n: usize,
    head_dim: usize,
) -> Option<usize> {
    let block = n * head_dim;
    if block == 0 {
        return None;
    }
    let mut first: Option<usize> = None;
    for slab in [keys, vals] {
        for layer_head in slab.chunks(block) {
            let limit = first.unwrap_or(n) * head_dim;
            if let Some(at) = layer_head[..limit.min(layer_head.len())]
                .iter()
                .position(|x| !x.is_finite())
            {
                first = Some(at / head_dim);
            }
        }
    }
    first
}

#[cfg(test)]
pub(crate) mod tests;
