//! Drafting for speculative decoding: the [`Proposer`] interface, prompt lookup, and the
//! controller that sizes drafts and turns speculation off when it does not pay.
//!
//! A decode step reads every weight however many rows it scores, so verifying a few drafted
//! tokens costs little more than decoding one while the step stays bandwidth-bound. Prompt
//! lookup drafts by n-gram matching over the prompt and the text generated so far: when the
//! last few tokens occurred before, it proposes what followed them then (copy-heavy work —
//! editing code, quoting a passage — repeats long runs).

/// Proposes draft tokens to be verified by the target model. Implemented by prompt lookup;
/// a small draft model could implement it too.
pub trait Proposer: Send {
    /// Appends up to `max` tokens likely to follow `context` (prompt + generated tokens) to
    /// `out`. Proposing nothing is always allowed: the step is then a plain decode step.
    fn propose(&mut self, context: &[u32], max: usize, out: &mut Vec<u32>);
}

/// Speculative decoding settings of one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraftConfig {
    /// Longest draft verified in one step (default 8).
    pub draft_max: usize,
    /// Longest n-gram matched (default 4).
    pub ngram_max: usize,
    /// Shortest n-gram matched (default 2; 1 proposes on too many chance matches).
    pub ngram_min: usize,
}

impl Default for DraftConfig {
    fn default() -> Self {
        DraftConfig {
            draft_max: 8,
            ngram_max: 4,
            ngram_min: 2,
        }
    }
}

impl DraftConfig {
    /// Checks the bounds.
    pub fn validate(&self) -> Result<(), String> {
        if self.draft_max == 0 || self.draft_max > 64 {
            return Err(format!(
                "draft_max must be in 1..=64, got {}",
                self.draft_max
            ));
        }
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max {
            return Err(format!(
                "n-gram bounds must satisfy 1 <= min <= max, got {}..={}",
                self.ngram_min, self.ngram_max
            ));
        }
        Ok(())
    }
}

/// Prompt lookup: the continuation of the most recent earlier occurrence of the context's
/// last n tokens, longest n first.
#[derive(Clone, Debug)]
pub struct PromptLookup {
    ngram_min: usize,
    ngram_max: usize,
}

impl PromptLookup {
    /// Matches n-grams of `ngram_min..=ngram_max` tokens.
    pub fn new(ngram_min: usize, ngram_max: usize) -> PromptLookup {
        PromptLookup {
            ngram_min: ngram_min.max(1),
            ngram_max: ngram_max.max(ngram_min.max(1)),
        }
    }
}

impl Proposer for PromptLookup {
    fn propose(&mut self, context: &[u32], max: usize, out: &mut Vec<u32>) {
        let len = context.len();
        if max == 0 {
            return;
        }
        for n in (self.ngram_min..=self.ngram_max).rev() {
            if len <= n {
                continue;
            }
            let pattern = &context[len - n..];
            // Most recent earlier occurrence: the text being copied is usually the nearest.
            if let Some(at) = (0..len - n).rev().find(|&i| &context[i..i + n] == pattern) {
                let from = at + n;
                let to = (from + max).min(len);
                out.extend_from_slice(&context[from..to]);
                return;
            }
        }
    }
}

/// Per-sequence speculation state: how long the next draft may be, and whether drafting is
/// paused because recent drafts were mostly rejected.
///
/// Growth and shrinkage follow the last verification (double after a fully accepted draft,
/// fall back to one more than was accepted otherwise). A running acceptance rate below
/// [`DraftController::LOW_ACCEPTANCE`] pauses drafting for a number of steps that doubles
/// each time (up to [`DraftController::MAX_PAUSE`]), so free-form text pays for only the
/// occasional probe.
#[derive(Debug)]
pub struct DraftController {
    proposer: Box<dyn Proposer>,
    draft_max: usize,
    next_len: usize,
    acceptance: f64,
    verifies: usize,
    paused_for: usize,
    pause: usize,
}

impl std::fmt::Debug for dyn Proposer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Proposer")
    }
}

impl DraftController {
    /// Below this running acceptance rate, drafting pauses.
    pub const LOW_ACCEPTANCE: f64 = 0.3;
    /// Longest pause, in decode steps.
    pub const MAX_PAUSE: usize = 256;
    const FIRST_PAUSE: usize = 8;

    /// A controller for `cfg` (prompt lookup).
    pub fn new(cfg: &DraftConfig) -> DraftController {
        DraftController::with_proposer(
            Box::new(PromptLookup::new(cfg.ngram_min, cfg.ngram_max)),
            cfg.draft_max,
        )
    }

    /// A controller around any proposer.
    pub fn with_proposer(proposer: Box<dyn Proposer>, draft_max: usize) -> DraftController {
        DraftController {
            proposer,
            draft_max: draft_max.max(1),
            next_len: draft_max.clamp(1, 4),
            acceptance: 0.5,
            verifies: 0,
            paused_for: 0,
            pause: Self::FIRST_PAUSE,
        }
    }

    /// Drafts for the next step (at most `limit` tokens): empty while paused or when the
    /// proposer has nothing.
    pub fn draft(&mut self, context: &[u32], limit: usize, out: &mut Vec<u32>) {
        out.clear();
        if self.paused_for > 0 {
            self.paused_for -= 1;
            return;
        }
        let max = self.next_len.min(limit);
        if max > 0 {
            self.proposer.propose(context, max, out);
        }
    }

    /// Learns from a verification: `accepted` of `proposed` drafts were accepted.
    pub fn observe(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.verifies += 1;
        let rate = accepted as f64 / proposed as f64;
        self.acceptance = 0.7 * self.acceptance + 0.3 * rate;
        self.next_len = if accepted == proposed {
            (self.next_len * 2).min(self.draft_max)
        } else {
            (accepted + 1).min(self.draft_max)
        };
        if self.verifies >= 3 && self.acceptance < Self::LOW_ACCEPTANCE {
            self.paused_for = self.pause;
            self.pause = (self.pause * 2).min(Self::MAX_PAUSE);
            // Start the next probe from a neutral rate, with a short draft.
            self.acceptance = 0.5;
            self.verifies = 0;
            self.next_len = 1;
        } else if self.acceptance >= 0.6 {
            self.pause = Self::FIRST_PAUSE;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_proposes_what_followed_the_latest_match() {
        let mut p = PromptLookup::new(2, 3);
        let ctx = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3];
        let mut out = Vec::new();
        p.propose(&ctx, 4, &mut out);
        // Trigram [1,2,3] occurred at 0 → proposes [4, 5, 9, 2].
        assert_eq!(out, [4, 5, 9, 2]);
        out.clear();
        p.propose(&[5, 6, 7, 8], 4, &mut out);
        assert!(out.is_empty(), "no earlier occurrence: nothing");
        out.clear();
        // Bigram [2, 3] most recently at 6 → [7, 8, 1]; capped by the context's end.
        p.propose(&[2, 3, 7, 8, 1, 2, 3], 8, &mut out);
        assert_eq!(out, [7, 8, 1, 2, 3]);
    }

    #[test]
    fn the_controller_pauses_on_rejections_and_grows_on_acceptance() {
        let mut c = DraftController::with_proposer(Box::new(PromptLookup::new(1, 1)), 8);
        let ctx = [1, 2, 3, 4, 5, 6, 1];
        let mut out = Vec::new();
        c.draft(&ctx, 8, &mut out);
        assert_eq!(out, [2, 3, 4, 5], "starts at 4 tokens");
        c.observe(4, 4);
        c.draft(&ctx, 8, &mut out);
        assert_eq!(out.len(), 6, "grown to 8, capped by the context");
        c.draft(&ctx, 3, &mut out);
        assert_eq!(out.len(), 3, "capped by the caller's limit");
        for _ in 0..3 {
            c.observe(4, 0);
        }
        c.draft(&ctx, 8, &mut out);
        assert!(out.is_empty(), "paused after repeated rejections");
        for _ in 0..DraftController::FIRST_PAUSE {
            c.draft(&ctx, 8, &mut out);
        }
        assert_eq!(out.len(), 1, "probes again with a one-token draft");
    }
}
