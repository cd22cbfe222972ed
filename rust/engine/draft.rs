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

/// What a decode step costs as a function of its rows, learned from the steps an engine
/// runs: `t(rows) ≈ base + per_row · rows`, an exponentially weighted least-squares fit over
/// recent decode-only steps (prompt chunks have another cost per row and are left out).
///
/// It is what makes draft lengths fit the machine and the executor: in one process with the
/// `refined` kernels extra rows cost much (short drafts pay best), with `fast` kernels they
/// are nearly free up to a few rows, and over a mesh every hop adds a fixed cost that longer
/// drafts amortize. Draft lengths never change a token (verification is exact), only speed.
#[derive(Clone, Debug, Default)]
pub struct StepCost {
    weight: f64,
    sum_r: f64,
    sum_t: f64,
    sum_rr: f64,
    sum_rt: f64,
    fitted: Option<(f64, f64)>,
}

impl StepCost {
    /// Weight kept per observation: about the last 100 steps count.
    const DECAY: f64 = 0.99;

    /// Records a decode step of `rows` rows that took `seconds`.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        if !(seconds.is_finite() && seconds > 0.0) || rows == 0 {
            return;
        }
        let r = rows as f64;
        let d = Self::DECAY;
        self.weight = d * self.weight + 1.0;
        self.sum_r = d * self.sum_r + r;
        self.sum_t = d * self.sum_t + seconds;
        self.sum_rr = d * self.sum_rr + r * r;
        self.sum_rt = d * self.sum_rt + r * seconds;
        let mean_r = self.sum_r / self.weight;
        let var_r = self.sum_rr / self.weight - mean_r * mean_r;
        // Refit only while the row counts vary enough to tell base from slope; otherwise the
        // last fit stands.
        if self.weight >= 8.0 && var_r >= 0.5 {
            let mean_t = self.sum_t / self.weight;
            let cov = self.sum_rt / self.weight - mean_r * mean_t;
            let per_row = (cov / var_r).max(0.0);
            let base = (mean_t - per_row * mean_r).max(0.05 * mean_t);
            self.fitted = Some((base, per_row));
        }
    }

    /// `(base, per_row)` seconds, once fitted.
    pub fn model(&self) -> Option<(f64, f64)> {
        self.fitted
    }
}

/// Per-sequence speculation state: how long the next draft may be, and whether drafting is
/// paused because recent drafts were mostly rejected.
///
/// With a fitted [`StepCost`] the length maximises the expected tokens per second of the
/// step: with a per-token acceptance probability `a` (estimated from this sequence's
/// verifications), a draft of `k` yields `(1 − a^(k+1)) / (1 − a)` tokens in a step of
/// `k + 1` rows. Before the cost is known, growth and shrinkage follow the last verification
/// (double after a fully accepted draft, fall back to one more than was accepted otherwise).
///
/// Drafting pauses for a number of steps that doubles each time (up to
/// [`DraftController::MAX_PAUSE`]) when it does not pay, so free-form text pays for only the
/// occasional probe. With a fitted cost, "does not pay" means that even the best draft length
/// is expected to emit tokens no faster than plain decoding: over a mesh, where every step
/// pays the hops and a row costs little, drafts with a third of their tokens accepted still
/// pay, while in one process with dear rows they do not. Before the cost is known, a running
/// acceptance rate below [`DraftController::LOW_ACCEPTANCE`] pauses.
#[derive(Debug)]
pub struct DraftController {
    proposer: Box<dyn Proposer>,
    draft_max: usize,
    next_len: usize,
    acceptance: f64,
    verifies: usize,
    paused_for: usize,
    pause: usize,
    /// Decayed counts of accepted draft tokens and of rejections (at most one per verify):
    /// the per-token acceptance probability is `accepted / (accepted + rejected)`.
    accepted_tokens: f64,
    rejections: f64,
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
            accepted_tokens: 1.0,
            rejections: 1.0,
        }
    }

    /// Drafts for the next step (at most `limit` tokens): empty while paused or when the
    /// proposer has nothing. With `cost`, the length is the one the step cost favours.
    pub fn draft(
        &mut self,
        context: &[u32],
        limit: usize,
        cost: Option<&StepCost>,
        out: &mut Vec<u32>,
    ) {
        out.clear();
        if self.paused_for > 0 {
            self.paused_for -= 1;
            return;
        }
        let len = match cost.and_then(StepCost::model) {
            Some((base, per_row)) => self.best(base, per_row).0,
            None => self.next_len,
        };
        let max = len.min(limit);
        if max > 0 {
            self.proposer.propose(context, max, out);
        }
    }

    /// The per-token acceptance probability estimated from recent verifications.
    fn token_acceptance(&self) -> f64 {
        (self.accepted_tokens / (self.accepted_tokens + self.rejections)).min(0.99)
    }

    /// The draft length (1 to `draft_max`) with the most expected tokens per second, and
    /// that rate.
    fn best(&self, base: f64, per_row: f64) -> (usize, f64) {
        let a = self.token_acceptance();
        let mut best = (1, 0.0);
        let mut reach = 1.0; // a^k: the chance that all of the first k drafts are accepted
        let mut expected = 1.0; // tokens a step with a draft of k yields: Σ_{j≤k} a^j
        for k in 1..=self.draft_max {
            reach *= a;
            expected += reach;
            let rate = expected / (base + per_row * (k + 1) as f64);
            if rate > best.1 {
                best = (k, rate);
            }
        }
        best
    }

    /// Learns from a verification: `accepted` of `proposed` drafts were accepted. `cost`
    /// decides whether drafting still pays (see the type's docs).
    pub fn observe(&mut self, proposed: usize, accepted: usize, cost: Option<&StepCost>) {
        if proposed == 0 {
            return;
        }
        self.verifies += 1;
        self.accepted_tokens = 0.9 * self.accepted_tokens + accepted as f64;
        self.rejections = 0.9 * self.rejections + f64::from(u8::from(accepted < proposed));
        let rate = accepted as f64 / proposed as f64;
        self.acceptance = 0.7 * self.acceptance + 0.3 * rate;
        self.next_len = if accepted == proposed {
            (self.next_len * 2).min(self.draft_max)
        } else {
            (accepted + 1).min(self.draft_max)
        };
        let model = cost.and_then(StepCost::model);
        let pays = match model {
            Some((base, per_row)) => self.best(base, per_row).1 > 1.0 / (base + per_row),
            None => self.acceptance >= Self::LOW_ACCEPTANCE,
        };
        if self.verifies >= 3 && !pays {
            self.paused_for = self.pause;
            self.pause = (self.pause * 2).min(Self::MAX_PAUSE);
            // Start the next probe from neutral rates, with a short draft.
            self.acceptance = 0.5;
            self.accepted_tokens = 1.0;
            self.rejections = 1.0;
            self.verifies = 0;
            self.next_len = 1;
        } else if match model {
            Some(_) => self.token_acceptance() >= 0.5,
            None => self.acceptance >= 0.6,
        } {
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
        c.draft(&ctx, 8, None, &mut out);
        assert_eq!(out, [2, 3, 4, 5], "starts at 4 tokens");
        c.observe(4, 4, None);
        c.draft(&ctx, 8, None, &mut out);
        assert_eq!(out.len(), 6, "grown to 8, capped by the context");
        c.draft(&ctx, 3, None, &mut out);
        assert_eq!(out.len(), 3, "capped by the caller's limit");
        for _ in 0..3 {
            c.observe(4, 0, None);
        }
        c.draft(&ctx, 8, None, &mut out);
        assert!(out.is_empty(), "paused after repeated rejections");
        for _ in 0..DraftController::FIRST_PAUSE {
            c.draft(&ctx, 8, None, &mut out);
        }
        assert_eq!(out.len(), 1, "probes again with a one-token draft");
    }

    #[test]
    fn the_step_cost_fit_recovers_base_and_slope_and_sizes_drafts_by_it() {
        let mut cost = StepCost::default();
        assert!(cost.model().is_none());
        for i in 0..40 {
            let rows = 1 + i % 8;
            cost.observe(rows, 0.002 + 0.0005 * rows as f64);
        }
        let (base, per_row) = cost.model().expect("fitted");
        assert!((base - 0.002).abs() < 1e-9 && (per_row - 0.0005).abs() < 1e-9);
        // The same rows every step cannot tell base from slope: no fit.
        let mut flat = StepCost::default();
        for _ in 0..200 {
            flat.observe(4, 0.01);
        }
        assert_eq!(flat.model(), None);

        let ctx: Vec<u32> = (0..40).chain(0..40).collect();
        let mut c = DraftController::with_proposer(Box::new(PromptLookup::new(2, 2)), 8);
        for _ in 0..20 {
            c.observe(4, 4, None); // always accepted: a → 0.99
        }
        let mut out = Vec::new();
        // Rows nearly free (a fixed hop cost dominates): the longest draft.
        let hop = StepCost {
            fitted: Some((0.010, 0.0001)),
            ..StepCost::default()
        };
        c.draft(&ctx, 8, Some(&hop), &mut out);
        assert_eq!(out.len(), 8);
        // Rows as dear as the step itself, and drafts often rejected: the shortest.
        for _ in 0..20 {
            c.observe(4, 0, None);
            c.paused_for = 0;
            c.verifies = 0; // keep drafting for the test
        }
        let dear = StepCost {
            fitted: Some((0.001, 0.001)),
            ..StepCost::default()
        };
        c.draft(&ctx, 8, Some(&dear), &mut out);
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn drafting_pauses_only_where_it_does_not_pay() {
        let ctx: Vec<u32> = (0..40).chain(0..40).collect();
        let fitted = |base: f64, per_row: f64| StepCost {
            fitted: Some((base, per_row)),
            ..StepCost::default()
        };
        // A hop-dominated step (a mesh): one accepted token in four still pays.
        let hop = fitted(0.010, 0.0002);
        // Rows dearer than the rest of the step (compute-bound): the same does not.
        let dear = fitted(0.0005, 0.001);
        for (cost, pauses) in [(&hop, false), (&dear, true)] {
            let mut c = DraftController::with_proposer(Box::new(PromptLookup::new(2, 2)), 8);
            for _ in 0..4 {
                c.observe(4, 1, Some(cost));
            }
            let mut out = Vec::new();
            c.draft(&ctx, 8, Some(cost), &mut out);
            assert_eq!(out.is_empty(), pauses, "cost {:?}", cost.model());
        }
        // Without a cost, the running acceptance rate decides: a quarter, from the neutral
        // start, falls below the threshold on the fifth verification.
        let mut c = DraftController::with_proposer(Box::new(PromptLookup::new(2, 2)), 8);
        for _ in 0..5 {
            c.observe(4, 1, None);
        }
        let mut out = Vec::new();
        c.draft(&ctx, 8, None, &mut out);
        assert!(out.is_empty());
    }
}
