//! The engine's invariants on the synthetic model: one request through the engine equals a
//! plain decoding loop; batched equals alone (joins, leaves, mixed lengths, greedy and
//! seeded); cache on equals off; speculative equals plain greedy; bounds and cancellation.

use std::sync::{Arc, Mutex};

use super::*;
use crate::model::testing::{tiny_weights, tiny_weights_with};
use crate::model::{
    argmax, token_logprobs, ChunkInput, LlamaWeights, LogitsAdjust, LogitsWanted,
    NativeLlamaPipeline, Precision, RangeSession, SamplingParams, SessionConfig, TokenLogprobs,
};
use crate::ring::SpanType;
use crate::volume::{CacheConfig, VolumeKey};

fn session_cfg() -> SessionConfig {
    SessionConfig {
        slots: 256,
        recall: 16,
        n_sys: 0,
        max_chunk: 32,
    }
}

fn executor(w: &Arc<LlamaWeights>) -> LocalExecutor {
    let pipeline = NativeLlamaPipeline::new(Arc::clone(w), 0, 3, CacheConfig::default()).unwrap();
    LocalExecutor::new(Arc::new(Mutex::new(pipeline)), session_cfg(), 4).unwrap()
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 11 + salt * 17 + 3) % 96)
        .collect()
}

/// What one sequence produced.
#[derive(Clone, Debug, Default, PartialEq)]
struct Output {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    logprobs: Vec<TokenLogprobs>,
    prompt_logprobs: Option<Vec<TokenLogprobs>>,
    reason: Option<FinishReason>,
    stats: SeqStats,
}

/// Runs the engine until every sequence finishes; returns each one's output.
fn drain(engine: &mut Engine, ex: &mut LocalExecutor) -> std::collections::HashMap<SeqId, Output> {
    let fresh = Engine::new(engine.config().clone()).unwrap();
    let shared = Mutex::new(std::mem::replace(engine, fresh));
    let mut outs: std::collections::HashMap<SeqId, Output> = Default::default();
    let mut steps = 0;
    while shared.lock().unwrap().has_work() {
        steps += 1;
        assert!(steps < 10_000, "the engine does not make progress");
        for ev in step(&shared, ex) {
            match ev {
                Event::Token {
                    seq,
                    token,
                    logits,
                    logprobs,
                    ..
                } => {
                    let o = outs.entry(seq).or_default();
                    o.tokens.push(token);
                    o.logits.extend(logits);
                    o.logprobs.extend(logprobs);
                }
                Event::Prompt { seq, logprobs } => {
                    let o = outs.entry(seq).or_default();
                    assert!(o.tokens.is_empty(), "the prompt's event comes first");
                    assert!(o.prompt_logprobs.is_none(), "one prompt event");
                    o.prompt_logprobs = Some(logprobs);
                }
                Event::Finished { seq, reason, stats } => {
                    let o = outs.entry(seq).or_default();
                    o.reason = Some(reason);
                    o.stats = stats;
                }
            }
        }
    }
    *engine = shared.into_inner().unwrap();
    outs
}

fn run_one(w: &Arc<LlamaWeights>, req: Request) -> Output {
    let mut engine = Engine::new(EngineConfig::default()).unwrap();
    let mut ex = executor(w);
    let id = engine.submit(req).unwrap();
    drain(&mut engine, &mut ex).remove(&id).unwrap()
}

fn request(prompt: Vec<u32>, max_new: usize, sampling: SamplingParams) -> Request {
    Request {
        sampling,
        use_cache: false,
        want_logits: true,
        ..Request::greedy(prompt, max_new)
    }
}

/// `r` with the volume cache on.
fn cached(r: Request) -> Request {
    Request {
        use_cache: true,
        ..r
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        greedy: false,
        temperature: 0.8,
        top_k: 0,
        top_p: 0.95,
        seed,
        ..SamplingParams::default()
    }
}

/// The reference: a plain loop over one session (prefill, then one token at a time).
fn plain_greedy(
    w: &Arc<LlamaWeights>,
    prompt: &[u32],
    max_new: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut s = RangeSession::new(Arc::clone(w), 0, 3, &session_cfg()).unwrap();
    let (mut h, mut l) = (Vec::new(), Vec::new());
    s.forward(
        ChunkInput::Tokens(prompt),
        SpanType::User,
        LogitsWanted::Last,
        &mut h,
        &mut l,
    )
    .unwrap();
    let mut tokens = Vec::new();
    let mut logits = Vec::new();
    for _ in 0..max_new {
        let t = argmax(&l);
        tokens.push(t);
        logits.push(l.clone());
        s.forward(
            ChunkInput::Tokens(&[t]),
            SpanType::ResponseSentence,
            LogitsWanted::Last,
            &mut h,
            &mut l,
        )
        .unwrap();
    }
    (tokens, logits)
}

/// Runs `reqs` together through one engine shaped by `cfg` and checks that every request's
/// tokens and logits equal the same request run alone (`label` names the case); returns the
/// executor, for checks of what it still holds.
fn assert_batched_equals_alone(
    w: &Arc<LlamaWeights>,
    reqs: &[Request],
    cfg: EngineConfig,
    label: &str,
) -> LocalExecutor {
    let alone: Vec<Output> = reqs.iter().map(|r| run_one(w, r.clone())).collect();
    let mut engine = Engine::new(cfg).unwrap();
    let mut ex = executor(w);
    let ids: Vec<SeqId> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    let mut outs = drain(&mut engine, &mut ex);
    for (i, id) in ids.iter().enumerate() {
        let got = outs.remove(id).unwrap();
        assert_eq!(got.tokens, alone[i].tokens, "{label}request {i}: tokens");
        assert!(got.logits == alone[i].logits, "{label}request {i}: logits");
        assert!(
            got.logprobs == alone[i].logprobs,
            "{label}request {i}: logprobs"
        );
        assert!(
            got.prompt_logprobs == alone[i].prompt_logprobs,
            "{label}request {i}: prompt logprobs"
        );
    }
    ex
}

#[test]
fn one_request_equals_a_plain_decoding_loop() {
    for precision in [Precision::Refined, Precision::Fast] {
        let w = tiny_weights_with(31, precision);
        let p = prompt(45, 1);
        let out = run_one(&w, request(p.clone(), 12, SamplingParams::default()));
        let (tokens, logits) = plain_greedy(&w, &p, 12);
        assert_eq!(out.tokens, tokens);
        assert!(out.logits == logits, "logits differ ({precision:?})");
        assert_eq!(out.reason, Some(FinishReason::Length));
        assert_eq!(out.stats.output_tokens, 12);
    }
}

#[test]
fn batched_requests_equal_each_request_alone() {
    let w = tiny_weights(32);
    let reqs: Vec<Request> = (0..7)
        .map(|i| {
            let sampling = if i % 2 == 0 {
                SamplingParams::default()
            } else {
                seeded(i as u64)
            };
            request(prompt(5 + 13 * i, i as u32), 3 + 2 * i, sampling)
        })
        .collect();
    // Three running at a time with a small step budget: later requests join while earlier
    // ones decode, prompts are chunked across steps, and sequences leave at different times.
    let cfg = EngineConfig {
        max_running: 3,
        max_queue: 16,
        step_tokens: 20,
        ..EngineConfig::default()
    };
    let ex = assert_batched_equals_alone(&w, &reqs, cfg, "");
    assert_eq!(ex.live(), 0, "every sequence's KV was released");
}

#[test]
fn cache_on_equals_cache_off_and_skips_prefill() {
    let w = tiny_weights(33);
    let p = prompt(40, 3);
    let cold = run_one(&w, request(p.clone(), 8, SamplingParams::default()));
    let mut engine = Engine::new(EngineConfig::default()).unwrap();
    let mut ex = executor(&w);
    let a = engine
        .submit(cached(request(p.clone(), 8, SamplingParams::default())))
        .unwrap();
    let first = drain(&mut engine, &mut ex).remove(&a).unwrap();
    let b = engine
        .submit(cached(request(p.clone(), 8, SamplingParams::default())))
        .unwrap();
    let second = drain(&mut engine, &mut ex).remove(&b).unwrap();
    assert!(!first.stats.cache_hit && second.stats.cache_hit);
    assert_eq!(second.stats.cached_tokens, p.len());
    assert_eq!(first.tokens, cold.tokens);
    assert_eq!(second.tokens, cold.tokens);
    assert!(
        second.logits == cold.logits,
        "a replayed prompt gives the same logits"
    );
    // Longest-prefix reuse: a longer prompt sharing the first 40 tokens.
    let mut longer = p.clone();
    longer.extend(prompt(9, 4));
    let c = engine
        .submit(cached(request(
            longer.clone(),
            6,
            SamplingParams::default(),
        )))
        .unwrap();
    let partial = drain(&mut engine, &mut ex).remove(&c).unwrap();
    assert_eq!(partial.stats.cached_tokens, p.len());
    assert!(!partial.stats.cache_hit);
    let reference = run_one(&w, request(longer, 6, SamplingParams::default()));
    assert_eq!(partial.tokens, reference.tokens);
    assert!(partial.logits == reference.logits);
}

/// A prompt's volume is captured after its first token is handed out (off the time to
/// first token), yet before anything else can look for it: a request admitted while the
/// first still decodes replays it whole.
#[test]
fn a_volume_is_captured_before_the_next_admission() {
    let w = tiny_weights(38);
    let p = prompt(40, 5);
    let mut engine = Engine::new(EngineConfig::default()).unwrap();
    let mut ex = executor(&w);
    let cached = || cached(request(p.clone(), 12, SamplingParams::default()));
    let a = engine.submit(cached()).unwrap();
    let shared = Mutex::new(engine);
    let mut first_steps = 0;
    while !step(&shared, &mut ex)
        .iter()
        .any(|ev| matches!(ev, Event::Token { seq, .. } if *seq == a))
    {
        first_steps += 1;
        assert!(first_steps < 100, "no first token");
    }
    assert_eq!(
        ex.pipeline().cache().stats().captures,
        0,
        "not captured yet"
    );
    let mut engine = shared.into_inner().unwrap();
    let b = engine.submit(cached()).unwrap();
    let mut outs = drain(&mut engine, &mut ex);
    let (first, second) = (outs.remove(&a).unwrap(), outs.remove(&b).unwrap());
    assert!(second.stats.cache_hit);
    assert_eq!(second.stats.cached_tokens, p.len());
    assert_eq!(first.tokens[..], second.tokens[1..]);
    assert_eq!(ex.pipeline().cache().stats().captures, 1);
}

#[test]
fn a_prompt_longer_than_the_longest_prefix_caches_its_head() {
    let w = tiny_weights(34);
    let max = 24;
    let pipeline = NativeLlamaPipeline::new(
        Arc::clone(&w),
        0,
        3,
        CacheConfig {
            max_prefix_len: max,
            ..CacheConfig::default()
        },
    )
    .unwrap();
    let mut ex = LocalExecutor::new(Arc::new(Mutex::new(pipeline)), session_cfg(), 4).unwrap();
    // Chunks of 10 tokens: position 23 ends no chunk, so the head is cut from a middle one.
    let mut engine = Engine::new(EngineConfig {
        step_tokens: 10,
        ..EngineConfig::default()
    })
    .unwrap();
    let mut run = |p: &[u32]| {
        let r = cached(request(p.to_vec(), 5, SamplingParams::default()));
        let id = engine.submit(r).unwrap();
        drain(&mut engine, &mut ex).remove(&id).unwrap()
    };
    let long = prompt(40, 5);
    let first = run(&long);
    assert_eq!(first.stats.cached_tokens, 0);
    // Another prompt sharing more than the head: the head is replayed, the rest prefilled.
    let mut other = long[..30].to_vec();
    other.extend(prompt(12, 6));
    let shared = run(&other);
    assert_eq!(shared.stats.cached_tokens, max);
    // The head itself: its volume has no logits, so its last position runs again.
    let head = run(&long[..max]);
    assert_eq!(head.stats.cached_tokens, max - 1);
    assert!(!head.stats.cache_hit);
    for (p, got) in [
        (&long[..], &first),
        (&other[..], &shared),
        (&long[..max], &head),
    ] {
        let cold = run_one(&w, request(p.to_vec(), 5, SamplingParams::default()));
        assert_eq!(got.tokens, cold.tokens, "{}-token prompt: tokens", p.len());
        assert!(
            got.logits == cold.logits,
            "{}-token prompt: logits",
            p.len()
        );
    }
}

/// A prompt made of a repeated phrase: prompt lookup has plenty to propose.
fn copy_heavy_prompt() -> Vec<u32> {
    let phrase = prompt(12, 9);
    phrase.iter().cycle().take(60).copied().collect()
}

#[test]
fn speculative_greedy_equals_plain_greedy_tokens_and_logits() {
    let w = tiny_weights(34);
    for p in [copy_heavy_prompt(), prompt(30, 5)] {
        let plain = run_one(&w, request(p.clone(), 40, SamplingParams::default()));
        let spec = run_one(
            &w,
            Request {
                draft: Some(DraftConfig::default()),
                ..request(p.clone(), 40, SamplingParams::default())
            },
        );
        assert_eq!(spec.tokens, plain.tokens);
        assert!(spec.logits == plain.logits, "speculation changed a logit");
        assert!(spec.stats.draft_proposed >= spec.stats.draft_accepted);
    }
    // On the copy-heavy prompt the drafts are used.
    let spec = run_one(
        &w,
        Request {
            draft: Some(DraftConfig::default()),
            ..request(copy_heavy_prompt(), 40, SamplingParams::default())
        },
    );
    assert!(spec.stats.draft_accepted > 0, "{:?}", spec.stats);
    assert!(
        spec.stats.verify_steps < 39,
        "fewer steps than tokens: {:?}",
        spec.stats
    );
}

#[test]
fn speculation_in_a_batch_with_sampled_and_plain_neighbours() {
    let w = tiny_weights(35);
    let spec = |p: Vec<u32>, s: SamplingParams| Request {
        draft: Some(DraftConfig::default()),
        ..request(p, 24, s)
    };
    let reqs = vec![
        spec(copy_heavy_prompt(), SamplingParams::default()),
        request(prompt(20, 6), 24, seeded(3)),
        spec(prompt(33, 7), seeded(4)),
    ];
    assert_batched_equals_alone(&w, &reqs, EngineConfig::default(), "");
}

#[test]
fn a_volume_captured_with_speculation_is_byte_identical() {
    let w = tiny_weights(36);
    let p = copy_heavy_prompt();
    let volume_of = |draft: Option<DraftConfig>| {
        let mut engine = Engine::new(EngineConfig::default()).unwrap();
        let mut ex = executor(&w);
        let req = cached(Request {
            draft,
            ..request(p.clone(), 30, SamplingParams::default())
        });
        engine.submit(req).unwrap();
        drain(&mut engine, &mut ex);
        let key = VolumeKey {
            model_fingerprint: w.fingerprint(),
            tokens: &p,
            layer_lo: 0,
            layer_hi: 3,
            salt: None,
        };
        let vol = ex.pipeline().cache_mut().replay(&key).unwrap().unwrap();
        (
            vol.kv_keys().to_vec(),
            vol.kv_vals().to_vec(),
            vol.tail().map(<[f32]>::to_vec),
            vol.logits().map(<[f32]>::to_vec),
        )
    };
    let plain = volume_of(None);
    let spec = volume_of(Some(DraftConfig::default()));
    assert!(plain == spec);
}

#[test]
fn stop_ids_zero_tokens_and_bad_prompts() {
    let w = tiny_weights(37);
    let p = prompt(20, 8);
    let (greedy, _) = plain_greedy(&w, &p, 10);
    let stop = greedy[4];
    let first_stop = greedy.iter().position(|&t| t == stop).unwrap();
    let out = run_one(
        &w,
        Request {
            stop_ids: vec![stop],
            ..request(p.clone(), 10, SamplingParams::default())
        },
    );
    assert_eq!(out.tokens, greedy[..=first_stop]);
    assert_eq!(out.reason, Some(FinishReason::Stop));
    let none = run_one(&w, request(p.clone(), 0, SamplingParams::default()));
    assert!(none.tokens.is_empty());
    assert_eq!(none.reason, Some(FinishReason::Length));
    let bad = run_one(&w, request(vec![1, 2, 500], 4, SamplingParams::default()));
    assert!(matches!(bad.reason, Some(FinishReason::Error(ref m)) if m.contains("500")));
    let mut engine = Engine::new(EngineConfig::default()).unwrap();
    assert!(matches!(
        engine.submit(request(Vec::new(), 4, SamplingParams::default())),
        Err(EngineError::Input(_))
    ));
    assert!(
        !engine.has_work(),
        "a refused request leaves nothing behind"
    );
}

#[test]
fn a_full_queue_refuses_and_cancellation_frees_the_kv() {
    let w = tiny_weights(38);
    let cfg = EngineConfig {
        max_running: 1,
        max_queue: 2,
        step_tokens: 8,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(cfg).unwrap();
    let mut ex = executor(&w);
    let a = engine
        .submit(request(prompt(10, 1), 50, SamplingParams::default()))
        .unwrap();
    let b = engine
        .submit(request(prompt(10, 2), 5, SamplingParams::default()))
        .unwrap();
    let err = engine.submit(request(prompt(10, 3), 5, SamplingParams::default()));
    assert!(matches!(err, Err(EngineError::QueueFull { .. })));
    let shared = Mutex::new(engine);
    for _ in 0..4 {
        step(&shared, &mut ex);
    }
    let mut engine = shared.into_inner().unwrap();
    assert_eq!(ex.live(), 1);
    assert!(matches!(
        engine.cancel(a),
        Some(Event::Finished {
            reason: FinishReason::Cancelled,
            ..
        })
    ));
    assert!(engine.cancel(a).is_none(), "cancelling twice is a no-op");
    let outs = drain(&mut engine, &mut ex);
    assert_eq!(
        outs[&b].tokens.len(),
        5,
        "the queued request runs after the cancel"
    );
    assert_eq!(ex.live(), 0);
}

#[test]
fn sequences_sharing_a_system_prompt_equal_each_alone() {
    // Requests with one 48-token system prompt and their own questions: batched, each reads
    // the system prompt's K/V from the first sequence's ring. Joins, leaves, chunked prefills
    // (the leader may still be prefilling what a follower has), greedy and seeded.
    for precision in [Precision::Refined, Precision::Fast] {
        let w = tiny_weights_with(33, precision);
        let system = prompt(48, 5);
        let reqs: Vec<Request> = (0..6)
            .map(|i| {
                let sampling = if i % 3 == 1 {
                    seeded(i as u64)
                } else {
                    SamplingParams::default()
                };
                let p = [system.clone(), prompt(1 + 4 * i, 20 + i as u32)].concat();
                request(p, 4 + 3 * i, sampling)
            })
            .collect();
        let cfg = EngineConfig {
            max_running: 4,
            max_queue: 16,
            step_tokens: 24,
            ..EngineConfig::default()
        };
        assert_batched_equals_alone(&w, &reqs, cfg, &format!("{precision:?} "));
    }
}

#[test]
fn step_totals_count_every_batch_and_its_rows() {
    let w = tiny_weights(41);
    let mut engine = Engine::new(EngineConfig {
        max_running: 4,
        max_queue: 16,
        step_tokens: 16,
        ..EngineConfig::default()
    })
    .unwrap();
    assert_eq!(engine.step_totals(), StepTotals::default());
    let mut ex = executor(&w);
    let prompts = [prompt(21, 1), prompt(5, 2)];
    let max_new = 6;
    for p in &prompts {
        engine
            .submit(request(p.clone(), max_new, SamplingParams::default()))
            .unwrap();
    }
    let outs = drain(&mut engine, &mut ex);
    let t = engine.step_totals();
    // Every prompt row is prefilled once (the cache is off); every token after a sequence's
    // first comes from one decode row (no drafts), 16 rows per step at most.
    let prompt_rows: usize = prompts.iter().map(Vec::len).sum();
    assert_eq!(t.prompt_rows, prompt_rows as u64);
    let emitted: usize = outs.values().map(|o| o.tokens.len()).sum();
    assert_eq!(emitted, prompts.len() * max_new);
    assert_eq!(t.decode_rows, (emitted - prompts.len()) as u64);
    assert!(t.steps * 16 >= t.prompt_rows + t.decode_rows);
    assert!(
        t.steps >= (max_new - 1) as u64,
        "one decode row per sequence and step"
    );
    assert!(t.busy_seconds > 0.0);
}

/// Log-probabilities are those of the rows the tokens were picked from, whoever shares the
/// batch, with or without speculation, and from a replayed volume's logits.
#[test]
fn logprobs_are_those_of_the_emitted_rows_batched_speculative_and_cached() {
    let w = tiny_weights(39);
    let with_logprobs = |n: usize, r: Request| Request {
        logprobs: Some(n),
        ..r
    };
    let p = copy_heavy_prompt();
    let plain = run_one(
        &w,
        with_logprobs(3, request(p.clone(), 20, SamplingParams::default())),
    );
    assert_eq!(plain.logprobs.len(), plain.tokens.len());
    for ((lp, row), &t) in plain.logprobs.iter().zip(&plain.logits).zip(&plain.tokens) {
        assert_eq!(*lp, token_logprobs(row, t, 3).unwrap());
        assert_eq!(lp.top[0].0, t, "greedy picks the likeliest token");
    }
    let spec = run_one(
        &w,
        with_logprobs(
            3,
            Request {
                draft: Some(DraftConfig::default()),
                ..request(p.clone(), 20, SamplingParams::default())
            },
        ),
    );
    assert!(spec.stats.draft_accepted > 0);
    assert!(
        spec.logprobs == plain.logprobs,
        "speculation changed a logprob"
    );
    let reqs = vec![
        with_logprobs(3, request(p.clone(), 20, SamplingParams::default())),
        with_logprobs(0, request(prompt(20, 6), 12, seeded(3))),
        request(prompt(25, 2), 12, SamplingParams::default()),
    ];
    assert_batched_equals_alone(&w, &reqs, EngineConfig::default(), "logprobs: ");
    let sampled = run_one(&w, reqs[1].clone());
    assert!(sampled.logprobs.iter().all(|lp| lp.top.is_empty()));
    assert!(run_one(&w, reqs[2].clone()).logprobs.is_empty());
    // An exact hit's first token comes from the volume's logits: the same values.
    let mut engine = Engine::new(EngineConfig::default()).unwrap();
    let mut ex = executor(&w);
    let cached = || {
        cached(with_logprobs(
            3,
            request(p.clone(), 6, SamplingParams::default()),
        ))
    };
    for _ in 0..2 {
        let id = engine.submit(cached()).unwrap();
        let out = drain(&mut engine, &mut ex).remove(&id).unwrap();
        assert!(out.logprobs[..] == plain.logprobs[..6]);
    }
    assert_eq!(ex.pipeline().cache().stats().hits, 1);
    // Too many alternatives: refused, nothing queued.
    let err = engine
        .submit(with_logprobs(21, request(p, 4, SamplingParams::default())))
        .unwrap_err();
    assert!(matches!(err, EngineError::Input(_)), "{err:?}");
    assert_eq!(engine.waiting(), 0);
}

/// Prompt log-probabilities are those of one session's logits rows over the whole prompt
/// (each row scoring the prompt token after it): in 32-row chunks or whole, batched or
/// alone, with no tokens asked for, and with a volume of the prompt in the cache (which is
/// then not replayed). They come in one event, before the first token.
#[test]
fn prompt_logprobs_are_those_of_every_prompt_row() {
    let w = tiny_weights(41);
    let vocab = w.config().vocab;
    let p = prompt(75, 4);
    let mut s = RangeSession::new(Arc::clone(&w), 0, 3, &session_cfg()).unwrap();
    let mut rows = Vec::new();
    for chunk in p.chunks(25) {
        let (mut h, mut l) = (Vec::new(), Vec::new());
        s.forward(
            ChunkInput::Tokens(chunk),
            SpanType::User,
            LogitsWanted::All,
            &mut h,
            &mut l,
        )
        .unwrap();
        rows.extend(l);
    }
    let expected: Vec<TokenLogprobs> = (1..p.len())
        .map(|i| token_logprobs(&rows[(i - 1) * vocab..i * vocab], p[i], 2).unwrap())
        .collect();
    let with_prompt = |max_new: usize, p: Vec<u32>| Request {
        prompt_logprobs: Some(2),
        ..request(p, max_new, SamplingParams::default())
    };
    let out = run_one(&w, with_prompt(5, p.clone()));
    assert!(out.prompt_logprobs.as_ref() == Some(&expected));
    let (tokens, logits) = plain_greedy(&w, &p, 5);
    assert_eq!(out.tokens, tokens, "asking for them changes no token");
    assert!(out.logits == logits);
    let scoring_only = run_one(&w, with_prompt(0, p.clone()));
    assert!(scoring_only.prompt_logprobs.as_ref() == Some(&expected));
    assert!(scoring_only.tokens.is_empty());
    assert_eq!(scoring_only.reason, Some(FinishReason::Length));
    assert_eq!(
        run_one(&w, request(p.clone(), 3, SamplingParams::default())).prompt_logprobs,
        None
    );
    let one_token = run_one(&w, with_prompt(2, vec![5]));
    assert!(
        one_token.prompt_logprobs == Some(Vec::new()),
        "nothing before the first token"
    );
    let reqs = vec![
        with_prompt(6, p.clone()),
        request(prompt(40, 1), 9, seeded(5)),
        with_prompt(0, prompt(50, 2)),
        with_prompt(4, prompt(20, 3)),
    ];
    assert_batched_equals_alone(&w, &reqs, EngineConfig::default(), "prompt logprobs: ");
    // Scored in chunks of 5 rows, against 32 alone: the same values.
    let small = EngineConfig {
        scored_rows: 5,
        ..EngineConfig::default()
    };
    assert_batched_equals_alone(&w, &reqs, small, "5-row scored chunks: ");
    // A cached prompt: the volume is not replayed, every row is computed again.
    let mut engine = Engine::new(EngineConfig::default()).unwrap();
    let mut ex = executor(&w);
    let id = engine
        .submit(cached(request(p.clone(), 2, SamplingParams::default())))
        .unwrap();
    drain(&mut engine, &mut ex).remove(&id).unwrap();
    let id = engine.submit(cached(with_prompt(5, p.clone()))).unwrap();
    let again = drain(&mut engine, &mut ex).remove(&id).unwrap();
    assert!(again.prompt_logprobs.as_ref() == Some(&expected));
    assert_eq!(again.tokens, tokens);
    assert_eq!(again.stats.cached_tokens, 0);
    assert_eq!(ex.pipeline().cache().stats().hits, 0);
    // Too many alternatives: refused, nothing queued.
    let err = engine
        .submit(Request {
            prompt_logprobs: Some(21),
            ..request(p, 1, SamplingParams::default())
        })
        .unwrap_err();
    assert!(matches!(err, EngineError::Input(_)), "{err:?}");
    assert_eq!(engine.waiting(), 0);
}

#[test]
fn scored_chunks_keep_at_most_32_mib_of_logits() {
    assert_eq!(EngineConfig::scored_rows_for(49_152), 170);
    assert_eq!(EngineConfig::scored_rows_for(262_144), 32);
    assert_eq!(EngineConfig::scored_rows_for(96), 256);
    assert_eq!(EngineConfig::scored_rows_for(10_000_000), 8);
    let err = Engine::new(EngineConfig {
        scored_rows: 0,
        ..EngineConfig::default()
    })
    .unwrap_err();
    assert!(matches!(err, EngineError::Input(_)), "{err:?}");
}

fn penalised(seed: Option<u64>) -> SamplingParams {
    SamplingParams {
        adjust: LogitsAdjust {
            presence_penalty: 0.6,
            frequency_penalty: 0.9,
            repetition_penalty: 1.4,
            logit_bias: vec![(3, 2.5), (7, -4.0)],
            min_tokens: 6,
            min_tokens_banned: Vec::new(),
        },
        ..seed.map_or_else(SamplingParams::default, seeded)
    }
}

#[test]
fn adjusted_sampling_batched_speculative_and_cached_equals_alone() {
    let w = tiny_weights(38);
    let spec = |r: Request| Request {
        draft: Some(DraftConfig::default()),
        ..r
    };
    let reqs = vec![
        request(copy_heavy_prompt(), 20, penalised(None)),
        spec(request(copy_heavy_prompt(), 20, penalised(None))),
        spec(request(prompt(30, 9), 20, penalised(Some(5)))),
        request(prompt(24, 3), 20, seeded(6)),
        cached(request(prompt(30, 9), 20, penalised(Some(5)))),
    ];
    assert_batched_equals_alone(&w, &reqs, EngineConfig::default(), "adjusted: ");
    // The adjustments change the tokens.
    let plain = run_one(
        &w,
        request(copy_heavy_prompt(), 20, SamplingParams::default()),
    );
    let adjusted = run_one(&w, request(copy_heavy_prompt(), 20, penalised(None)));
    assert_ne!(plain.tokens, adjusted.tokens);
}

#[test]
fn min_tokens_holds_back_the_stop_ids() {
    let w = tiny_weights(39);
    let p = prompt(20, 8);
    let (greedy, _) = plain_greedy(&w, &p, 10);
    let stop = greedy[1];
    let held = run_one(
        &w,
        Request {
            stop_ids: vec![stop],
            ..request(p.clone(), 10, penalised(None))
        },
    );
    assert!(held.tokens[..6].iter().all(|&t| t != stop));
    let too_many = Request {
        sampling: SamplingParams {
            adjust: LogitsAdjust {
                min_tokens: 11,
                ..LogitsAdjust::default()
            },
            ..SamplingParams::default()
        },
        ..request(p, 10, SamplingParams::default())
    };
    let mut engine = Engine::new(EngineConfig::default()).unwrap();
    assert!(matches!(
        engine.submit(too_many),
        Err(EngineError::Input(_))
    ));
}

#[test]
fn followers_replay_their_leaders_prompt_and_equal_their_solo_runs() {
    let w = tiny_weights(40);
    let p = prompt(40, 12);
    let choices: Vec<Request> = (0..4)
        .map(|i| cached(request(p.clone(), 12, seeded(100 + i))))
        .collect();
    let alone: Vec<Output> = choices
        .iter()
        .map(|r| {
            run_one(
                &w,
                Request {
                    use_cache: false,
                    ..r.clone()
                },
            )
        })
        .collect();
    let mut engine = Engine::new(EngineConfig::default()).unwrap();
    let mut ex = executor(&w);
    let leader = engine.submit(choices[0].clone()).unwrap();
    let ids: Vec<SeqId> = std::iter::once(leader)
        .chain(choices[1..].iter().map(|r| {
            let r = Request {
                follows: Some(leader),
                ..r.clone()
            };
            engine.submit(r).unwrap()
        }))
        .collect();
    let mut outs = drain(&mut engine, &mut ex);
    for (i, id) in ids.iter().enumerate() {
        let got = outs.remove(id).unwrap();
        assert_eq!(got.tokens, alone[i].tokens, "choice {i}");
        assert!(got.logits == alone[i].logits, "choice {i}: logits");
        let replayed = if i == 0 { 0 } else { p.len() };
        assert_eq!(got.stats.cached_tokens, replayed, "choice {i}");
    }
}
