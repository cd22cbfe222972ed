//! Token sampling: greedy, temperature, top-k, top-p, with a seeded generator.
//!
//! The sampler is the single source of truth for every process: the single-process runtime
//! and the mesh coordinator both call it, so the same seed gives the same tokens everywhere.

use std::cmp::Ordering;
use std::fmt;

use super::adjust::{AdjustState, LogitsAdjust};

/// How to pick the next token.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Always take the argmax (ties go to the lowest id). Other fields are then ignored.
    pub greedy: bool,
    /// Softmax temperature (> 0) when not greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1.0 = no limit).
    pub top_p: f32,
    /// Seed of the generator.
    pub seed: u64,
    /// Penalties, bias and `min_tokens`, applied to the logits before the choice (greedy
    /// or sampled); neutral by default.
    pub adjust: LogitsAdjust,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            greedy: true,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            adjust: LogitsAdjust::default(),
        }
    }
}

/// A sampling parameter outside its domain.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingError(pub String);

impl fmt::Display for SamplingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SamplingError {}

impl SamplingParams {
    /// Checks every parameter.
    pub fn validate(&self) -> Result<(), SamplingError> {
        self.adjust.validate()?;
        if self.greedy {
            return Ok(());
        }
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(SamplingError(format!(
                "temperature must be a positive number, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, and identical on every platform.
#[derive(Clone, Debug)]
struct Rng {
    s: [u64; 4],
}

impl Rng {
    fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Which independent random stream a draw comes from (see [`Sampler`]): one, the sampling of
/// a position (speculative verification reuses it, see [`Sampler::verify`]).
#[derive(Clone, Copy)]
enum Stream {
    /// Plain sampling of a position.
    Sample = 1,
}

/// One uniform draw in [0, 1) for `(seed, index, stream)`: a pure function, so a sequence's
/// tokens do not depend on where or in which batch each position was sampled (one process, a
/// mesh's exit station, a replica after failover).
fn draw(seed: u64, index: u64, stream: Stream) -> f64 {
    let key = seed
        ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17)
        ^ (stream as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
    Rng::new(key).next_f64()
}

/// A sampler: greedy, or temperature with top-k / top-p, seeded.
///
/// Sampling is a pure function of `(logits, parameters, seed, index)`, where `index` is the
/// position the sampled token will occupy in the sequence (prompt length + tokens generated
/// before it). There is no generator state to carry between steps, so the same seed gives
/// the same tokens in every process, batch and step order.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    /// Reused candidate buffer (no allocation per token after the first).
    candidates: Vec<(u32, f32)>,
    weights: Vec<f64>,
    /// A masked copy of the row being sampled ([`Sampler::sample_masked`]).
    masked: Vec<f32>,
    /// The sequence's tokens and adjusted row, when an adjustment is not neutral.
    adjust: Option<AdjustState>,
}

impl Sampler {
    /// A sampler for `params` (validated).
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        let adjust = (!params.adjust.is_neutral()).then(|| AdjustState::new(params.adjust.clone()));
        Ok(Sampler {
            params,
            candidates: Vec::new(),
            weights: Vec::new(),
            masked: Vec::new(),
            adjust,
        })
    }

    /// Starts a sequence at `prompt`: the penalties count from it (the repetition penalty
    /// covers it). Needed before the first draw when an adjustment is set; the sampler then
    /// records each token it picks, and a draw for a position `i` sees the tokens before
    /// `i` (drafts a verification rejected are forgotten).
    pub fn begin(&mut self, prompt: &[u32]) {
        if let Some(a) = self.adjust.as_mut() {
            a.begin(prompt);
        }
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Tells the sampler the sequence's tokens at positions `start..` (a step's rows): a
    /// sampler that joins a sequence midway (a station rebuilt after a failover) learns the
    /// tokens its penalties count. Positions inside the prompt are ignored.
    pub fn observe(&mut self, start: u64, tokens: &[u32]) -> Result<(), SamplingError> {
        match self.adjust.as_mut() {
            Some(a) => a.observe(start, tokens),
            None => Ok(()),
        }
    }

    /// Picks the token for position `index` from raw logits. Non-finite logits are an error.
    pub fn sample(&mut self, logits: &[f32], index: u64) -> Result<u32, SamplingError> {
        check_logits(logits)?;
        self.sample_adjusted(logits, None, index)
    }

    /// Picks the token for position `index` among the `allowed` ones: exactly what
    /// [`Sampler::sample`] picks from the row in which every other token's logit is −∞
    /// (weight 0), the one sampling rule with a constraint's mask (SPEC §16). `allowed` is a
    /// bit set, bit `i % 32` of word `i / 32` for token `i`; tokens past it are not allowed.
    /// The adjustments (penalties, bias, `min_tokens`) apply first, then the mask. An error
    /// when the raw logits are not finite or no token of the row is allowed.
    pub fn sample_masked(
        &mut self,
        logits: &[f32],
        allowed: &[u32],
        index: u64,
    ) -> Result<u32, SamplingError> {
        check_logits(logits)?;
        self.sample_adjusted(logits, Some(allowed), index)
    }

    /// The adjusted row (when an adjustment is set), masked (when `allowed` is given), then
    /// the choice; the sampler records the token for its penalties.
    fn sample_adjusted(
        &mut self,
        logits: &[f32],
        allowed: Option<&[u32]>,
        index: u64,
    ) -> Result<u32, SamplingError> {
        let mut adjust = self.adjust.take();
        let token = match adjust.as_mut() {
            None => self.choose_within(logits, allowed, index),
            Some(a) => a.apply(logits, index).and_then(|()| {
                let row = std::mem::take(&mut a.row);
                let token = self.choose_within(&row, allowed, index);
                a.row = row;
                if let Ok(t) = token {
                    a.record(index, t);
                }
                token
            }),
        };
        self.adjust = adjust;
        token
    }

    /// [`Sampler::choose`] on `row`, or on its copy with every token outside `allowed` at −∞.
    fn choose_within(
        &mut self,
        row: &[f32],
        allowed: Option<&[u32]>,
        index: u64,
    ) -> Result<u32, SamplingError> {
        let Some(allowed) = allowed else {
            return Ok(self.choose(row, index));
        };
        if self.params.greedy {
            // The row's first maximum, when allowed, is the masked row's first maximum: the
            // usual case under a grammar, without copying the row.
            let best = argmax(row);
            let bit = allowed
                .get(best as usize / 32)
                .is_some_and(|w| w >> (best % 32) & 1 == 1);
            if bit && row[best as usize] > f32::NEG_INFINITY {
                return Ok(best);
            }
        }
        let mut masked = std::mem::take(&mut self.masked);
        masked.clear();
        masked.resize(row.len(), f32::NEG_INFINITY);
        let mut any = false;
        for (w, &bits) in allowed.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                let i = w * 32 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if i < row.len() {
                    masked[i] = row[i];
                    // A token the adjustments excluded (min_tokens) is not a choice.
                    any |= row[i] > f32::NEG_INFINITY;
                }
            }
        }
        let token = any.then(|| self.choose(&masked, index));
        self.masked = masked;
        token.ok_or_else(|| SamplingError("the constraint allows no token of the row".into()))
    }

    /// The choice from a checked (and adjusted, or masked) row: finite values, or −∞ for
    /// excluded tokens with at least one finite value. The argmax, or the seeded draw.
    fn choose(&mut self, logits: &[f32], index: u64) -> u32 {
        if self.params.greedy {
            return argmax(logits);
        }
        let kept_total = self.distribution(logits);
        let target = draw(self.params.seed, index, Stream::Sample) * kept_total;
        self.pick(target)
    }

    /// Speculative verification of `drafts`, proposed for positions `first_index..`, against
    /// `rows` (`drafts.len() + 1` rows of `vocab` logits: row `j` scores position
    /// `first_index + j`). Appends the emitted tokens to `out`: the accepted drafts, then one
    /// token from the model (the correction at the first rejection, or the bonus token after
    /// the last draft) — between 1 and `drafts.len() + 1` tokens.
    ///
    /// A draft is accepted exactly when it is the token plain decoding would emit at its
    /// position: the argmax (greedy), or [`Sampler::sample`]'s draw for that position. So the
    /// emitted tokens are those of plain decoding, greedy or seeded, whatever the drafts.
    /// Sampled, this is the exact rule for a deterministic draft, realised by coupling it
    /// with the plain draw `y ~ p`: draft `x` is accepted with probability `P(y = x) = p(x)`,
    /// and on rejection the token is `y`, distributed as `p` with `x` removed and
    /// renormalised; each emitted token follows the model's `p` (after temperature, top-k and
    /// top-p) exactly.
    pub fn verify(
        &mut self,
        rows: &[f32],
        vocab: usize,
        drafts: &[u32],
        first_index: u64,
        out: &mut Vec<u32>,
    ) -> Result<(), SamplingError> {
        if vocab == 0 || rows.len() != (drafts.len() + 1) * vocab {
            return Err(SamplingError(format!(
                "verification needs {} rows of {vocab} logits, got {} values",
                drafts.len() + 1,
                rows.len()
            )));
        }
        for (j, &x) in drafts.iter().enumerate() {
            let t = self.sample(&rows[j * vocab..(j + 1) * vocab], first_index + j as u64)?;
            out.push(t);
            if t != x {
                return Ok(());
            }
        }
        let last = &rows[drafts.len() * vocab..];
        let bonus = self.sample(last, first_index + drafts.len() as u64)?;
        out.push(bonus);
        Ok(())
    }

    /// Fills `candidates`/`weights` with the kept tokens and their unnormalised
    /// probabilities `e^((l − max) / T)`; returns their total.
    ///
    /// Canonical definition (what every process computes): a weight is
    /// [`scaled_exps`]'s (the attention kernel's exp, lane-wise, so a token's weight has the
    /// same bits alone or in a block). Without top-k and top-p, every token is kept, in id
    /// order, and the total is [`exp_sum`]'s. With top-k, the k best in the total order
    /// "higher logit first, lower id on ties". With top-p, the shortest prefix of that order
    /// whose weight reaches `top_p` of the pool's total weight ([`exp_sum`] over the
    /// vocabulary, or summed in order over the top-k set). Only that prefix is ever sorted:
    /// it is found by selecting ever larger heads of the order, so a draw costs a few
    /// passes over the vocabulary, not a sort of it.
    fn distribution(&mut self, logits: &[f32]) -> f64 {
        let p = &self.params;
        let best = max_of(logits);
        let inv_t = 1.0 / p.temperature;
        let weight = |l: f32| weight_of(l, best, inv_t);
        let truncate_k = p.top_k > 0 && p.top_k < logits.len();
        if !truncate_k && p.top_p >= 1.0 {
            self.candidates.clear();
            self.candidates
                .extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
            self.weights.resize(logits.len(), 0.0);
            let weights = &mut self.weights;
            return exp_sum_with(logits, best, inv_t, |at, _, exps| {
                for (w, &e) in weights[at..at + exps.len()].iter_mut().zip(exps) {
                    *w = f64::from(e);
                }
            });
        }
        self.candidates.clear();
        let pool_total: f64 = if truncate_k {
            top_by_logit(logits, p.top_k, &mut self.candidates);
            self.candidates.iter().map(|&(_, l)| weight(l)).sum()
        } else {
            // Top-p over the whole vocabulary: only the logits at or above a floor that
            // surely holds the kept prefix are candidates (a few hundred, not the vocabulary).
            let mut histogram = WeightHistogram::new();
            let total = exp_sum_with(logits, best, inv_t, |_, block, exps| {
                histogram.add(block, exps)
            });
            let floor = histogram.floor(p.top_p as f64 * total);
            self.candidates.extend(
                (logits.iter().enumerate())
                    .filter(|&(_, &l)| l >= floor)
                    .map(|(i, &l)| (i as u32, l)),
            );
            total
        };
        let target = p.top_p as f64 * pool_total;
        self.weights.clear();
        let mut cumulative = 0.0;
        let mut sorted = if truncate_k { self.candidates.len() } else { 0 };
        let mut head = 64.min(self.candidates.len());
        let keep = 'found: loop {
            if sorted < head {
                self.candidates[sorted..].select_nth_unstable_by(head - sorted - 1, by_logit);
                self.candidates[sorted..head].sort_unstable_by(by_logit);
                sorted = head;
            }
            for i in self.weights.len()..sorted {
                let w = weight(self.candidates[i].1);
                self.weights.push(w);
                cumulative += w;
                if cumulative >= target {
                    break 'found i + 1;
                }
            }
            if sorted == self.candidates.len() {
                break sorted;
            }
            head = (4 * head).min(self.candidates.len());
        };
        self.candidates.truncate(keep);
        self.weights.truncate(keep);
        self.weights.iter().sum()
    }

    /// The kept candidate at cumulative weight `target`.
    fn pick(&self, mut target: f64) -> u32 {
        for (&(id, _), &w) in self.candidates.iter().zip(&self.weights) {
            if target < w {
                return id;
            }
            target -= w;
        }
        // Rounding left `target` at the very top: the last candidate that has a weight (one
        // of weight 0, an excluded or underflowed token, is never picked).
        let last = self.weights.iter().rposition(|&w| w > 0.0).unwrap_or(0);
        self.candidates[last].0
    }
}

/// The most alternatives a token's [`TokenLogprobs`] may list (OpenAI's `top_logprobs` bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A token's log-probability under the model's own distribution, the softmax of the raw
/// logits (no temperature, top-k or top-p: what was computed, not how it was picked), and
/// the most likely tokens with theirs, as OpenAI's `logprobs` report them.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The token.
    pub token: u32,
    /// Its natural log-probability (≤ 0).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, higher first, lower id on ties.
    pub top: Vec<(u32, f32)>,
}

/// [`TokenLogprobs`] of `token` from one logits row, with `top_n` (at most
/// [`MAX_TOP_LOGPROBS`]) alternatives. The normaliser `Σ e^(l − max)` takes the attention
/// kernel's exp (identical on every ISA) and sums it in f64 over 8 interleaved partial sums
/// added in a fixed order, so the values are a pure function of the row: batched equals
/// alone, mesh equals one process.
pub fn token_logprobs(
    logits: &[f32],
    token: u32,
    top_n: usize,
) -> Result<TokenLogprobs, SamplingError> {
    check_logits(logits)?;
    if token as usize >= logits.len() {
        return Err(SamplingError(format!(
            "token {token} is outside the {} logits",
            logits.len()
        )));
    }
    if top_n > MAX_TOP_LOGPROBS {
        return Err(SamplingError(format!(
            "at most {MAX_TOP_LOGPROBS} top log-probabilities, got {top_n}"
        )));
    }
    let best = max_of(logits);
    let log_norm = f64::from(best) + exp_sum(logits, best, 1.0).ln();
    let logprob = |l: f32| (f64::from(l) - log_norm).min(0.0) as f32;
    // The head of the order "higher logit, lower id": a short sorted list that a value
    // enters only when it beats its last (most of the vocabulary is one comparison).
    let mut top = Vec::with_capacity(top_n + 1);
    top_by_logit(logits, top_n, &mut top);
    Ok(TokenLogprobs {
        token,
        logprob: logprob(logits[token as usize]),
        top: top.into_iter().map(|(i, l)| (i, logprob(l))).collect(),
    })
}

/// Up to this many best tokens are found by one scan; more by selection.
const TOP_SCAN_MAX: usize = 256;

/// The `n` best `(id, logit)` of `logits` in the order "higher logit first, lower id on
/// ties", appended to `out` (sorted). Small `n`: one scan that keeps a sorted head and skips
/// every 16-value block whose maximum cannot enter it; large `n`: a selection, then a sort.
fn top_by_logit(logits: &[f32], n: usize, out: &mut Vec<(u32, f32)>) {
    let n = n.min(logits.len());
    if n > TOP_SCAN_MAX {
        let start = out.len();
        out.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        let head = &mut out[start..];
        if n < head.len() {
            head.select_nth_unstable_by(n - 1, by_logit);
        }
        out.truncate(start + n);
        out[start..].sort_unstable_by(by_logit);
        return;
    }
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (b, block) in logits.chunks(LANES).enumerate() {
            // Ids grow along the scan, so a value no higher than the last kept one cannot
            // enter (on a tie the kept one has the lower id): most blocks are skipped whole.
            if top.len() == n && max_of(block) <= top[n - 1].1 {
                continue;
            }
            for (j, &l) in block.iter().enumerate() {
                if top.len() == n && l <= top[n - 1].1 {
                    continue;
                }
                let id = (b * LANES + j) as u32;
                let at = top.partition_point(|x| by_logit(x, &(id, l)) == Ordering::Less);
                top.insert(at, (id, l));
                top.truncate(n);
            }
        }
    }
    out.extend(top);
}

/// Weights in (0, 1] by binary exponent: biased exponents 0..=127.
const WEIGHT_BUCKETS: usize = 128;

/// A histogram of a row's weights by binary exponent (each bucket's total and its smallest
/// logit), filled in the same pass that sums them, to find a top-p floor.
struct WeightHistogram {
    mass: [f64; WEIGHT_BUCKETS],
    lowest: [f32; WEIGHT_BUCKETS],
}

impl WeightHistogram {
    fn new() -> Self {
        WeightHistogram {
            mass: [0.0; WEIGHT_BUCKETS],
            lowest: [f32::INFINITY; WEIGHT_BUCKETS],
        }
    }

    /// Adds a block of logits and their weights.
    fn add(&mut self, logits: &[f32], weights: &[f32]) {
        for (&w, &l) in weights.iter().zip(logits) {
            if w > 0.0 {
                let e = ((w.to_bits() >> 23) as usize).min(WEIGHT_BUCKETS - 1);
                self.mass[e] += f64::from(w);
                self.lowest[e] = self.lowest[e].min(l);
            }
        }
    }

    /// A logit floor below which no token can belong to the top-p prefix: the tokens at or
    /// above it weigh at least `target` (with a margin far above rounding), so the sorted
    /// walk that decides the prefix ends among them. The buckets are walked from the
    /// heaviest; the floor is a logit, so the candidate set is a prefix of the order whatever
    /// the exp's last-bit behaviour. −∞ when no margin is possible (every token is then a
    /// candidate).
    fn floor(&self, target: f64) -> f32 {
        let needed = target * (1.0 + 1e-9);
        let (mut cumulative, mut floor) = (0.0, f32::INFINITY);
        for e in (0..WEIGHT_BUCKETS).rev() {
            cumulative += self.mass[e];
            floor = floor.min(self.lowest[e]);
            if cumulative >= needed {
                return floor;
            }
        }
        f32::NEG_INFINITY
    }
}

/// Values a block of [`scaled_exps`] handles at once (on the stack).
const EXP_BLOCK: usize = 1024;

/// `e^((l − shift) · scale)` of each value (each at most `shift`, `scale` > 0): the argument
/// rounded to f32 as written, then the attention kernel's exp (vectorized, the same bits on
/// every ISA, and lane-wise: a value's result does not depend on its neighbours).
fn scaled_exps(values: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
    if scale == 1.0 {
        // The same bits: `(l − shift) · 1` is `l − shift`, which the kernel computes itself.
        return crate::attention::exp_shifted(values, shift, out);
    }
    let mut args = [0.0f32; EXP_BLOCK];
    for (block, out) in values.chunks(EXP_BLOCK).zip(out.chunks_mut(EXP_BLOCK)) {
        let args = &mut args[..block.len()];
        for (a, &l) in args.iter_mut().zip(block) {
            *a = (l - shift) * scale;
        }
        crate::attention::exp_shifted(args, 0.0, out);
    }
}

/// One token's weight `e^((l − best) · inv_t)` as a block computes it ([`scaled_exps`] is
/// lane-wise), widened to f64.
fn weight_of(l: f32, best: f32, inv_t: f32) -> f64 {
    let mut w = [0.0f32];
    scaled_exps(&[l], best, inv_t, &mut w);
    f64::from(w[0])
}

/// `Σ e^((l − shift) · scale)` over a row ([`scaled_exps`]), summed in f64 into 8 partial
/// sums by index, added in a fixed order.
fn exp_sum(row: &[f32], shift: f32, scale: f32) -> f64 {
    exp_sum_with(row, shift, scale, |_, _, _| {})
}

/// [`exp_sum`], handing each block to `visit` as `(start, logits, weights)` on the way (to
/// keep the weights, or to histogram them), so the row's exps are computed once.
fn exp_sum_with(
    row: &[f32],
    shift: f32,
    scale: f32,
    mut visit: impl FnMut(usize, &[f32], &[f32]),
) -> f64 {
    let mut exps = [0.0f32; EXP_BLOCK];
    let mut partial = [0.0f64; 8];
    for (k, block) in row.chunks(EXP_BLOCK).enumerate() {
        let exps = &mut exps[..block.len()];
        scaled_exps(block, shift, scale, exps);
        visit(k * EXP_BLOCK, block, exps);
        let whole = exps.len() / 8 * 8;
        for c in exps[..whole].chunks_exact(8) {
            for j in 0..8 {
                partial[j] += f64::from(c[j]);
            }
        }
        for (p, &e) in partial.iter_mut().zip(&exps[whole..]) {
            *p += f64::from(e);
        }
    }
    let [a, b, c, d, e, f, g, h] = partial;
    ((a + b) + (c + d)) + ((e + f) + (g + h))
}

/// Highest logit first; equal logits by lower id, so the order is total and stable.
fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.partial_cmp(&a.1)
        .unwrap_or(Ordering::Equal)
        .then(a.0.cmp(&b.0))
}

fn check_logits(logits: &[f32]) -> Result<(), SamplingError> {
    if logits.is_empty() {
        return Err(SamplingError("cannot sample from empty logits".into()));
    }
    // A branch-free pass first (it vectorizes): the search for the culprit runs only on error.
    let exponent = f32::INFINITY.to_bits();
    let any_bad = logits.iter().fold(0u32, |b, v| {
        b | u32::from(v.to_bits() & exponent == exponent)
    });
    if any_bad != 0 {
        let i = logits.iter().position(|v| !v.is_finite()).unwrap_or(0);
        return Err(SamplingError(format!(
            "logit {i} is not finite ({})",
            logits[i]
        )));
    }
    Ok(())
}

/// Lanes of [`argmax`]'s running maxima (what one vector holds).
const LANES: usize = 16;

/// Index of the largest value; ties go to the lowest index, and a NaN is never the largest. A
/// pass of per-lane maxima (it vectorizes), then the first index holding their maximum.
pub fn argmax(values: &[f32]) -> u32 {
    let best = max_of(values);
    // No value equals it only when every value is NaN (or there are none): then index 0.
    values.iter().position(|&v| v == best).unwrap_or(0) as u32
}

/// The largest value, ignoring NaNs (−∞ when there is none): per-lane maxima, which
/// vectorize, then the largest of them.
fn max_of(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let whole = values.len() / LANES * LANES;
    for c in values[..whole].chunks_exact(LANES) {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut best = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(&values[whole..]) {
        best = if v > best { v } else { best };
    }
    best
}

#[cfg(test)]
mod tests;
