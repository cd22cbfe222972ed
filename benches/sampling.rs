//! What picking one token costs on a SmolLM2-sized row (49,152 logits, peaked like a language
//! model's: Zipf-like in a shuffled order), per sampling mode, and what its log-probabilities
//! cost: greedy (the argmax pass: the baseline), temperature, temperature + top-p 0.9,
//! top-k 40, and `token_logprobs` with 0 and 20 alternatives. A continuous-batching step
//! pays this once per sequence, on one thread, after the forward pass.
//!
//! After criterion finishes, the medians of this run are printed with their ratio to greedy.
//!
//! Run: `cargo bench --bench sampling`

use std::hint::black_box;
use std::time::SystemTime;

use amplituhedron::model::{token_logprobs, Sampler, SamplingParams};
use criterion::Criterion;

mod common;
use common::median_ns;

const VOCAB: usize = 49_152;

/// Logits `8 − 1.3·ln(1 + rank)` with ranks shuffled over the ids (a fixed LCG), plus a
/// small deterministic jitter so no two are equal.
fn peaked_row() -> Vec<f32> {
    let mut ranks: Vec<usize> = (0..VOCAB).collect();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for i in (1..VOCAB).rev() {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        ranks.swap(i, (state >> 33) as usize % (i + 1));
    }
    ranks
        .iter()
        .enumerate()
        .map(|(i, &r)| 8.0 - 1.3 * (1.0 + r as f32).ln() + (i % 97) as f32 * 1e-6)
        .collect()
}

fn modes() -> Vec<(&'static str, SamplingParams)> {
    let sampled = |temperature, top_k, top_p| SamplingParams {
        greedy: false,
        temperature,
        top_k,
        top_p,
        seed: 7,
        ..SamplingParams::default()
    };
    vec![
        ("greedy", SamplingParams::default()),
        ("temperature_0.7", sampled(0.7, 0, 1.0)),
        ("temperature_0.7_top_p_0.9", sampled(0.7, 0, 0.9)),
        ("top_k_40", sampled(1.0, 40, 1.0)),
    ]
}

fn bench_sampling(c: &mut Criterion) {
    let row = peaked_row();
    let mut g = c.benchmark_group("sampling");
    for (name, params) in modes() {
        let mut s = Sampler::new(params).unwrap();
        let mut index = 0u64;
        g.bench_function(name, |b| {
            b.iter(|| {
                index += 1;
                black_box(s.sample(black_box(&row), index).unwrap())
            })
        });
    }
    for top in [0usize, 20] {
        g.bench_function(format!("logprobs_top_{top}"), |b| {
            b.iter(|| black_box(token_logprobs(black_box(&row), 17, top).unwrap()))
        });
    }
    g.finish();
}

fn summary(since: SystemTime) {
    let names: Vec<String> = modes()
        .iter()
        .map(|(n, _)| n.to_string())
        .chain(["logprobs_top_0".into(), "logprobs_top_20".into()])
        .collect();
    let base = median_ns(&["sampling", "greedy"], since);
    println!("\n==== sampling: medians of this run (49,152 logits) ====");
    for name in &names {
        match (median_ns(&["sampling", name], since), base) {
            (Some(t), Some(g)) => {
                println!("  {name:<28} {:>8.1} µs  {:>6.1}× greedy", t / 1e3, t / g)
            }
            (Some(t), None) => println!("  {name:<28} {:>8.1} µs", t / 1e3),
            _ => println!("  {name:<28} n/a"),
        }
    }
}

fn main() {
    let since = SystemTime::now();
    let mut c = Criterion::default().configure_from_args();
    bench_sampling(&mut c);
    c.final_summary();
    summary(since);
}
