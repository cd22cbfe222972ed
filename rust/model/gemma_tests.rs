//! The Gemma 3 recipe on a small synthetic model: the sliding window's exact semantics, and
//! every bit-exact invariant with sliding-window layers whose rings keep only their window
//! (chunked = whole, split ranges = one process, cache on = off, longest-prefix replay =
//! cold, rollback), plus the clean refusal of prefixes a sliding ring no longer holds.

use std::sync::Arc;

use super::testing::{synthetic_weights, tiny_gemma_config, tiny_gemma_weights, TINY_WINDOW};
use super::tests::{fwd, pipeline, prompt, session, Runner};
use super::*;
use crate::ring::{KvDtype, SpanType};
use crate::volume::CaptureOutcome;

/// `(hidden rows, logits rows)` of `tokens` through `s`, as one user span.
fn run(s: &mut RangeSession, tokens: &[u32], wanted: LogitsWanted) -> (Vec<f32>, Vec<f32>) {
    fwd(s, tokens, SpanType::User, wanted)
}

fn last_logits(w: &Arc<LlamaWeights>, tokens: &[u32]) -> Vec<f32> {
    run(
        &mut session(w, 0, w.config().n_layers, 64),
        tokens,
        LogitsWanted::Last,
    )
    .1
}

/// The local ring's slots: the window plus one span (256 − 16 recall = 240-slot global
/// window, so spans of 120).
const LOCAL_SLOTS: usize = TINY_WINDOW + 120;

#[test]
fn a_sliding_layer_sees_exactly_the_last_window_keys() {
    // One sliding layer: the key of position j depends on token j alone, so the output at p
    // depends on exactly the tokens p − window + 1 ..= p (llama.cpp: p1 − p0 < n_swa).
    let mut c = tiny_gemma_config();
    c.n_layers = 1;
    c.sliding.as_mut().unwrap().local = vec![true];
    let w = synthetic_weights(c, 31, Precision::Refined);
    let tokens = prompt(40, 1);
    let reference = last_logits(&w, &tokens);
    let oldest_seen = tokens.len() - TINY_WINDOW;
    let mut outside = tokens.clone();
    outside[oldest_seen - 1] = (outside[oldest_seen - 1] + 1) % 96;
    outside[0] = (outside[0] + 5) % 96;
    assert_eq!(
        last_logits(&w, &outside),
        reference,
        "a key outside the window leaked in"
    );
    let mut inside = tokens.clone();
    inside[oldest_seen] = (inside[oldest_seen] + 1) % 96;
    assert_ne!(
        last_logits(&w, &inside),
        reference,
        "the oldest key of the window is missing"
    );
}

#[test]
fn sliding_layers_keep_only_their_window() {
    let w = tiny_gemma_weights(1);
    let s = session(&w, 0, 4, 64);
    assert_eq!(
        s.kv_slots(),
        vec![LOCAL_SLOTS, LOCAL_SLOTS, LOCAL_SLOTS, 256]
    );
    // A range of sliding layers only has no global ring at all.
    assert_eq!(session(&w, 1, 3, 64).kv_slots(), vec![LOCAL_SLOTS; 2]);
}

#[test]
fn chunked_prefill_equals_whole_past_the_window() {
    let w = tiny_gemma_weights(2);
    // 300 positions wrap the 132-slot local ring twice.
    let tokens = prompt(300, 2);
    let whole = run(&mut session(&w, 0, 4, 256), &tokens, LogitsWanted::All).1;
    assert!(whole.iter().all(|v| v.is_finite()));
    for chunk in [1, 7, 64] {
        let got = run(&mut session(&w, 0, 4, chunk), &tokens, LogitsWanted::All).1;
        assert_eq!(got, whole, "chunk {chunk}");
    }
}

#[test]
fn split_ranges_equal_one_process() {
    let w = tiny_gemma_weights(3);
    let tokens = prompt(150, 3);
    let reference = run(&mut session(&w, 0, 4, 64), &tokens, LogitsWanted::All).1;
    for cuts in [[0, 1, 4].as_slice(), &[0, 3, 4], &[0, 2, 3, 4]] {
        let mut hidden = Vec::new();
        let mut logits = Vec::new();
        for pair in cuts.windows(2) {
            let (lo, hi) = (pair[0], pair[1]);
            let mut s = session(&w, lo, hi, 64);
            let wanted = if hi == 4 {
                LogitsWanted::All
            } else {
                LogitsWanted::None
            };
            let input = if lo == 0 {
                ChunkInput::Tokens(&tokens)
            } else {
                ChunkInput::Hidden(&hidden)
            };
            let (mut h, mut l) = (Vec::new(), Vec::new());
            s.forward(input, SpanType::User, wanted, &mut h, &mut l)
                .unwrap();
            hidden = h;
            logits = l;
        }
        assert_eq!(logits, reference, "cuts {cuts:?}");
    }
}

#[test]
fn cache_on_equals_cache_off_and_decoding_slides_past_the_window() {
    let w = tiny_gemma_weights(4);
    let tokens = prompt(100, 4);
    let mut r = Runner::new(&w);
    let cold = r.generate(&tokens, 24, false);
    let first = r.generate(&tokens, 24, true);
    let warm = r.generate(&tokens, 24, true);
    assert!(!first.cache_hit && warm.cache_hit);
    assert_eq!(warm.replayed_tokens, tokens.len());
    // 24 decoded tokens take the session past the local ring's 132 slots.
    assert_eq!(cold.output_ids, first.output_ids);
    assert_eq!(cold.output_ids, warm.output_ids);
}

#[test]
fn longest_prefix_replay_equals_a_cold_prefill() {
    let w = tiny_gemma_weights(5);
    let system = prompt(60, 5);
    let mut r = Runner::new(&w);
    r.generate(&system, 24, true);
    let mut question = system[..50].to_vec();
    question.extend(prompt(30, 9));
    let cold = r.generate(&question, 24, false);
    let warm = r.generate(&question, 24, true);
    assert_eq!(warm.replayed_tokens, 50);
    assert_eq!(warm.output_ids, cold.output_ids);
}

#[test]
fn a_prefix_the_sliding_ring_no_longer_holds_is_not_captured() {
    let w = tiny_gemma_weights(6);
    let mut p = pipeline(&w, 0, 4);
    p.amplituhedron_set_max_prefix_len(1024).unwrap();
    let hidden = w.config().hidden;
    // Longer than the local ring: its first positions are gone.
    let long = prompt(LOCAL_SLOTS + 10, 6);
    let mut s = session(&w, 0, 4, 64);
    let (h, l) = run(&mut s, &long, LogitsWanted::Last);
    let outcome = p
        .amplituhedron_capture(s.kv(), &long, &h[h.len() - hidden..], Some(&l), None)
        .unwrap();
    assert_eq!(
        outcome,
        CaptureOutcome::SkippedTooLong {
            prefix_len: long.len(),
            max: 0
        }
    );
    // A short prompt captured after decoding past the local ring: also gone.
    let short = prompt(100, 7);
    let mut s = session(&w, 0, 4, 64);
    let (h, l) = run(&mut s, &short, LogitsWanted::Last);
    for t in 0..40 {
        run(&mut s, &[t], LogitsWanted::Last);
    }
    let late = p
        .amplituhedron_capture(s.kv(), &short, &h[h.len() - hidden..], Some(&l), None)
        .unwrap();
    assert!(
        matches!(late, CaptureOutcome::SkippedTooLong { .. }),
        "{late:?}"
    );
    assert_eq!(p.amplituhedron_stats().entries, 0);
    // The same prompt captured in time is stored, and a replay of it is a full hit.
    let mut s = session(&w, 0, 4, 64);
    let (h, l) = run(&mut s, &short, LogitsWanted::Last);
    let stored = p
        .amplituhedron_capture(s.kv(), &short, &h[h.len() - hidden..], Some(&l), None)
        .unwrap();
    assert!(
        matches!(stored, CaptureOutcome::Stored { .. }),
        "{stored:?}"
    );
    let mut fresh = session(&w, 0, 4, 64);
    assert!(matches!(
        p.amplituhedron_replay(fresh.kv_mut(), &short, None)
            .unwrap(),
        ReplayOutcome::Hit { .. }
    ));
}

#[test]
fn probe_then_rollback_past_the_window_is_exact() {
    let w = tiny_gemma_weights(8);
    let tokens = prompt(200, 8);
    let mut probed = session(&w, 0, 4, 64);
    let mut plain = session(&w, 0, 4, 64);
    run(&mut probed, &tokens, LogitsWanted::None);
    run(&mut plain, &tokens, LogitsWanted::None);
    let saved = probed.clock();
    run(&mut probed, &prompt(9, 1), LogitsWanted::None);
    probed.rollback(saved).unwrap();
    assert_eq!(
        run(&mut probed, &[5], LogitsWanted::Last),
        run(&mut plain, &[5], LogitsWanted::Last)
    );
}

#[test]
fn a_batch_of_sequences_past_the_window_equals_each_alone() {
    let w = tiny_gemma_weights(9);
    let range = LayerRange::new(Arc::clone(&w), 0, 4).unwrap();
    let cfg = SessionConfig {
        slots: 256,
        recall: 16,
        n_sys: 0,
        max_chunk: 64,
    };
    // Prompts of different lengths, one far past the local ring, then decode steps.
    let prompts = [prompt(150, 1), prompt(9, 2), prompt(70, 3)];
    let alone: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| {
            let mut s = RangeSession::new(Arc::clone(&w), 0, 4, &cfg).unwrap();
            let mut l = run(&mut s, p, LogitsWanted::Last).1;
            for t in 0..5 {
                l.extend(run(&mut s, &[t], LogitsWanted::Last).1);
            }
            l
        })
        .collect();
    let mut kvs: Vec<SequenceKv> = (0..3).map(|_| range.new_kv(&cfg).unwrap()).collect();
    let mut got: Vec<Vec<f32>> = vec![Vec::new(); 3];
    let mut bufs = StepBuffers::new(w.config(), 1, 1);
    for step in 0..6u32 {
        let inputs: Vec<Vec<u32>> = (0..3)
            .map(|i| {
                if step == 0 {
                    prompts[i].clone()
                } else {
                    vec![step - 1]
                }
            })
            .collect();
        let mut outs: Vec<(Vec<f32>, Vec<f32>)> = vec![Default::default(); 3];
        let mut segments: Vec<Segment<'_>> = kvs
            .iter_mut()
            .zip(outs.iter_mut())
            .zip(&inputs)
            .map(|((kv, (h, l)), input)| Segment {
                kv,
                input: ChunkInput::Tokens(input),
                span: SpanType::User,
                logits: LogitsWanted::Last,
                hidden_out: h,
                logits_out: l,
                shared_prefix: None,
            })
            .collect();
        range.forward_batch(&mut segments, &mut bufs).unwrap();
        drop(segments);
        for (g, (_, l)) in got.iter_mut().zip(outs) {
            g.extend(l);
        }
    }
    assert_eq!(got, alone);
}

#[test]
fn qwen2_needs_its_biases_and_runs_with_them() {
    let mut c = super::testing::tiny_config();
    c.arch = Architecture::Qwen2;
    let w = synthetic_weights(c.clone(), 10, Precision::Refined);
    assert!(w.layer(0).unwrap().bq.is_some());
    let tokens = prompt(40, 10);
    let whole = run(&mut session(&w, 0, 3, 64), &tokens, LogitsWanted::All).1;
    assert_eq!(
        run(&mut session(&w, 0, 3, 5), &tokens, LogitsWanted::All).1,
        whole
    );
    // The same tensors read as Llama: the recipe (halves RoPE, biases) changes the logits.
    let mut llama = c;
    llama.arch = Architecture::Llama;
    let as_llama = synthetic_weights(llama, 10, Precision::Refined);
    assert_ne!(
        run(
            &mut session(&as_llama, 0, 3, 64),
            &tokens,
            LogitsWanted::All
        )
        .1,
        whole
    );
}

#[test]
fn a_tensor_the_recipe_needs_is_named_when_missing() {
    // A Llama file read with a Gemma 3 description: no Q/K norms.
    let mut c = tiny_gemma_config();
    c.arch = Architecture::Llama;
    c.sliding = None;
    let (bytes, table) = super::testing::synthetic_file(&c, 11);
    let err = LlamaWeights::from_bytes(
        bytes,
        tiny_gemma_config(),
        &table,
        Precision::Refined,
        KvDtype::default(),
    )
    .err()
    .expect("the Gemma recipe needs Q/K norms");
    assert!(
        err.to_string()
            .contains("missing tensor blk.0.attn_q_norm.weight"),
        "{err}"
    );
}
