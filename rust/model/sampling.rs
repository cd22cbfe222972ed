//! Token sampling: greedy, temperature, top-k, top-p, with a seeded generator.
//!
//! The sampler is the single source of truth for every process: the single-process runtime
//! and the mesh coordinator both call it, so the same seed gives the same tokens everywhere.

use std::cmp::Ordering;
use std::fmt;

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
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            greedy: true,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
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

/// A stateful sampler: one per generation, advanced once per sampled token.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Reused candidate buffer (no allocation per token after the first).
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for `params` (validated).
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        let rng = Rng::new(params.seed);
        Ok(Sampler {
            params,
            rng,
            candidates: Vec::new(),
        })
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from raw logits. Non-finite logits are an error.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        if logits.is_empty() {
            return Err(SamplingError("cannot sample from empty logits".into()));
        }
        if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
            return Err(SamplingError(format!(
                "logit {i} is not finite ({})",
                logits[i]
            )));
        }
        if self.params.greedy {
            return Ok(argmax(logits));
        }
        let p = &self.params;
        self.candidates.clear();
        self.candidates
            .extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        // Highest logit first; equal logits by lower id, so the order is total and stable.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| {
            b.1.partial_cmp(&a.1)
                .unwrap_or(Ordering::Equal)
                .then(a.0.cmp(&b.0))
        };
        if p.top_k > 0 && p.top_k < self.candidates.len() {
            self.candidates
                .select_nth_unstable_by(p.top_k - 1, by_logit);
            self.candidates.truncate(p.top_k);
        }
        self.candidates.sort_unstable_by(by_logit);
        let max = self.candidates[0].1 as f64;
        let t = p.temperature as f64;
        let weights: Vec<f64> = self
            .candidates
            .iter()
            .map(|&(_, l)| ((l as f64 - max) / t).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut keep = weights.len();
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            for (i, w) in weights.iter().enumerate() {
                cumulative += w / total;
                if cumulative >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept_total: f64 = weights[..keep].iter().sum();
        let mut target = self.rng.next_f64() * kept_total;
        for (i, w) in weights[..keep].iter().enumerate() {
            if target < *w {
                return Ok(self.candidates[i].0);
            }
            target -= w;
        }
        Ok(self.candidates[keep - 1].0)
    }
}

/// Index of the largest value; ties go to the lowest index.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            greedy: false,
            temperature,
            top_k,
            top_p,
            seed,
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]).unwrap(), 1);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_differs() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 7) % 13) as f32 * 0.2).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, seed)).unwrap();
            (0..50)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.5f32, 2.0, 1.9, -4.0];
        let mut s = Sampler::new(params(5.0, 1, 1.0, 3)).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&logits).unwrap(), 1);
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Token 0 carries ~0.88 of the mass: top_p 0.5 keeps it alone.
        let logits = [4.0f32, 2.0, 0.0, -1.0];
        let mut s = Sampler::new(params(1.0, 0, 0.5, 11)).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&logits).unwrap(), 0);
        }
    }

    #[test]
    fn temperature_sampling_follows_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = 0.25, 0.75
        let mut s = Sampler::new(params(1.0, 0, 1.0, 99)).unwrap();
        let ones = (0..20000)
            .filter(|_| s.sample(&logits).unwrap() == 1)
            .count();
        let frac = ones as f64 / 20000.0;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
    }

    #[test]
    fn bad_parameters_and_logits_are_refused() {
        assert!(Sampler::new(params(0.0, 0, 1.0, 0)).is_err());
        assert!(Sampler::new(params(1.0, 0, 0.0, 0)).is_err());
        assert!(Sampler::new(params(1.0, 0, 1.5, 0)).is_err());
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert!(s.sample(&[]).is_err());
        assert!(s.sample(&[0.0, f32::NAN]).is_err());
    }
}
