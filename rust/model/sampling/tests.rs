use super::*;

fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        greedy: false,
        temperature,
        top_k,
        top_p,
        seed,
        ..SamplingParams::default()
    }
}

#[test]
fn greedy_takes_the_first_maximum() {
    let mut s = Sampler::new(SamplingParams::default()).unwrap();
    assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0], 0).unwrap(), 1);
}

#[test]
fn same_seed_same_tokens_other_seed_differs() {
    let logits: Vec<f32> = (0..100).map(|i| ((i * 7) % 13) as f32 * 0.2).collect();
    let run = |seed| {
        let mut s = Sampler::new(params(1.0, 0, 1.0, seed)).unwrap();
        (0..50)
            .map(|i| s.sample(&logits, i).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn top_k_one_is_greedy() {
    let logits = [0.5f32, 2.0, 1.9, -4.0];
    let mut s = Sampler::new(params(5.0, 1, 1.0, 3)).unwrap();
    for i in 0..20 {
        assert_eq!(s.sample(&logits, i).unwrap(), 1);
    }
}

#[test]
fn top_p_keeps_only_the_nucleus() {
    // Token 0 carries ~0.88 of the mass: top_p 0.5 keeps it alone.
    let logits = [4.0f32, 2.0, 0.0, -1.0];
    let mut s = Sampler::new(params(1.0, 0, 0.5, 11)).unwrap();
    for i in 0..50 {
        assert_eq!(s.sample(&logits, i).unwrap(), 0);
    }
}

#[test]
fn temperature_sampling_follows_the_distribution() {
    let logits = [0.0f32, (3.0f32).ln()]; // p = 0.25, 0.75
    let mut s = Sampler::new(params(1.0, 0, 1.0, 99)).unwrap();
    let ones = (0..20000)
        .filter(|&i| s.sample(&logits, i).unwrap() == 1)
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
    assert!(s.sample(&[], 0).is_err());
    assert!(s.sample(&[0.0, f32::NAN], 0).is_err());
    let mut out = Vec::new();
    assert!(s.verify(&[0.0; 5], 4, &[1], 0, &mut out).is_err());
    assert!(out.is_empty());
}

/// The selection-based nucleus equals the definition: sort everything, cut at top-k,
/// keep the shortest prefix reaching top-p of the total weight.
#[test]
fn the_kept_set_equals_a_full_sort_of_the_vocabulary() {
    let mut seed = 7u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as f32 / (1u64 << 31) as f32
    };
    for case in 0..60 {
        let vocab = 50 + case * 37;
        // Ties included: logits on a coarse grid.
        let logits: Vec<f32> = (0..vocab).map(|_| (next() * 40.0).round() / 4.0).collect();
        let top_k = [0, 1, 5, 40, vocab + 3][case % 5];
        let top_p = [1.0, 0.9, 0.5, 0.05, 0.999][case / 5 % 5];
        let p = params(0.7, top_k, top_p, 1);
        let mut s = Sampler::new(p.clone()).unwrap();
        s.distribution(&logits);
        let (kept, _) = reference_distribution(&logits, &p);
        let mut want: Vec<u32> = kept.iter().map(|&(id, _)| id).collect();
        let mut got: Vec<u32> = s.candidates.iter().map(|&(id, _)| id).collect();
        if !(top_k > 0 && top_k < vocab) && top_p >= 1.0 {
            // No truncation: every token, in id order.
            want.sort_unstable();
            got.sort_unstable();
            assert_eq!(s.candidates.len(), vocab);
        }
        assert_eq!(got, want, "case {case}: top_k {top_k}, top_p {top_p}");
    }
}

#[test]
fn sampling_is_a_function_of_the_position_not_of_call_order() {
    let logits: Vec<f32> = (0..64).map(|i| ((i * 5) % 11) as f32 * 0.3).collect();
    let mut a = Sampler::new(params(0.9, 0, 0.95, 5)).unwrap();
    let mut b = Sampler::new(params(0.9, 0, 0.95, 5)).unwrap();
    let forward: Vec<u32> = (0..40).map(|i| a.sample(&logits, i).unwrap()).collect();
    let mut backward: Vec<u32> = (0..40)
        .rev()
        .map(|i| b.sample(&logits, i).unwrap())
        .collect();
    backward.reverse();
    assert_eq!(forward, backward);
}

#[test]
fn greedy_verification_emits_exactly_the_greedy_tokens() {
    let vocab = 5;
    // Row j's argmax is j + 1.
    let rows: Vec<f32> = (0..4)
        .flat_map(|j| (0..vocab).map(move |t| if t == j + 1 { 2.0 } else { 0.0 }))
        .collect();
    let mut s = Sampler::new(SamplingParams::default()).unwrap();
    let mut out = Vec::new();
    s.verify(&rows, vocab, &[1, 2, 3], 10, &mut out).unwrap();
    assert_eq!(out, [1, 2, 3, 4], "all accepted + the bonus token");
    out.clear();
    s.verify(&rows, vocab, &[1, 0, 3], 10, &mut out).unwrap();
    assert_eq!(
        out,
        [1, 2],
        "stops at the first disagreement with the correction"
    );
    out.clear();
    s.verify(&rows[..vocab], vocab, &[], 10, &mut out).unwrap();
    assert_eq!(out, [1], "no draft: plain greedy");
}

/// The exact acceptance rule keeps the model's distribution: whatever the draft, the first
/// emitted token is distributed as p (chi-square-style tolerance over 40 000 draws).
#[test]
fn sampled_verification_keeps_the_model_distribution() {
    let logits = [0.0f32, 1.0, 2.0, 0.5];
    let vocab = logits.len();
    let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
    let p: Vec<f64> = logits.iter().map(|&l| (l as f64).exp() / z).collect();
    let rows: Vec<f32> = logits.iter().chain(logits.iter()).copied().collect();
    for draft in 0..vocab as u32 {
        let mut counts = [0usize; 4];
        let mut accepted = 0usize;
        let n = 40_000;
        for seed in 0..n as u64 {
            let mut s = Sampler::new(params(1.0, 0, 1.0, seed)).unwrap();
            let mut out = Vec::new();
            s.verify(&rows, vocab, &[draft], 7, &mut out).unwrap();
            counts[out[0] as usize] += 1;
            accepted += usize::from(out.len() == 2);
        }
        for t in 0..vocab {
            let freq = counts[t] as f64 / n as f64;
            let sd = (p[t] * (1.0 - p[t]) / n as f64).sqrt();
            assert!(
                (freq - p[t]).abs() < 5.0 * sd,
                "draft {draft}: token {t} at {freq:.4}, model p = {:.4}",
                p[t]
            );
        }
        // A draft is accepted with probability p(draft).
        let rate = accepted as f64 / n as f64;
        let sd = (p[draft as usize] * (1.0 - p[draft as usize]) / n as f64).sqrt();
        assert!(
            (rate - p[draft as usize]).abs() < 5.0 * sd,
            "acceptance {rate}"
        );
    }
}

/// Sampled verification emits plain sampling's tokens: whatever the drafts, every emitted
/// token is the one `sample` draws for its position, so a seeded run with speculation equals
/// the same seed without it, token for token (and draft lengths never change a token).
#[test]
fn sampled_verification_emits_plain_sampling_tokens() {
    let vocab = 6;
    let rows: Vec<f32> = (0..4)
        .flat_map(|j| (0..vocab).map(move |t| ((t * 7 + j * 3) % 5) as f32 * 0.6))
        .collect();
    for seed in 0..300u64 {
        for top_k in [0, 3] {
            let mut s = Sampler::new(params(0.9, top_k, 0.95, seed)).unwrap();
            let plain: Vec<u32> = (0..4)
                .map(|j| {
                    s.sample(&rows[j * vocab..(j + 1) * vocab], 20 + j as u64)
                        .unwrap()
                })
                .collect();
            for drafts in [
                vec![],
                plain[..3].to_vec(),
                vec![plain[0], (plain[1] + 1) % vocab as u32, plain[2]],
                vec![(plain[0] + 2) % vocab as u32],
            ] {
                let mut out = Vec::new();
                s.verify(
                    &rows[..(drafts.len() + 1) * vocab],
                    vocab,
                    &drafts,
                    20,
                    &mut out,
                )
                .unwrap();
                let accepted = drafts
                    .iter()
                    .zip(&plain)
                    .take_while(|(d, p)| d == p)
                    .count();
                assert_eq!(out.len(), (accepted + 1).min(drafts.len() + 1));
                assert_eq!(out, plain[..out.len()], "seed {seed} drafts {drafts:?}");
            }
        }
    }
}

/// The vectorized argmax is the first-largest scan: ties to the lowest index (also ±0 and
/// −∞), any length (a tail shorter than a vector), and a NaN never wins.
#[test]
fn argmax_is_the_first_largest_value() {
    fn scan(values: &[f32]) -> u32 {
        let mut best: Option<usize> = None;
        for (i, &v) in values.iter().enumerate() {
            if !v.is_nan() && best.is_none_or(|b| v > values[b]) {
                best = Some(i);
            }
        }
        best.unwrap_or(0) as u32
    }
    let mut state = 0x9e37_79b9_u32;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state
    };
    for len in [1, 2, 15, 16, 17, 33, 100, 49_152] {
        for round in 0..20 {
            // Few distinct values, so ties are common.
            let mut v: Vec<f32> = (0..len).map(|_| (next() % 7) as f32 - 3.0).collect();
            match round % 5 {
                1 => v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
                2 => v[next() as usize % len] = f32::NAN,
                3 => {
                    v.iter_mut().for_each(|x| *x = 0.0);
                    v[next() as usize % len] = -0.0;
                }
                4 => v[len - 1] = 10.0,
                _ => {}
            }
            assert_eq!(argmax(&v), scan(&v), "len {len} round {round}: {v:?}");
        }
    }
    assert_eq!(argmax(&[f32::NAN, 1.0, 2.0, 2.0]), 2);
    assert_eq!(argmax(&[f32::NAN; 5]), 0);
    assert_eq!(argmax(&[]), 0);
}

#[test]
fn logprobs_are_the_log_softmax_of_the_raw_logits_with_the_head_of_the_order() {
    let logits = [1.0f32, 3.0, 3.0, -2.0, 0.5, 2.0];
    let lp = token_logprobs(&logits, 4, 3).unwrap();
    let norm: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
    let expect = |l: f32| (f64::from(l) - norm.ln()) as f32;
    assert_eq!(lp.token, 4);
    assert!((lp.logprob - expect(0.5)).abs() < 1e-6);
    // Ties by lower id; exactly top_n of them.
    let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
    assert_eq!(ids, vec![1, 2, 5]);
    for &(i, v) in &lp.top {
        assert!((v - expect(logits[i as usize])).abs() < 1e-6);
    }
    // The probabilities of the whole row sum to one.
    let all = token_logprobs(&logits, 0, logits.len()).unwrap();
    let mass: f64 = all.top.iter().map(|t| f64::from(t.1).exp()).sum();
    assert!((mass - 1.0).abs() < 1e-6);
    assert!(token_logprobs(&logits, 0, 0).unwrap().top.is_empty());
    // Shifting every logit changes nothing: no temperature or truncation enters.
    let shifted: Vec<f32> = logits.iter().map(|l| l + 100.0).collect();
    assert!((token_logprobs(&shifted, 4, 0).unwrap().logprob - lp.logprob).abs() < 1e-5);
}

#[test]
fn logprobs_refuse_bad_rows_tokens_and_counts() {
    assert!(token_logprobs(&[0.0, f32::NAN], 0, 1).is_err());
    assert!(token_logprobs(&[0.0, 1.0], 2, 1).is_err());
    assert!(token_logprobs(&[], 0, 0).is_err());
    let row = vec![0.0f32; 64];
    assert!(token_logprobs(&row, 0, MAX_TOP_LOGPROBS + 1).is_err());
    let uniform = token_logprobs(&row, 63, MAX_TOP_LOGPROBS).unwrap();
    assert!((uniform.logprob - (1.0f32 / 64.0).ln()).abs() < 1e-6);
    let ids: Vec<u32> = uniform.top.iter().map(|t| t.0).collect();
    assert_eq!(ids, (0..MAX_TOP_LOGPROBS as u32).collect::<Vec<_>>());
}

#[test]
fn the_logprobs_normaliser_is_the_same_on_every_isa_and_close_to_libm() {
    use crate::attention::{exp_shifted_with, Isa};
    let row: Vec<f32> = (0..5000)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
        .collect();
    let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut reference = vec![0.0f32; row.len()];
    exp_shifted_with(Isa::Scalar, &row, best, &mut reference);
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        let mut got = vec![0.0f32; row.len()];
        exp_shifted_with(isa, &row, best, &mut got);
        assert!(got == reference, "{isa:?}");
    }
    for (&l, &e) in row.iter().zip(&reference) {
        let exact = f64::from(l - best).exp();
        assert!(
            (f64::from(e) - exact).abs() <= 2e-7 * exact + 1e-38,
            "{l}: {e} vs {exact}"
        );
    }
    let lp = token_logprobs(&row, 3, 5).unwrap();
    let norm: f64 = row
        .iter()
        .map(|&l| (f64::from(l) - f64::from(best)).exp())
        .sum();
    let exact = f64::from(row[3]) - f64::from(best) - norm.ln();
    // Within the f32 the logprob is stored in.
    assert!((f64::from(lp.logprob) - exact).abs() <= 1e-7 * exact.abs() + 1e-6);
}

#[test]
fn a_weight_has_the_same_bits_alone_or_in_a_block_and_sums_close_to_libm() {
    let row: Vec<f32> = (0..3000)
        .map(|i| ((i * 53 % 97) as f32 - 60.0) * 0.21)
        .collect();
    let best = max_of(&row);
    let inv_t = 1.0 / 0.7f32;
    let mut block = vec![0.0f32; row.len()];
    scaled_exps(&row, best, inv_t, &mut block);
    for (&l, &w) in row.iter().zip(&block) {
        let mut alone = [0.0f32];
        scaled_exps(&[l], best, inv_t, &mut alone);
        assert_eq!(alone[0].to_bits(), w.to_bits());
        let exact = (f64::from((l - best) * inv_t)).exp();
        assert!((f64::from(w) - exact).abs() <= 2e-7 * exact + 1e-38);
    }
    let mut weights = vec![0.0f64; row.len()];
    let total = exp_sum_with(&row, best, inv_t, |at, _, exps| {
        for (w, &e) in weights[at..at + exps.len()].iter_mut().zip(exps) {
            *w = f64::from(e);
        }
    });
    assert_eq!(total, exp_sum(&row, best, inv_t));
    assert!(weights.iter().zip(&block).all(|(&w, &b)| w == f64::from(b)));
    let exact: f64 = row
        .iter()
        .map(|&l| f64::from((l - best) * inv_t).exp())
        .sum();
    assert!((total - exact).abs() < 1e-6 * exact);
}

/// Every `(id, logit)`, higher logit first, lower id first among equals (a full sort).
fn sorted_by_logit(logits: &[f32]) -> Vec<(u32, f32)> {
    let mut order: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .collect();
    order.sort_by(by_logit);
    order
}

/// The canonical kept set, computed the slow way: sort every token by "higher logit, lower
/// id", weigh each alone, keep the top-k, then the shortest prefix reaching top-p of the
/// pool's total.
fn reference_distribution(logits: &[f32], p: &SamplingParams) -> (Vec<(u32, f32)>, Vec<f64>) {
    let best = max_of(logits);
    let inv_t = 1.0 / p.temperature;
    let weight = |l: f32| weight_of(l, best, inv_t);
    let mut order = sorted_by_logit(logits);
    let truncate_k = p.top_k > 0 && p.top_k < logits.len();
    if truncate_k {
        order.truncate(p.top_k);
    }
    let total: f64 = if truncate_k {
        order.iter().map(|&(_, l)| weight(l)).sum()
    } else {
        exp_sum(logits, best, inv_t)
    };
    let target = f64::from(p.top_p) * total;
    let (mut kept, mut weights, mut cumulative) = (Vec::new(), Vec::new(), 0.0);
    for &(id, l) in &order {
        let w = weight(l);
        kept.push((id, l));
        weights.push(w);
        cumulative += w;
        if p.top_p < 1.0 && cumulative >= target {
            break;
        }
    }
    (kept, weights)
}

#[test]
fn the_fast_distribution_keeps_exactly_the_canonical_set() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    for case in 0..24 {
        let n = [50, 1000, 49_152][case % 3];
        // Peaked, flat, and tied rows.
        let spread = [2.0, 12.0, 0.5][case / 3 % 3];
        let logits: Vec<f32> = (0..n)
            .map(|i| {
                if case % 5 == 0 && i % 7 == 0 {
                    1.25
                } else {
                    (next() - 0.5) * spread * 2.0
                }
            })
            .collect();
        for (top_k, top_p, t) in [
            (0, 0.9, 0.7),
            (0, 0.5, 1.3),
            (40, 0.95, 1.0),
            (300, 0.8, 0.6),
            (0, 0.999, 1.0),
            (5, 1.0, 0.9),
        ] {
            let p = params(t, top_k, top_p, 1);
            let mut s = Sampler::new(p.clone()).unwrap();
            let total = s.distribution(&logits);
            let (kept, weights) = reference_distribution(&logits, &p);
            assert_eq!(
                s.candidates, kept,
                "case {case}: top_k {top_k} top_p {top_p}"
            );
            assert_eq!(s.weights, weights, "case {case}");
            assert_eq!(total, s.weights.iter().sum::<f64>());
        }
    }
}

#[test]
fn the_best_tokens_by_scan_equal_a_full_sort() {
    let logits: Vec<f32> = (0..5000)
        .map(|i| ((i * 7919 % 1013) as f32) * 0.01)
        .collect();
    let sorted = sorted_by_logit(&logits);
    for n in [0, 1, 20, TOP_SCAN_MAX, TOP_SCAN_MAX + 1, 1000, 5000, 6000] {
        let mut got = Vec::new();
        top_by_logit(&logits, n, &mut got);
        assert_eq!(got, sorted[..n.min(5000)], "n = {n}");
    }
}

#[test]
fn masked_sampling_is_the_rule_on_the_row_without_the_excluded_tokens() {
    // An excluded token weighs 0: the same as a logit so far below the best that its weight
    // underflows to 0, so both rows give the same tokens, greedy or sampled, at every
    // position, top-k and top-p included.
    let vocab: usize = 300;
    let logits: Vec<f32> = (0..vocab)
        .map(|i| ((i * 37 % 101) as f32 * 0.05).sin() * 4.0)
        .collect();
    let allowed: Vec<u32> = (0..vocab.div_ceil(32))
        .map(|w| 0x9249_2492u32.rotate_left(w as u32))
        .collect();
    let is_allowed = |i: usize| allowed[i / 32] >> (i % 32) & 1 == 1;
    let best = max_of(&logits);
    let floored: Vec<f32> = (0..vocab)
        .map(|i| {
            if is_allowed(i) {
                logits[i]
            } else {
                best - 200.0
            }
        })
        .collect();
    let all_params = [
        SamplingParams::default(),
        params(1.0, 0, 1.0, 5),
        params(0.7, 20, 1.0, 6),
        params(1.3, 0, 0.8, 7),
        params(0.9, 50, 0.9, 8),
    ];
    for p in all_params {
        let mut masked = Sampler::new(p.clone()).unwrap();
        let mut plain = Sampler::new(p.clone()).unwrap();
        for index in 0..200 {
            let t = masked.sample_masked(&logits, &allowed, index).unwrap();
            assert!(is_allowed(t as usize), "{p:?}: token {t} is excluded");
            assert_eq!(
                t,
                plain.sample(&floored, index).unwrap(),
                "{p:?} at {index}"
            );
        }
    }
    // Greedy takes the best allowed token, not the best one.
    let mut g = Sampler::new(SamplingParams::default()).unwrap();
    assert_eq!(
        g.sample_masked(&[1.0, 5.0, 3.0, 3.0], &[0b1101], 0)
            .unwrap(),
        2
    );
    // Tied maxima: the first allowed one, whether or not the row's first maximum is allowed.
    for (mask, want) in [(0b0110, 1), (0b0100, 2), (0b1111, 1)] {
        assert_eq!(
            g.sample_masked(&[1.0, 5.0, 5.0, 3.0], &[mask], 0).unwrap(),
            want
        );
    }
    // Nothing allowed in the row (a bit past its end does not count), or a bad raw row.
    let err = g.sample_masked(&[1.0, 2.0], &[0b100], 0).unwrap_err();
    assert!(err.0.contains("allows no token"), "{err}");
    assert!(g.sample_masked(&[1.0, f32::NAN], &[0b1], 0).is_err());
}

fn adjusted(greedy: bool, adjust: LogitsAdjust) -> Sampler {
    let p = SamplingParams {
        greedy,
        adjust,
        ..params(0.9, 0, 1.0, 77)
    };
    Sampler::new(p).unwrap()
}

fn row(seed: u32, vocab: usize) -> Vec<f32> {
    (0..vocab)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 100.0 - 5.0)
        .collect()
}

#[test]
fn neutral_adjustments_leave_the_draws_unchanged() {
    let prompt = [3u32, 4, 5];
    for greedy in [true, false] {
        let mut plain = adjusted(greedy, LogitsAdjust::default());
        let neutral = LogitsAdjust {
            logit_bias: vec![(7, 0.0)],
            min_tokens: 3,
            ..LogitsAdjust::default()
        };
        let mut same = adjusted(greedy, neutral);
        same.begin(&prompt);
        for i in 0..20u64 {
            let r = row(i as u32, 300);
            assert_eq!(plain.sample(&r, 3 + i), same.sample(&r, 3 + i));
        }
    }
}

#[test]
fn penalties_bias_and_min_tokens_follow_their_definitions() {
    let vocab = 64;
    let prompt = [1u32, 2, 2];
    let adjust = LogitsAdjust {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        repetition_penalty: 1.3,
        logit_bias: vec![(9, 3.0), (10, -100.0)],
        min_tokens: 2,
        min_tokens_banned: vec![0],
    };
    let mut s = adjusted(true, adjust.clone());
    s.begin(&prompt);
    let mut generated: Vec<u32> = Vec::new();
    for i in 0..12u64 {
        let mut r = row(i as u32 + 5, vocab);
        // Token 0 is the best of every row: it is only banned while min_tokens holds.
        r[0] = 50.0;
        let mut want = r.clone();
        for &(id, b) in &adjust.logit_bias {
            want[id as usize] += b;
        }
        if generated.len() < adjust.min_tokens {
            want[0] = f32::NEG_INFINITY;
        }
        for id in 0..vocab as u32 {
            let seen = prompt.contains(&id) || generated.contains(&id);
            let l = &mut want[id as usize];
            if seen {
                *l = if *l > 0.0 { *l / 1.3 } else { *l * 1.3 };
            }
            let count = generated.iter().filter(|&&t| t == id).count();
            if count > 0 {
                *l -= 0.25 * count as f32;
                *l -= 0.5;
            }
        }
        let t = s
            .sample(&r, (prompt.len() + generated.len()) as u64)
            .unwrap();
        assert_eq!(t, argmax(&want), "step {i}");
        generated.push(t);
    }
    assert_ne!(generated[0], 0);
    assert_ne!(generated[1], 0);
    assert_eq!(generated[2], 0, "no longer banned");
}

#[test]
fn verification_with_penalties_equals_plain_sampling() {
    let vocab = 40;
    let adjust = LogitsAdjust {
        frequency_penalty: 1.5,
        ..LogitsAdjust::default()
    };
    let prompt = [1u32, 2];
    let rows: Vec<Vec<f32>> = (0..6).map(|i| row(i, vocab)).collect();
    let mut plain = adjusted(false, adjust.clone());
    plain.begin(&prompt);
    let tokens: Vec<u32> = (0..6u64)
        .map(|i| plain.sample(&rows[i as usize], 2 + i).unwrap())
        .collect();
    // Verify the first token's continuation with the right drafts, then a wrong one.
    let mut v = adjusted(false, adjust);
    v.begin(&prompt);
    assert_eq!(v.sample(&rows[0], 2).unwrap(), tokens[0]);
    let flat: Vec<f32> = rows[1..4].concat();
    let mut out = Vec::new();
    v.verify(&flat, vocab, &[tokens[1], tokens[2]], 3, &mut out)
        .unwrap();
    assert_eq!(out, tokens[1..4]);
    out.clear();
    let wrong = (tokens[4] + 1) % vocab as u32;
    let flat: Vec<f32> = rows[4..6].concat();
    v.verify(&flat, vocab, &[wrong], 6, &mut out).unwrap();
    assert_eq!(out, [tokens[4]]);
    assert_eq!(v.sample(&rows[5], 7).unwrap(), tokens[5]);
}

#[test]
fn adjustments_are_validated() {
    let bad = [
        LogitsAdjust {
            presence_penalty: 2.5,
            ..LogitsAdjust::default()
        },
        LogitsAdjust {
            repetition_penalty: 0.0,
            ..LogitsAdjust::default()
        },
        LogitsAdjust {
            logit_bias: vec![(1, 101.0)],
            ..LogitsAdjust::default()
        },
        LogitsAdjust {
            logit_bias: vec![(1, 1.0), (1, 2.0)],
            ..LogitsAdjust::default()
        },
    ];
    for a in bad {
        let p = SamplingParams {
            adjust: a,
            ..SamplingParams::default()
        };
        assert!(Sampler::new(p).is_err());
    }
    let mut s = adjusted(
        true,
        LogitsAdjust {
            logit_bias: vec![(99, 1.0)],
            ..LogitsAdjust::default()
        },
    );
    s.begin(&[1]);
    assert!(
        s.sample(&row(0, 50), 1).is_err(),
        "an id outside the vocabulary"
    );
    // A draw whose predecessors the sampler never saw is refused, not guessed.
    assert!(s.sample(&row(0, 200), 5).is_err());
}

#[test]
fn a_mask_applies_to_the_adjusted_row() {
    // The bias makes token 0 the best; the mask excludes it, so greedy takes the best of
    // the allowed adjusted row. min_tokens excluding the only allowed token (EOS) is an
    // error, not a draw from an empty row.
    let bias = LogitsAdjust {
        logit_bias: vec![(0, 100.0)],
        ..LogitsAdjust::default()
    };
    let mut s = adjusted(true, bias);
    s.begin(&[1]);
    assert_eq!(
        s.sample_masked(&[1.0, 5.0, 3.0, 4.0], &[0b1010], 1)
            .unwrap(),
        1
    );
    let bias = LogitsAdjust {
        logit_bias: vec![(3, 10.0)],
        ..LogitsAdjust::default()
    };
    let mut s = adjusted(true, bias);
    s.begin(&[1]);
    assert_eq!(
        s.sample_masked(&[1.0, 5.0, 3.0, 4.0], &[0b1010], 1)
            .unwrap(),
        3
    );
    let ban = LogitsAdjust {
        min_tokens: 2,
        min_tokens_banned: vec![1],
        ..LogitsAdjust::default()
    };
    let mut s = adjusted(true, ban);
    s.begin(&[1]);
    let err = s
        .sample_masked(&[1.0, 5.0, 3.0, 4.0], &[0b0010], 1)
        .unwrap_err();
    assert!(err.0.contains("allows no token"), "{err}");
}
