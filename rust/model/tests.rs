//! The runtime's invariants on a small synthetic model in the real tensor formats:
//! chunked = unchunked, split ranges = one range, cache-on = cache-off, rollback exact,
//! erasure, bad input refused without side effects.

use std::sync::{Arc, Mutex, MutexGuard};

use super::testing::{tiny_config, tiny_weights, tiny_weights_with};
use super::*;
use crate::engine::{step, Engine, EngineConfig, Event, FinishReason, LocalExecutor, Request};
use crate::ring::SpanType;
use crate::volume::{CacheConfig, VolumeKey};

pub(super) fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7 + salt * 13 + 5) % 96)
        .collect()
}

pub(super) fn session(
    w: &Arc<LlamaWeights>,
    lo: usize,
    hi: usize,
    max_chunk: usize,
) -> RangeSession {
    let cfg = SessionConfig {
        slots: 256,
        recall: 16,
        n_sys: 0,
        max_chunk,
    };
    RangeSession::new(Arc::clone(w), lo, hi, &cfg).unwrap()
}

/// Runs token ids through a session; returns (hidden rows, logits rows).
pub(super) fn fwd(
    s: &mut RangeSession,
    tokens: &[u32],
    span: SpanType,
    wanted: LogitsWanted,
) -> (Vec<f32>, Vec<f32>) {
    let (mut h, mut l) = (Vec::new(), Vec::new());
    s.forward(ChunkInput::Tokens(tokens), span, wanted, &mut h, &mut l)
        .unwrap();
    (h, l)
}

/// Every ring's active-slot table (what attention reads).
fn ring_state(s: &RangeSession) -> Vec<Vec<u32>> {
    s.rings().all().map(|r| r.active_slots().to_vec()).collect()
}

/// Logits of every position, computed by one session over the whole model.
fn all_logits(s: &mut RangeSession, tokens: &[u32]) -> Vec<f32> {
    fwd(s, tokens, SpanType::User, LogitsWanted::All).1
}

#[test]
fn chunked_prefill_equals_unchunked_at_both_precisions() {
    for precision in [Precision::Refined, Precision::Fast] {
        chunked_prefill_equals_unchunked(&tiny_weights_with(1, precision));
    }
}

#[test]
fn precision_is_part_of_the_fingerprint_and_refined_is_closer_to_f32() {
    let refined = tiny_weights_with(12, Precision::Refined);
    let fast = tiny_weights_with(12, Precision::Fast);
    assert_ne!(refined.fingerprint(), fast.fingerprint());
    let tokens = prompt(24, 12);
    let a = all_logits(&mut session(&refined, 0, 3, 256), &tokens);
    let b = all_logits(&mut session(&fast, 0, 3, 256), &tokens);
    assert_ne!(a, b);
    assert!(a.iter().chain(&b).all(|v| v.is_finite()));
}

fn chunked_prefill_equals_unchunked(w: &Arc<LlamaWeights>) {
    let tokens = prompt(90, 1);
    let reference = all_logits(&mut session(w, 0, 3, 256), &tokens);
    for chunk in [1, 7, 64] {
        assert_eq!(
            all_logits(&mut session(w, 0, 3, chunk), &tokens),
            reference,
            "chunk {chunk}"
        );
    }
    // Feeding the prompt in uneven caller pieces changes nothing either.
    let mut s = session(w, 0, 3, 256);
    let mut got = Vec::new();
    for piece in tokens.chunks(13) {
        got.extend(fwd(&mut s, piece, SpanType::User, LogitsWanted::All).1);
    }
    assert_eq!(got, reference);
}

#[test]
fn split_ranges_equal_one_range() {
    let w = tiny_weights(2);
    let tokens = prompt(40, 2);
    let reference = all_logits(&mut session(&w, 0, 3, 256), &tokens);
    for cuts in [vec![0, 1, 3], vec![0, 2, 3], vec![0, 1, 2, 3]] {
        let mut hidden = Vec::new();
        let mut logits = Vec::new();
        for pair in cuts.windows(2) {
            let mut s = session(&w, pair[0], pair[1], 16);
            let input = if pair[0] == 0 {
                ChunkInput::Tokens(&tokens)
            } else {
                ChunkInput::Hidden(&hidden)
            };
            let wanted = if s.is_exit() {
                LogitsWanted::All
            } else {
                LogitsWanted::None
            };
            let mut out = Vec::new();
            s.forward(input, SpanType::User, wanted, &mut out, &mut logits)
                .unwrap();
            hidden = out;
        }
        assert_eq!(logits, reference, "cuts {cuts:?}");
    }
}

#[test]
fn rollback_after_a_probe_gives_identical_next_logits() {
    let w = tiny_weights(3);
    let tokens = prompt(30, 3);
    let next = [17u32];
    let run = |probe: bool| {
        let mut s = session(&w, 0, 3, 8);
        fwd(&mut s, &tokens, SpanType::User, LogitsWanted::Last);
        if probe {
            let saved = s.clock();
            fwd(&mut s, &prompt(5, 9), SpanType::Thought, LogitsWanted::Last);
            s.rollback(saved).unwrap();
            assert_eq!(s.clock(), saved);
        }
        fwd(&mut s, &next, SpanType::User, LogitsWanted::Last).1
    };
    assert_eq!(run(true), run(false));
}

pub(super) fn pipeline(w: &Arc<LlamaWeights>, lo: usize, hi: usize) -> NativeLlamaPipeline {
    NativeLlamaPipeline::new(Arc::clone(w), lo, hi, CacheConfig::default()).unwrap()
}

/// The whole model behind the engine, as the runtime runs it.
pub(super) struct Runner {
    pipeline: Arc<Mutex<NativeLlamaPipeline>>,
    engine: Mutex<Engine>,
    ex: LocalExecutor,
}

/// What a generation gave.
pub(super) struct GenOut {
    pub(super) output_ids: Vec<u32>,
    pub(super) cache_hit: bool,
    pub(super) replayed_tokens: usize,
}

impl Runner {
    pub(super) fn new(w: &Arc<LlamaWeights>) -> Runner {
        let pipeline = Arc::new(Mutex::new(pipeline(w, 0, w.config().n_layers)));
        let cfg = SessionConfig {
            slots: 256,
            recall: 16,
            n_sys: 0,
            max_chunk: 16,
        };
        let ex = LocalExecutor::new(Arc::clone(&pipeline), cfg, 1).unwrap();
        let engine = Mutex::new(Engine::new(EngineConfig::default()).unwrap());
        Runner {
            pipeline,
            engine,
            ex,
        }
    }

    pub(super) fn p(&self) -> MutexGuard<'_, NativeLlamaPipeline> {
        self.pipeline.lock().unwrap()
    }

    pub(super) fn generate(&mut self, tokens: &[u32], n: usize, use_cache: bool) -> GenOut {
        self.generate_with(tokens, n, use_cache, SamplingParams::default())
    }

    fn generate_with(
        &mut self,
        tokens: &[u32],
        n: usize,
        use_cache: bool,
        sampling: SamplingParams,
    ) -> GenOut {
        let req = Request {
            use_cache,
            sampling,
            ..Request::greedy(tokens.to_vec(), n)
        };
        let id = self.engine.lock().unwrap().submit(req).unwrap();
        let mut output_ids = Vec::new();
        loop {
            for ev in step(&self.engine, &mut self.ex) {
                match ev {
                    Event::Token { seq, token, .. } if seq == id => output_ids.push(token),
                    Event::Finished { seq, reason, stats } if seq == id => {
                        assert!(!matches!(reason, FinishReason::Error(_)), "{reason:?}");
                        return GenOut {
                            output_ids,
                            cache_hit: stats.cache_hit,
                            replayed_tokens: stats.cached_tokens,
                        };
                    }
                    _ => {}
                }
            }
        }
    }
}

#[test]
fn cache_on_equals_cache_off_and_skips_prefill() {
    let w = tiny_weights(4);
    let tokens = prompt(50, 4);
    let mut r = Runner::new(&w);
    let cold = r.generate(&tokens, 20, false);
    let first = r.generate(&tokens, 20, true);
    let warm = r.generate(&tokens, 20, true);
    assert!(!first.cache_hit && warm.cache_hit);
    assert_eq!(warm.replayed_tokens, tokens.len());
    assert_eq!(cold.output_ids, first.output_ids);
    assert_eq!(cold.output_ids, warm.output_ids);
    let stats = r.p().amplituhedron_stats();
    assert_eq!((stats.hits, stats.entries), (1, 1));
}

#[test]
fn replayed_session_continues_bit_identically() {
    let w = tiny_weights(5);
    let tokens = prompt(33, 5);
    let mut p = pipeline(&w, 0, 3);
    let mut cold = session(&w, 0, 3, 16);
    let (h, l) = fwd(&mut cold, &tokens, SpanType::User, LogitsWanted::Last);
    let tail = h[h.len() - w.config().hidden..].to_vec();
    let logits = l.clone();
    p.amplituhedron_capture(cold.kv(), &tokens, &tail, Some(&logits), None)
        .unwrap();
    let mut warm = session(&w, 0, 3, 16);
    match p
        .amplituhedron_replay(warm.kv_mut(), &tokens, None)
        .unwrap()
    {
        ReplayOutcome::Hit {
            tail: t,
            logits: Some(cached),
        } => {
            assert_eq!(t, tail);
            assert_eq!(cached, logits);
        }
        other => panic!("expected a hit, got {other:?}"),
    }
    assert_eq!(warm.clock(), cold.clock());
    assert_eq!(ring_state(&warm), ring_state(&cold));
    assert_eq!(
        warm.rings().spans().collect::<Vec<_>>(),
        cold.rings().spans().collect::<Vec<_>>()
    );
    for step in 0..10u32 {
        let t = [step * 3 % 96];
        let (_, l1) = fwd(&mut cold, &t, SpanType::User, LogitsWanted::Last);
        let (_, l2) = fwd(&mut warm, &t, SpanType::User, LogitsWanted::Last);
        assert_eq!(l1, l2, "step {step}");
    }
}

#[test]
fn a_damaged_trailing_position_is_erased_once_then_the_entry_is_cleared() {
    let w = tiny_weights(6);
    let tokens = prompt(20, 6);
    let mut r = Runner::new(&w);
    let reference = r.generate(&tokens, 8, true);
    let key = VolumeKey {
        model_fingerprint: w.fingerprint(),
        tokens: &tokens,
        layer_lo: 0,
        layer_hi: 3,
        salt: None,
    };
    // Damage at the trailing position: trimmed once, the last token is prefilled again.
    assert!(r
        .p()
        .cache_mut()
        .inject_fault(&key, tokens.len() - 1)
        .unwrap());
    let trimmed = r.generate(&tokens, 8, true);
    assert!(!trimmed.cache_hit);
    assert_eq!(trimmed.replayed_tokens, tokens.len() - 1);
    assert_eq!(trimmed.output_ids, reference.output_ids);
    // The regenerated full volume replaced the trimmed one.
    let warm = r.generate(&tokens, 8, true);
    assert!(warm.cache_hit);
    // Deeper damage clears the entry (and only it): a cold run with the same output.
    assert!(r.p().cache_mut().inject_fault(&key, 3).unwrap());
    let cleared = r.generate(&tokens, 8, true);
    assert_eq!((cleared.cache_hit, cleared.replayed_tokens), (false, 0));
    assert_eq!(cleared.output_ids, reference.output_ids);
    assert!(r.p().amplituhedron_stats().erasures >= 2);
}

#[test]
fn long_streams_past_the_window_do_not_depend_on_chunking() {
    let w = tiny_weights(7);
    // 256 slots − 16 recall = a 240-slot window: 600 positions wrap it twice.
    let tokens = prompt(600, 7);
    let run = |chunk: usize| {
        let mut s = session(&w, 0, 3, chunk);
        let (_h, l) = fwd(&mut s, &tokens, SpanType::User, LogitsWanted::All);
        assert!(s.rings().all().next().unwrap().active_slots().len() <= 240);
        l
    };
    let reference = run(1);
    assert!(reference.iter().all(|v| v.is_finite()));
    assert_eq!(run(64), reference);
    assert_eq!(run(240), reference);
}

#[test]
fn an_output_too_large_to_allocate_is_refused_not_aborted() {
    // A station once aborted on a 28.8 GB `reserve` for a 12.5M-row chunk.
    let mut out = Vec::new();
    for rows in [usize::MAX / 2, 1 << 40] {
        let err = super::forward::reserve_output(&mut out, rows, 576).unwrap_err();
        assert!(err.to_string().contains("cannot be allocated"), "{err}");
    }
    super::forward::reserve_output(&mut out, 4, 576).unwrap();
    assert!(out.capacity() >= 4 * 576);
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let w = tiny_weights(8);
    let mut s = session(&w, 0, 3, 16);
    let (mut h, mut l) = fwd(&mut s, &prompt(5, 8), SpanType::User, LogitsWanted::Last);
    let before = (s.clock(), ring_state(&s));
    let cases: Vec<(ChunkInput<'_>, LogitsWanted, &str)> = vec![
        (ChunkInput::Tokens(&[]), LogitsWanted::Last, "no tokens"),
        (
            ChunkInput::Tokens(&[3, 96]),
            LogitsWanted::Last,
            "outside the vocabulary",
        ),
        (
            ChunkInput::Hidden(&[0.0; 64]),
            LogitsWanted::None,
            "takes token ids",
        ),
    ];
    for (input, wanted, needle) in cases {
        let err = s
            .forward(input, SpanType::User, wanted, &mut h, &mut l)
            .unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
        assert_eq!((s.clock(), ring_state(&s)), before);
    }
    let mut mid = session(&w, 1, 2, 16);
    let mut nan = vec![0.5f32; 64];
    nan[7] = f32::NAN;
    for (input, wanted) in [
        (ChunkInput::Hidden(&nan), LogitsWanted::None),
        (ChunkInput::Hidden(&[0.0; 63]), LogitsWanted::None),
        (ChunkInput::Hidden(&[0.0; 64]), LogitsWanted::Last),
    ] {
        assert!(mid
            .forward(input, SpanType::User, wanted, &mut h, &mut l)
            .is_err());
        assert_eq!(mid.clock(), 0);
    }
    let mut p = pipeline(&w, 0, 3);
    assert!(p
        .amplituhedron_capture(s.kv(), &[], &[0.0; 64], None, None)
        .is_err());
    assert!(p
        .amplituhedron_capture(s.kv(), &prompt(9, 8), &[0.0; 64], None, None)
        .is_err());
    assert!(p
        .amplituhedron_capture(s.kv(), &prompt(5, 8), &[0.0; 3], None, None)
        .is_err());
    assert_eq!(p.amplituhedron_stats().entries, 0);
    assert!(RangeSession::new(Arc::clone(&w), 2, 2, &SessionConfig::default()).is_err());
    let too_many = SessionConfig {
        slots: tiny_config().context_len + 1,
        ..SessionConfig::default()
    };
    assert!(RangeSession::new(Arc::clone(&w), 0, 3, &too_many).is_err());
}

#[test]
fn fingerprint_tracks_content() {
    assert_eq!(tiny_weights(9).fingerprint(), tiny_weights(9).fingerprint());
    assert_ne!(
        tiny_weights(9).fingerprint(),
        tiny_weights(10).fingerprint()
    );
}

#[test]
fn sampled_generation_is_reproducible_and_cache_invariant() {
    let w = tiny_weights(11);
    let tokens = prompt(25, 11);
    let params = SamplingParams {
        greedy: false,
        temperature: 0.8,
        top_k: 20,
        top_p: 0.95,
        seed: 1234,
        ..SamplingParams::default()
    };
    let mut r = Runner::new(&w);
    let mut run = |use_cache| r.generate_with(&tokens, 24, use_cache, params.clone());
    let cold = run(false);
    let _capture = run(true);
    let warm = run(true);
    assert!(warm.cache_hit);
    assert_eq!(cold.output_ids, warm.output_ids);
}

#[test]
fn captures_the_cache_declines_are_reported_not_errors() {
    let w = tiny_weights(13);
    let tokens = prompt(12, 13);
    let mut s = session(&w, 0, 3, 16);
    let (h, l) = fwd(&mut s, &tokens, SpanType::User, LogitsWanted::Last);
    let tail = h[h.len() - 64..].to_vec();
    let mut p = pipeline(&w, 0, 3);
    p.amplituhedron_set_max_prefix_len(4).unwrap();
    let too_long = p
        .amplituhedron_capture(s.kv(), &tokens, &tail, Some(&l), None)
        .unwrap();
    assert!(matches!(
        too_long,
        crate::volume::CaptureOutcome::SkippedTooLong { .. }
    ));
    assert_eq!(p.amplituhedron_stats().skipped_too_long, 1);
    p.amplituhedron_set_max_prefix_len(512).unwrap();
    p.amplituhedron_enable(false);
    let off = p
        .amplituhedron_capture(s.kv(), &tokens, &tail, Some(&l), None)
        .unwrap();
    assert_eq!(off, crate::volume::CaptureOutcome::Disabled);
    p.amplituhedron_enable(true);
    let stored = p
        .amplituhedron_capture(s.kv(), &tokens, &tail, Some(&l), None)
        .unwrap();
    assert!(stored.cached_bytes() > 0);
    let again = p
        .amplituhedron_capture(s.kv(), &tokens, &tail, Some(&l), None)
        .unwrap();
    assert!(matches!(
        again,
        crate::volume::CaptureOutcome::AlreadyPresent { .. }
    ));
    assert_eq!(p.amplituhedron_stats().entries, 1);
}

#[test]
fn longest_prefix_replay_reuses_a_shared_prefix_bit_exactly() {
    let w = tiny_weights(14);
    let shared = prompt(40, 14);
    let with = |tail: &[u32]| [shared.as_slice(), tail].concat();
    let a = with(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
    let b = with(&[50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]);
    let mut r = Runner::new(&w);
    let cold_b = r.generate(&b, 12, false);
    r.generate(&a, 4, true); // captures A
    let warm_b = r.generate(&b, 12, true);
    assert!(!warm_b.cache_hit);
    assert_eq!(warm_b.replayed_tokens, shared.len());
    assert_eq!(warm_b.output_ids, cold_b.output_ids);
    assert_eq!(r.p().amplituhedron_stats().prefix_hits, 1);
    // B was captured in full: now an exact hit.
    assert!(r.generate(&b, 12, true).cache_hit);

    // A prompt that is a strict prefix of a cached one reuses all but its last position.
    let short = a[..30].to_vec();
    let cold = r.generate(&short, 6, false);
    let warm = r.generate(&short, 6, true);
    assert_eq!(warm.replayed_tokens, 29);
    assert_eq!(warm.output_ids, cold.output_ids);
}

#[test]
fn longest_prefix_replay_respects_threshold_salt_and_switch() {
    let w = tiny_weights(15);
    let shared = prompt(20, 15);
    let a = [shared.as_slice(), &[1, 2, 3]].concat();
    let b = [shared.as_slice(), &[7, 8, 9]].concat();
    let mut r = Runner::new(&w);
    let mut s = session(&w, 0, 3, 16);
    r.generate(&a, 2, true);
    // Below the threshold: no reuse.
    r.p().amplituhedron_set_min_prefix_reuse(21);
    assert_eq!(r.generate(&b, 2, true).replayed_tokens, 0);
    // Switched off: no reuse.
    r.p().amplituhedron_set_min_prefix_reuse(0);
    let c = [shared.as_slice(), &[11, 12, 13]].concat();
    assert_eq!(r.generate(&c, 2, true).replayed_tokens, 0);
    // A salted probe never reuses an unsalted volume.
    r.p().amplituhedron_set_min_prefix_reuse(4);
    let d = [shared.as_slice(), &[21, 22, 23]].concat();
    s.reset();
    let salted = r
        .p()
        .amplituhedron_replay(s.kv_mut(), &d, Some("tenant-b"))
        .unwrap();
    assert_eq!(salted, ReplayOutcome::Miss);
    assert_eq!(s.clock(), 0);
    let unsalted = r.p().amplituhedron_replay(s.kv_mut(), &d, None).unwrap();
    assert_eq!(unsalted, ReplayOutcome::Partial { kv_len: 20 });
}

/// What one sequence produced: every hidden row and every logits row, in order.
#[derive(Default, Debug, PartialEq)]
struct Trace {
    hidden: Vec<f32>,
    logits: Vec<f32>,
}

fn seq_config(max_chunk: usize) -> SessionConfig {
    SessionConfig {
        slots: 256,
        recall: 16,
        n_sys: 0,
        max_chunk,
    }
}

/// One sequence run alone: its prompt (logits of every row), then `decode` one at a time.
fn run_alone(w: &Arc<LlamaWeights>, prompt: &[u32], decode: &[u32], max_chunk: usize) -> Trace {
    let mut s = RangeSession::new(Arc::clone(w), 0, 3, &seq_config(max_chunk)).unwrap();
    let mut t = Trace::default();
    let (h, l) = fwd(&mut s, prompt, SpanType::User, LogitsWanted::All);
    t.hidden.extend(h);
    t.logits.extend(l);
    for &tok in decode {
        let (h, l) = fwd(
            &mut s,
            &[tok],
            SpanType::ResponseSentence,
            LogitsWanted::Last,
        );
        t.hidden.extend(h);
        t.logits.extend(l);
    }
    t
}

#[test]
fn a_batched_step_equals_each_sequence_run_alone() {
    for precision in [Precision::Refined, Precision::Fast] {
        let w = tiny_weights_with(21, precision);
        let range = LayerRange::new(Arc::clone(&w), 0, 3).unwrap();
        // Mixed lengths: one piece, several pieces, a span boundary; D joins mid-stream and
        // B leaves early; C's pieces are cut at other places than the others'.
        let prompts = [prompt(37, 1), prompt(5, 2), prompt(90, 3), prompt(12, 4)];
        let decode: Vec<Vec<u32>> = (0..4).map(|s| prompt(6, 10 + s)).collect();
        let chunks = [16, 16, 7, 16];
        let alone: Vec<Trace> = (0..4)
            .map(|i| run_alone(&w, &prompts[i], &decode[i], chunks[i]))
            .collect();

        let mut kvs: Vec<SequenceKv> = (0..4)
            .map(|i| range.new_kv(&seq_config(chunks[i])).unwrap())
            .collect();
        let mut traces: Vec<Trace> = (0..4).map(|_| Trace::default()).collect();
        let mut bufs = StepBuffers::new(w.config(), 4, 64);
        // step 0: prompts of A, B, C; steps 1..: decode; D's prompt joins at step 2;
        // B leaves after its 2nd decoded token.
        let mut decoded = [0usize; 4];
        for step in 0..9 {
            let mut plan: Vec<(usize, Vec<u32>, LogitsWanted, SpanType)> = Vec::new();
            for i in 0..4 {
                let joined = if i == 3 { 2 } else { 0 };
                let limit = if i == 1 { 2 } else { decode[i].len() };
                if step == joined {
                    plan.push((i, prompts[i].clone(), LogitsWanted::All, SpanType::User));
                } else if step > joined && decoded[i] < limit {
                    let tok = decode[i][decoded[i]];
                    decoded[i] += 1;
                    plan.push((i, vec![tok], LogitsWanted::Last, SpanType::ResponseSentence));
                }
            }
            let mut outs: Vec<(Vec<f32>, Vec<f32>)> =
                plan.iter().map(|_| Default::default()).collect();
            {
                let mut kv_refs: Vec<Option<&mut SequenceKv>> = kvs.iter_mut().map(Some).collect();
                let mut segments: Vec<Segment<'_>> = plan
                    .iter()
                    .zip(outs.iter_mut())
                    .map(|((i, toks, wanted, span), (h, l))| Segment {
                        kv: kv_refs[*i].take().unwrap(),
                        input: ChunkInput::Tokens(toks),
                        span: *span,
                        logits: *wanted,
                        hidden_out: h,
                        logits_out: l,
                        shared_prefix: None,
                    })
                    .collect();
                range.forward_batch(&mut segments, &mut bufs).unwrap();
            }
            for ((i, ..), (h, l)) in plan.iter().zip(outs) {
                traces[*i].hidden.extend(h);
                traces[*i].logits.extend(l);
            }
        }
        let vocab = w.config().vocab;
        let hidden = w.config().hidden;
        for i in 0..4 {
            let want = if i == 1 {
                let rows = prompts[1].len() + 2;
                Trace {
                    hidden: alone[1].hidden[..rows * hidden].to_vec(),
                    logits: alone[1].logits[..rows * vocab].to_vec(),
                }
            } else {
                Trace {
                    hidden: alone[i].hidden.clone(),
                    logits: alone[i].logits.clone(),
                }
            };
            assert!(
                traces[i] == want,
                "sequence {i} differs in a batch ({precision:?})"
            );
        }
    }
}

#[test]
fn a_bad_segment_fails_the_batch_and_changes_no_ring() {
    let w = tiny_weights(22);
    let range = LayerRange::new(Arc::clone(&w), 0, 3).unwrap();
    let mut a = range.new_kv(&seq_config(16)).unwrap();
    let mut b = range.new_kv(&seq_config(16)).unwrap();
    let mut bufs = StepBuffers::new(w.config(), 1, 1);
    let good = prompt(20, 5);
    let bad = [1, 2, 96]; // 96 is outside the vocabulary of 96
    let (mut h1, mut l1, mut h2, mut l2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut segments = [
        Segment {
            kv: &mut a,
            input: ChunkInput::Tokens(&good),
            span: SpanType::User,
            logits: LogitsWanted::Last,
            hidden_out: &mut h1,
            logits_out: &mut l1,
            shared_prefix: None,
        },
        Segment {
            kv: &mut b,
            input: ChunkInput::Tokens(&bad),
            span: SpanType::User,
            logits: LogitsWanted::Last,
            hidden_out: &mut h2,
            logits_out: &mut l2,
            shared_prefix: None,
        },
    ];
    let err = range.forward_batch(&mut segments, &mut bufs).unwrap_err();
    assert!(matches!(err, ModelError::Input(_)), "{err}");
    assert_eq!((a.clock(), b.clock()), (0, 0));
    assert!(h1.is_empty() && l1.is_empty());
}

#[test]
fn sessions_batched_through_a_shared_range_equal_each_run_alone() {
    let w = tiny_weights(23);
    let range = LayerRange::new(Arc::clone(&w), 0, 3).unwrap();
    let cfg = seq_config(16);
    let prompts = [prompt(21, 1), prompt(3, 2)];
    let mut alone = Vec::new();
    for p in &prompts {
        let mut s = RangeSession::new(Arc::clone(&w), 0, 3, &cfg).unwrap();
        let (mut h, mut l) = (Vec::new(), Vec::new());
        s.forward(
            ChunkInput::Tokens(p),
            SpanType::User,
            LogitsWanted::All,
            &mut h,
            &mut l,
        )
        .unwrap();
        alone.push((h, l));
    }
    let mut sessions: Vec<RangeSession> = (0..2)
        .map(|_| RangeSession::new(Arc::clone(&w), 0, 3, &cfg).unwrap())
        .collect();
    let mut outs: Vec<(Vec<f32>, Vec<f32>)> = vec![Default::default(); 2];
    let mut bufs = StepBuffers::new(w.config(), 1, 1);
    {
        let mut segments: Vec<Segment<'_>> = sessions
            .iter_mut()
            .zip(&prompts)
            .zip(outs.iter_mut())
            .map(|((s, p), (h, l))| Segment {
                kv: s.kv_for(&range).unwrap(),
                input: ChunkInput::Tokens(p),
                span: SpanType::User,
                logits: LogitsWanted::All,
                hidden_out: h,
                logits_out: l,
                shared_prefix: None,
            })
            .collect();
        range.forward_batch(&mut segments, &mut bufs).unwrap();
    }
    assert!(
        outs == alone,
        "a batched session differs from its run alone"
    );
}

#[test]
fn a_session_of_other_weights_or_layers_is_refused_for_a_batch() {
    let w = tiny_weights(24);
    let cfg = seq_config(16);
    let mut s = RangeSession::new(Arc::clone(&w), 0, 2, &cfg).unwrap();
    let other_layers = LayerRange::new(Arc::clone(&w), 0, 3).unwrap();
    assert!(matches!(s.kv_for(&other_layers), Err(ModelError::Input(_))));
    // Equal weights mapped twice are still other weights: the batch reads one mapping.
    let twin = LayerRange::new(tiny_weights(24), 0, 2).unwrap();
    assert!(matches!(s.kv_for(&twin), Err(ModelError::Input(_))));
    let same = LayerRange::new(Arc::clone(&w), 0, 2).unwrap();
    assert!(s.kv_for(&same).is_ok());
}

#[test]
fn the_head_is_copied_interleaved_on_first_use_with_16_lane_kernels_and_computes_the_same_bits() {
    use crate::quant::{matmul, Kernel, QMatrix, QuantScratch, QuantizedInput};
    let c = tiny_config();
    let w = tiny_weights(11);
    // Only a range that runs the head makes its copy (a middle station never does).
    LayerRange::new(Arc::clone(&w), 0, 1).unwrap();
    assert!(!w.head_is_copied());
    let head = w.lm_head().unwrap();
    let sixteen_lanes = Kernel::detect().lanes() == 16;
    assert_eq!(head.is_interleaved(), sixteen_lanes);
    assert_eq!(w.head_is_copied(), sixteen_lanes);
    // The same matrix in the file's row layout: the tied embedding's rows and the head's
    // products must not depend on which copy they come from.
    let (bytes, table) = super::testing::synthetic_file(&c, 11);
    let info = table
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .unwrap();
    let len = head.rows() * head.row_bytes();
    let at = info.offset as usize;
    let raw = QMatrix::from_gguf(info.ggml_type, &info.dims, &bytes[at..at + len]).unwrap();
    let ids: Vec<u32> = vec![0, 5, 17, 95, 40];
    let (mut from_weights, mut from_file) = (
        vec![0.0; ids.len() * c.hidden],
        vec![0.0; ids.len() * c.hidden],
    );
    w.embedding()
        .unwrap()
        .embed(&ids, &mut from_weights)
        .unwrap();
    raw.embed(&ids, &mut from_file).unwrap();
    assert_eq!(bits(&from_weights), bits(&from_file));
    let mut scratch = QuantScratch::new();
    let input = QuantizedInput::quantize(&from_file, ids.len(), c.hidden, &mut scratch).unwrap();
    let (mut a, mut b) = (
        vec![0.0; ids.len() * c.vocab],
        vec![0.0; ids.len() * c.vocab],
    );
    matmul(&head, &input, &mut a).unwrap();
    matmul(&raw, &input, &mut b).unwrap();
    assert_eq!(bits(&a), bits(&b));
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn the_prefetched_history_is_every_kv_row_attention_reads_and_nothing_else() {
    use crate::quant::SidePrefetch;
    use crate::ring::{DynamicRingBuffer, KvDtype, RingConfig};
    use std::collections::BTreeSet;

    for kv_dtype in [KvDtype::F16, KvDtype::F32] {
        let mut cfg = RingConfig::new(2, 1, 32);
        (cfg.slots, cfg.recall, cfg.n_sys, cfg.max_chunk) = (40, 4, 3, 16);
        cfg.kv_dtype = kv_dtype;
        let mut ring = DynamicRingBuffer::new(cfg.clone()).unwrap();
        let row = cfg.row_len();
        // 3 anchors, then 45 window positions in a 33-slot window: it has wrapped.
        let keys = vec![0.5f32; 2 * row * 8];
        for _ in 0..6 {
            ring.append_slab(8, &keys, &keys, SpanType::Thought, true)
                .unwrap();
        }
        let value_bytes = if kv_dtype == KvDtype::F16 { 2 } else { 4 };
        let row_bytes = row * value_bytes;
        let (k, v) = ring.layer_kv(1);
        let base = |s: &crate::ring::KvSlice<'_>| match s {
            crate::ring::KvSlice::F16(x) => x.as_ptr() as usize,
            crate::ring::KvSlice::F32(x) => x.as_ptr() as usize,
        };
        let (kb, vb) = (base(&k), base(&v));
        for window in [None, Some(10)] {
            let window_slots = ring.window_slots();
            let visible = window.map_or(window_slots.len(), |w| w.min(window_slots.len()));
            let read: Vec<u32> = ring
                .fixed_slots()
                .iter()
                .chain(&window_slots[window_slots.len() - visible..])
                .copied()
                .collect();
            assert!(read.windows(2).any(|w| w[1] != w[0] + 1) || window.is_some());
            let mut expected = BTreeSet::new();
            for &s in &read {
                for b in [kb, vb] {
                    let start = b + s as usize * row_bytes;
                    for line in start / 64..(start + row_bytes).div_ceil(64) {
                        expected.insert(line * 64);
                    }
                }
            }
            let mut side = SidePrefetch::new();
            super::forward::list_ring_history(&mut side, &ring, 1, window, 0);
            let listed: Vec<usize> = side.line_addresses().collect();
            let unique: BTreeSet<usize> = listed.iter().copied().collect();
            assert_eq!(unique, expected, "{kv_dtype:?} window {window:?}");
            // Runs of slots overlap only where a run ends and the next starts mid-line.
            assert!(listed.len() <= expected.len() + 4 * read.len());
        }
    }
}
