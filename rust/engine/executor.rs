//! The executor interface: what the engine asks of whatever runs the model.

use super::request::SeqId;
use super::EngineError;
use crate::grammar::Grammar;
use crate::model::{SamplingParams, TokenLogprobs};

/// A new sequence to prepare: the executor consults the volume cache (exact, then longest
/// prefix) and replays what it finds into the sequence's fresh KV.
#[derive(Clone, Debug, PartialEq)]
pub struct Admission {
    /// The sequence.
    pub seq: SeqId,
    /// Its prompt.
    pub prompt: Vec<u32>,
    /// How its tokens are picked (the executor samples where the logits are).
    pub sampling: SamplingParams,
    /// Tenant salt of its cache keys.
    pub salt: Option<String>,
    /// Whether to consult and fill the volume cache.
    pub use_cache: bool,
    /// On an exact hit, sample the first token from the cached logits (false when the request
    /// wants no tokens at all).
    pub sample_first: bool,
    /// Report logits rows of emitted tokens.
    pub want_logits: bool,
    /// Report emitted tokens' log-probabilities with this many alternatives.
    pub logprobs: Option<usize>,
    /// Report the prompt tokens' log-probabilities with this many alternatives: the executor
    /// then replays nothing (the cache keeps no logits rows of a prompt's inner positions)
    /// and computes every prompt row's logits.
    pub prompt_logprobs: Option<usize>,
    /// The grammar its tokens are sampled under (the executor keeps its state where it
    /// samples, the cached first token included).
    pub grammar: Option<Grammar>,
}

/// What admission found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Admitted {
    /// Prompt positions now in the sequence's KV (replayed); prefill resumes there.
    pub cached_tokens: usize,
    /// On an exact hit: the first token, sampled from the cached logits (no model run).
    pub first_token: Option<u32>,
    /// Its logits row, when asked for.
    pub first_logits: Option<Vec<f32>>,
    /// Its log-probabilities, when asked for.
    pub first_logprobs: Option<TokenLogprobs>,
    /// The sequence's grammar is complete after the first token.
    pub done: bool,
}

/// What a batch entry's rows are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// A chunk of the prompt. `last`: it ends the prompt, so the executor captures the
    /// prompt's volume (when caching) and, if `emit`, samples the first token.
    Prefill {
        /// The chunk ends the prompt.
        last: bool,
        /// Sample a token from the last row.
        emit: bool,
    },
    /// `tokens[0]` is the last emitted token; `tokens[1..]` are drafts to verify. Emits 1 to
    /// `tokens.len()` tokens.
    Decode,
}

/// One sequence's rows in a step.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchEntry {
    /// The sequence.
    pub seq: SeqId,
    /// Position of `tokens[0]`. The executor first drops any KV at or after it (positions
    /// of drafts the previous step rejected).
    pub start: usize,
    /// The rows' token ids.
    pub tokens: Vec<u32>,
    /// What they are.
    pub kind: EntryKind,
}

/// What running one entry gave.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EntryOutcome {
    /// Emitted tokens, in order (empty for a prefill chunk that does not end the prompt).
    pub emitted: Vec<u32>,
    /// The logits row of each emitted token, concatenated (only when asked for).
    pub logits: Option<Vec<f32>>,
    /// The log-probabilities of each emitted token, in order (only when asked for).
    pub logprobs: Vec<TokenLogprobs>,
    /// For a prefill chunk of a sequence that asked for prompt log-probabilities: those of
    /// the prompt tokens its rows predict (each row's next token, when it is in the prompt).
    pub prompt_logprobs: Vec<TokenLogprobs>,
    /// The sequence's grammar is complete after the emitted tokens: it finishes there.
    pub done: bool,
    /// This entry failed alone (its grammar could not go on): the sequence finishes with
    /// this error after the emitted tokens, the rest of the batch goes on.
    pub error: Option<String>,
}

/// Runs what the engine plans. A failed `run` fails every sequence of that batch.
pub trait Executor {
    /// Prepares the KV of new sequences (one result per admission, in order).
    fn admit(&mut self, admissions: &[Admission]) -> Vec<Result<Admitted, EngineError>>;

    /// Runs one batch: every entry's rows in one step. One outcome per entry, in order.
    fn run(&mut self, batch: &[BatchEntry]) -> Result<Vec<EntryOutcome>, EngineError>;

    /// Frees a finished or cancelled sequence's KV.
    fn release(&mut self, seq: SeqId);
}
