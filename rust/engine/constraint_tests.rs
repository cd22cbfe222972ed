//! Constrained decoding through the engine, on the synthetic model (vocabulary: 95 printable
//! characters and an end token): the output follows its grammar and finishes when the
//! grammar is complete; batched ≡ alone with constrained and free sequences mixed, greedy
//! and seeded; drafts (cut at their first rejected token) ≡ no drafts; a cached first token
//! is masked like a fresh one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::*;
use crate::grammar::{Grammar, GrammarKind, GrammarSpec, Vocabulary};
use crate::model::testing::tiny_weights;
use crate::model::{LlamaWeights, NativeLlamaPipeline, SamplingParams, SessionConfig};
use crate::volume::CacheConfig;

const EOS: u32 = 95;

/// Token `i < 95` is the character `' ' + i`; 95 ends a sequence.
fn vocabulary() -> Arc<Vocabulary> {
    let mut words: Vec<Vec<u8>> = (0..95u8).map(|i| vec![b' ' + i]).collect();
    words.push(b"\xff<eos>".to_vec());
    Arc::new(Vocabulary::new(words, &[EOS]).unwrap())
}

fn ids(text: &str) -> Vec<u32> {
    text.bytes().map(|b| u32::from(b - b' ')).collect()
}

fn text(tokens: &[u32]) -> String {
    tokens
        .iter()
        .filter(|&&t| t != EOS)
        .map(|&t| char::from(b' ' + t as u8))
        .collect()
}

const SCHEMA: &str = r#"{"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 999},
    "b": {"enum": ["x", "yy", "zzz"]}},
  "required": ["a", "b"], "additionalProperties": false}"#;

fn schema(v: &Arc<Vocabulary>) -> Grammar {
    v.compile(GrammarSpec {
        kind: GrammarKind::JsonSchema,
        text: SCHEMA.into(),
    })
    .unwrap()
}

fn executor(w: &Arc<LlamaWeights>) -> LocalExecutor {
    let session = SessionConfig {
        slots: 256,
        recall: 16,
        n_sys: 0,
        max_chunk: 32,
    };
    let pipeline = NativeLlamaPipeline::new(Arc::clone(w), 0, 3, CacheConfig::default()).unwrap();
    LocalExecutor::new(Arc::new(Mutex::new(pipeline)), session, 8).unwrap()
}

#[derive(Debug, Default, Clone, PartialEq)]
struct Out {
    tokens: Vec<u32>,
    reason: Option<FinishReason>,
    stats: SeqStats,
}

fn run(engine: &Mutex<Engine>, ex: &mut LocalExecutor, reqs: Vec<Request>) -> Vec<Out> {
    let ids: Vec<SeqId> = reqs
        .into_iter()
        .map(|r| engine.lock().unwrap().submit(r).unwrap())
        .collect();
    let mut outs: HashMap<SeqId, Out> = HashMap::new();
    let mut steps = 0;
    while engine.lock().unwrap().has_work() {
        steps += 1;
        assert!(steps < 5_000, "no progress");
        for ev in step(engine, ex) {
            match ev {
                Event::Token { seq, token, .. } => outs.entry(seq).or_default().tokens.push(token),
                Event::Finished { seq, reason, stats } => {
                    let o = outs.entry(seq).or_default();
                    o.reason = Some(reason);
                    o.stats = stats;
                }
                Event::Prompt { .. } => {}
            }
        }
    }
    ids.iter().map(|id| outs.remove(id).unwrap()).collect()
}

fn alone(w: &Arc<LlamaWeights>, req: Request) -> Out {
    let engine = Mutex::new(Engine::new(EngineConfig::default()).unwrap());
    run(&engine, &mut executor(w), vec![req]).remove(0)
}

fn request(prompt: &str, max_new: usize, sampling: SamplingParams, g: Option<&Grammar>) -> Request {
    Request {
        sampling,
        use_cache: false,
        stop_ids: vec![EOS],
        grammar: g.cloned(),
        ..Request::greedy(ids(prompt), max_new)
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        greedy: false,
        temperature: 0.9,
        top_k: 0,
        top_p: 0.95,
        seed,
        ..SamplingParams::default()
    }
}

fn check_json(out: &Out) {
    assert_eq!(out.reason, Some(FinishReason::Stop), "{out:?}");
    let t = text(&out.tokens);
    let v: serde_json::Value =
        serde_json::from_str(&t).unwrap_or_else(|e| panic!("{t:?} is not JSON: {e}"));
    let a = v["a"].as_i64().unwrap();
    assert!((0..=999).contains(&a), "{t}");
    assert!(
        ["x", "yy", "zzz"].contains(&v["b"].as_str().unwrap()),
        "{t}"
    );
    assert_eq!(v.as_object().unwrap().len(), 2, "{t}");
}

#[test]
fn constrained_sequences_follow_their_grammar_and_stop_when_it_is_complete() {
    let w = tiny_weights(41);
    let v = vocabulary();
    let g = schema(&v);
    for (i, s) in [SamplingParams::default(), seeded(1), seeded(2)]
        .into_iter()
        .enumerate()
    {
        let out = alone(&w, request("Write JSON: ", 200, s.clone(), Some(&g)));
        check_json(&out);
        // Unconstrained, the same model does not write this JSON.
        let free = alone(&w, request("Write JSON: ", 30, s, None));
        assert_ne!(free.tokens, out.tokens, "case {i}");
    }
    // The length limit cuts a constrained output like any other.
    let short = alone(
        &w,
        request("Write JSON: ", 4, SamplingParams::default(), Some(&g)),
    );
    assert_eq!(short.reason, Some(FinishReason::Length));
    assert!(text(&short.tokens).starts_with("{\""));
}

#[test]
fn batched_equals_alone_with_constrained_and_free_sequences_mixed() {
    let w = tiny_weights(43);
    let v = vocabulary();
    let json = schema(&v);
    let regex = v
        .compile(GrammarSpec {
            kind: GrammarKind::Regex,
            text: "(ab|cd)+e".into(),
        })
        .unwrap();
    let reqs: Vec<Request> = (0..8)
        .map(|i| {
            let sampling = if i % 3 == 0 {
                seeded(i)
            } else {
                SamplingParams::default()
            };
            let g = match i % 4 {
                0 | 1 => Some(&json),
                2 => Some(&regex),
                _ => None,
            };
            let prompt = format!("Case {i}: write it: ");
            request(&prompt, 40 + 5 * i as usize, sampling, g)
        })
        .collect();
    let singles: Vec<Out> = reqs.iter().map(|r| alone(&w, r.clone())).collect();
    let engine = Mutex::new(Engine::new(EngineConfig::default()).unwrap());
    let batched = run(&engine, &mut executor(&w), reqs.clone());
    for (i, (b, s)) in batched.iter().zip(&singles).enumerate() {
        assert_eq!(b.tokens, s.tokens, "sequence {i}");
        assert_eq!(b.reason, s.reason, "sequence {i}");
        if i % 4 < 2 {
            check_json(b);
        }
    }
}

#[test]
fn drafts_cut_at_the_grammar_change_no_token() {
    let w = tiny_weights(47);
    let v = vocabulary();
    let g = schema(&v);
    // The prompt holds the JSON's pieces, so prompt lookup drafts from it.
    let prompt = r#"Example: {"a": 12, "b": "yy"} {"a": 12, "b": "yy"} Now: {"a": 1"#;
    for s in [SamplingParams::default(), seeded(5)] {
        let plain = alone(&w, request(prompt, 60, s.clone(), Some(&g)));
        let drafted = alone(
            &w,
            Request {
                draft: Some(DraftConfig::default()),
                ..request(prompt, 60, s, Some(&g))
            },
        );
        assert_eq!(drafted.tokens, plain.tokens);
        assert_eq!(drafted.reason, plain.reason);
        assert!(drafted.stats.draft_proposed > 0, "{:?}", drafted.stats);
    }
}

#[test]
fn a_cached_first_token_is_masked_like_a_fresh_one() {
    let w = tiny_weights(53);
    let v = vocabulary();
    let g = schema(&v);
    let engine = Mutex::new(Engine::new(EngineConfig::default()).unwrap());
    let mut ex = executor(&w);
    let req = Request {
        use_cache: true,
        ..request("Cached prompt: ", 80, SamplingParams::default(), Some(&g))
    };
    let first = run(&engine, &mut ex, vec![req.clone()]).remove(0);
    let again = run(&engine, &mut ex, vec![req.clone()]).remove(0);
    assert!(!first.stats.cache_hit && again.stats.cache_hit);
    assert_eq!(again.tokens, first.tokens);
    check_json(&again);
    // The free request's first token from the same cached row differs: the mask chose.
    let free = run(
        &engine,
        &mut ex,
        vec![Request {
            grammar: None,
            ..req
        }],
    )
    .remove(0);
    assert!(free.stats.cache_hit);
    assert_ne!(free.tokens[0], again.tokens[0]);
}
