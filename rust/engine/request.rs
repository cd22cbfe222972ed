//! What a caller submits and what the engine reports back.

use super::draft::DraftConfig;
use crate::grammar::Grammar;
use crate::model::{SamplingParams, TokenLogprobs};

/// A sequence's id, unique within one engine.
pub type SeqId = u64;

/// One generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// How tokens are picked.
    pub sampling: SamplingParams,
    /// Generation stops after any of these ids (it is emitted).
    pub stop_ids: Vec<u32>,
    /// Tenant salt of the volume-cache key (one tenant never hits another's prefixes).
    pub salt: Option<String>,
    /// Consult and fill the volume cache for this request.
    pub use_cache: bool,
    /// Speculative decoding, when set.
    pub draft: Option<DraftConfig>,
    /// Report the logits row of every emitted token (parity and bit-exactness checks).
    pub want_logits: bool,
    /// Report every emitted token's log-probability and this many most likely alternatives
    /// (at most [`crate::model::MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<usize>,
    /// Report every prompt token's log-probability given the tokens before it, with this
    /// many alternatives (at most [`crate::model::MAX_TOP_LOGPROBS`]), as one
    /// [`Event::Prompt`]. The whole prompt is then computed: its logits rows are not in the
    /// volume cache, so it is not replayed (what it captures is unchanged).
    pub prompt_logprobs: Option<usize>,
    /// Constrained decoding: every token is sampled under this grammar's mask, and the
    /// sequence finishes ([`FinishReason::Stop`]) once the grammar is complete.
    pub grammar: Option<Grammar>,
}

impl Request {
    /// A greedy request with the cache on and no speculation.
    pub fn greedy(prompt: Vec<u32>, max_new_tokens: usize) -> Request {
        Request {
            prompt,
            max_new_tokens,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            salt: None,
            use_cache: true,
            draft: None,
            want_logits: false,
            logprobs: None,
            prompt_logprobs: None,
            grammar: None,
        }
    }
}

/// Why a sequence finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id was generated, or the request's grammar is complete.
    Stop,
    /// `max_new_tokens` were generated.
    Length,
    /// The caller cancelled it (e.g. its client disconnected).
    Cancelled,
    /// The executor failed while running it; no token after the failure was emitted.
    Error(String),
}

impl FinishReason {
    /// `"stop"`, `"length"`, `"cancelled"` or `"error"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error(_) => "error",
        }
    }
}

/// Per-sequence figures, reported when it finishes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SeqStats {
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Tokens emitted.
    pub output_tokens: usize,
    /// Prompt positions served from a replayed volume (exact or longest-prefix).
    pub cached_tokens: usize,
    /// The whole prompt came from the cache (no prefill at all).
    pub cache_hit: bool,
    /// From submission to admission.
    pub queue_ms: f64,
    /// From admission to the first token (replay and prefill).
    pub prefill_ms: f64,
    /// From the first token to the end.
    pub decode_ms: f64,
    /// Drafted tokens proposed for verification.
    pub draft_proposed: usize,
    /// Drafted tokens the model accepted.
    pub draft_accepted: usize,
    /// Verification steps run (decode steps that carried drafts).
    pub verify_steps: usize,
}

/// What a step reports.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Sequence `seq` emitted `token` as its `index`-th output (0-based).
    Token {
        /// The sequence.
        seq: SeqId,
        /// The token id.
        token: u32,
        /// Its 0-based index among the sequence's outputs.
        index: usize,
        /// The logits row it was picked from, when the request asked for them.
        logits: Option<Vec<f32>>,
        /// Its log-probability and the likeliest alternatives, when the request asked.
        logprobs: Option<TokenLogprobs>,
    },
    /// The prompt of sequence `seq` is computed: the log-probabilities of its tokens after
    /// the first (the first has nothing before it), in order, when the request asked. Comes
    /// before the sequence's first token.
    Prompt {
        /// The sequence.
        seq: SeqId,
        /// One entry per prompt token after the first.
        logprobs: Vec<TokenLogprobs>,
    },
    /// Sequence `seq` finished; its resources are released.
    Finished {
        /// The sequence.
        seq: SeqId,
        /// Why.
        reason: FinishReason,
        /// Its figures.
        stats: SeqStats,
    },
}
