//! Logits adjustments applied before the sampler's choice: OpenAI's presence and frequency
//! penalties, vLLM's repetition penalty, a logit bias, and `min_tokens` (the stop ids
//! masked until that many tokens were generated).
//!
//! Each is a function of the row and of the sequence's own tokens only (the prompt and what
//! it generated before the position sampled), so a sequence's tokens never depend on its
//! batch neighbours, and every backend computes the same bits. Every value at its neutral
//! setting leaves the row untouched: the sampler then skips this step altogether.

use std::collections::{HashMap, HashSet};

use super::sampling::SamplingError;

/// The most a logit bias may add or subtract (OpenAI's bound).
pub const MAX_LOGIT_BIAS: f32 = 100.0;
/// Presence and frequency penalties lie in `[-2, 2]` (OpenAI's bound).
pub const MAX_OPENAI_PENALTY: f32 = 2.0;
/// The repetition penalty lies in `[0.01, 100]` (vLLM takes any positive value; beyond
/// these it only saturates, and a row divided by less could overflow).
pub const MIN_REPETITION_PENALTY: f32 = 0.01;
/// See [`MIN_REPETITION_PENALTY`].
pub const MAX_REPETITION_PENALTY: f32 = 100.0;

/// How the raw logits are adjusted before a token is picked (neutral by default).
#[derive(Clone, Debug, PartialEq)]
pub struct LogitsAdjust {
    /// OpenAI's: subtracted once from the logit of every token generated at least once.
    pub presence_penalty: f32,
    /// OpenAI's: subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// vLLM's: the logit of every token seen in the prompt or generated is divided by it
    /// when positive, multiplied by it otherwise (1 = neutral).
    pub repetition_penalty: f32,
    /// Added to the logits of these ids (each in `[-100, 100]`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Until this many tokens are generated, `min_tokens_banned` cannot be picked.
    pub min_tokens: usize,
    /// The ids masked while fewer than `min_tokens` were generated (the stop ids: EOS and the
    /// request's stop token ids).
    pub min_tokens_banned: Vec<u32>,
}

impl Default for LogitsAdjust {
    fn default() -> Self {
        LogitsAdjust {
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            min_tokens_banned: Vec::new(),
        }
    }
}

impl LogitsAdjust {
    /// Whether every adjustment is at its neutral value (the row is left untouched).
    pub fn is_neutral(&self) -> bool {
        self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.repetition_penalty == 1.0
            && self.logit_bias.iter().all(|&(_, b)| b == 0.0)
            && (self.min_tokens == 0 || self.min_tokens_banned.is_empty())
    }

    /// Checks every value's domain (the ids against the vocabulary are checked where it is
    /// known: [`LogitsAdjust::check_vocab`]).
    pub fn validate(&self) -> Result<(), SamplingError> {
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(v.is_finite() && v.abs() <= MAX_OPENAI_PENALTY) {
                return Err(SamplingError(format!(
                    "{name} must be in [-{MAX_OPENAI_PENALTY}, {MAX_OPENAI_PENALTY}], got {v}"
                )));
            }
        }
        let r = self.repetition_penalty;
        if !(MIN_REPETITION_PENALTY..=MAX_REPETITION_PENALTY).contains(&r) {
            return Err(SamplingError(format!(
                "repetition_penalty must be in [{MIN_REPETITION_PENALTY}, \
                 {MAX_REPETITION_PENALTY}], got {r}"
            )));
        }
        let mut ids = HashSet::new();
        for &(id, b) in &self.logit_bias {
            if !(b.is_finite() && b.abs() <= MAX_LOGIT_BIAS) {
                return Err(SamplingError(format!(
                    "logit_bias of token {id} must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], \
                     got {b}"
                )));
            }
            if !ids.insert(id) {
                return Err(SamplingError(format!("logit_bias names token {id} twice")));
            }
        }
        Ok(())
    }

    /// Checks that every id named is in a `vocab`-token vocabulary.
    pub fn check_vocab(&self, vocab: usize) -> Result<(), SamplingError> {
        let ids = (self.logit_bias.iter().map(|&(id, _)| id))
            .chain(self.min_tokens_banned.iter().copied());
        for id in ids {
            if id as usize >= vocab {
                return Err(SamplingError(format!(
                    "token id {id} is outside the vocabulary of {vocab}"
                )));
            }
        }
        Ok(())
    }
}

/// A sequence's adjustment state: its tokens so far (the prompt, then each sampled token at
/// its position) and the counts the penalties need.
#[derive(Clone, Debug)]
pub(crate) struct AdjustState {
    params: LogitsAdjust,
    /// Tokens by position: the prompt, then the generated ones.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Ids in the prompt (repetition penalty).
    in_prompt: HashSet<u32>,
    /// Times each id was generated (presence, frequency and repetition penalties).
    generated: HashMap<u32, u32>,
    /// The adjusted row (reused).
    pub(crate) row: Vec<f32>,
}

impl AdjustState {
    pub(crate) fn new(params: LogitsAdjust) -> Self {
        AdjustState {
            params,
            tokens: Vec::new(),
            prompt_len: 0,
            in_prompt: HashSet::new(),
            generated: HashMap::new(),
            row: Vec::new(),
        }
    }

    /// Starts the sequence over at `prompt`.
    pub(crate) fn begin(&mut self, prompt: &[u32]) {
        self.tokens.clear();
        self.tokens.extend_from_slice(prompt);
        self.prompt_len = prompt.len();
        self.in_prompt = prompt.iter().copied().collect();
        self.generated.clear();
    }

    /// Forgets the tokens at positions `index..` (drafts a verification rejected, a step run
    /// again); refuses a position whose predecessors it has not seen.
    fn rewind(&mut self, index: u64) -> Result<(), SamplingError> {
        let index = index as usize;
        if index > self.tokens.len() || index < self.prompt_len {
            return Err(SamplingError(format!(
                "the penalties need the sequence's tokens before position {index}; the sampler \
                 holds {} (a {}-token prompt)",
                self.tokens.len(),
                self.prompt_len
            )));
        }
        for t in self.tokens.drain(index..) {
            if let Some(c) = self.generated.get_mut(&t) {
                *c -= 1;
                if *c == 0 {
                    self.generated.remove(&t);
                }
            }
        }
        Ok(())
    }

    /// Fills `self.row` with `logits` adjusted for position `index`, in vLLM's order: the
    /// bias, the `min_tokens` mask (−∞), the repetition penalty over the prompt's and the
    /// generated ids, then the frequency and presence penalties over the generated ids.
    /// Each id's value goes through the same operations whatever the others', so the row is
    /// a pure function of the logits and the sequence's tokens before `index`.
    pub(crate) fn apply(&mut self, logits: &[f32], index: u64) -> Result<(), SamplingError> {
        self.rewind(index)?;
        self.params.check_vocab(logits.len())?;
        let p = &self.params;
        let row = &mut self.row;
        row.clear();
        row.extend_from_slice(logits);
        for &(id, b) in &p.logit_bias {
            row[id as usize] += b;
        }
        if self.tokens.len() - self.prompt_len < p.min_tokens {
            for &id in &p.min_tokens_banned {
                row[id as usize] = f32::NEG_INFINITY;
            }
        }
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            let seen = (self.in_prompt.iter())
                .chain((self.generated.keys()).filter(|id| !self.in_prompt.contains(id)));
            for &id in seen {
                if let Some(l) = row.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&id, &count) in &self.generated {
                if let Some(l) = row.get_mut(id as usize) {
                    *l -= p.frequency_penalty * count as f32;
                    *l -= p.presence_penalty;
                }
            }
        }
        Ok(())
    }

    /// Sets the tokens at positions `start..` to `tokens` (what a step runs: a rebuilt
    /// sequence's emitted tokens, the last emitted token of a decode row).
    pub(crate) fn observe(&mut self, start: u64, tokens: &[u32]) -> Result<(), SamplingError> {
        self.rewind(start.max(self.prompt_len as u64))?;
        let skip = (self.prompt_len as u64).saturating_sub(start) as usize;
        for (i, &t) in tokens.iter().enumerate().skip(skip) {
            self.record(start + i as u64, t);
        }
        Ok(())
    }

    /// Records `token`, sampled for position `index` (after [`AdjustState::apply`]).
    pub(crate) fn record(&mut self, index: u64, token: u32) {
        debug_assert_eq!(index as usize, self.tokens.len());
        self.tokens.push(token);
        *self.generated.entry(token).or_insert(0) += 1;
    }
}
