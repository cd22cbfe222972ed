use super::*;
use crate::model::SamplingParams;

/// Every byte, some multi-byte pieces (so tokens span lexemes), and a special end token.
fn words() -> Vec<Vec<u8>> {
    let mut w: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for piece in [
        "{\"", "\": ", "\", \"", "\"}", "true", "false", "null", "name", "age", "tags", "12", "ab",
        "abc", ", ", "\"]", "[\"", "}", "{", "a\"", " \"", "xyz",
    ] {
        w.push(piece.as_bytes().to_vec());
    }
    w.push(b"\xff<|end|>".to_vec());
    w
}

fn vocab() -> Arc<Vocabulary> {
    let w = words();
    let eos = w.len() as u32 - 1;
    Arc::new(Vocabulary::new(w, &[eos]).unwrap())
}

fn spec(kind: GrammarKind, text: &str) -> GrammarSpec {
    GrammarSpec {
        kind,
        text: text.to_string(),
    }
}

/// A deterministic pseudo-random logits row for position `index`.
fn row(vocab: usize, index: u64, salt: u64) -> Vec<f32> {
    (0..vocab as u64)
        .map(|i| {
            let mut x = (i + 1)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(index.wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ salt);
            x ^= x >> 29;
            x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        })
        .collect()
}

const SCHEMA: &str = r#"{"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["ab", "xyz"]}, "maxItems": 3}},
  "required": ["name", "age", "tags"], "additionalProperties": false}"#;

/// Constrained decoding from pseudo-random rows until the grammar is done: the tokens.
fn decode(g: &Grammar, p: &SamplingParams, salt: u64, max: usize) -> (Vec<u32>, bool) {
    let n = g.vocabulary().size();
    let mut sampler = Sampler::new(p.clone()).unwrap();
    let mut state = g.start();
    let mut out = Vec::new();
    for index in 0..max as u64 {
        let (t, done) =
            sample(&mut sampler, Some(&mut state), &row(n, index, salt), index).unwrap();
        out.push(t);
        if done {
            return (out, true);
        }
    }
    (out, false)
}

fn text_of(tokens: &[u32]) -> String {
    let w = words();
    let bytes: Vec<u8> = tokens
        .iter()
        .filter(|&&t| w[t as usize][0] != 0xff)
        .flat_map(|&t| w[t as usize].clone())
        .collect();
    String::from_utf8(bytes).unwrap()
}

#[test]
fn constrained_output_follows_the_schema_greedy_and_sampled() {
    let v = vocab();
    let g = v.compile(spec(GrammarKind::JsonSchema, SCHEMA)).unwrap();
    let eos = *v.eos().first().unwrap();
    for (k, p) in [
        SamplingParams::default(),
        SamplingParams {
            greedy: false,
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed: 11,
            ..SamplingParams::default()
        },
    ]
    .iter()
    .enumerate()
    {
        for salt in 0..6 {
            let (tokens, done) = decode(&g, p, salt + 100 * k as u64, 400);
            assert!(done, "{p:?}/{salt}: not done after {} tokens", tokens.len());
            let text = text_of(&tokens);
            let value: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
            let o = value.as_object().unwrap();
            assert_eq!(o.len(), 3, "{text}");
            assert!(o["name"].as_str().unwrap().chars().count() <= 6, "{text}");
            assert!((0..=120).contains(&o["age"].as_i64().unwrap()), "{text}");
            for t in o["tags"].as_array().unwrap() {
                assert!(["ab", "xyz"].contains(&t.as_str().unwrap()), "{text}");
            }
            // The end token comes only where the grammar accepts: last, if at all.
            assert!(!tokens[..tokens.len() - 1].contains(&eos), "{tokens:?}");
        }
    }
}

#[test]
fn the_end_token_is_allowed_only_where_the_grammar_accepts() {
    let v = vocab();
    let eos = v.eos()[0];
    let g = v.compile(spec(GrammarKind::Regex, "ab+")).unwrap();
    let mut s = g.start();
    assert!(!s.allowed().unwrap().is_allowed(eos), "nothing yet");
    s.advance(b'a' as u32).unwrap();
    assert!(!s.allowed().unwrap().is_allowed(eos), "'a' is not a match");
    s.advance(b'b' as u32).unwrap();
    let mask = s.allowed().unwrap();
    assert!(mask.is_allowed(eos) && mask.is_allowed(b'b' as u32));
    assert!(!mask.is_allowed(b'a' as u32));
    assert!(!s.is_done());
    s.advance(eos).unwrap();
    assert!(s.is_done());
    // A grammar with no continuation is done without an end token.
    let g = v.compile(spec(GrammarKind::Regex, "abc")).unwrap();
    let mut s = g.start();
    let abc = words().iter().position(|w| w == b"abc").unwrap() as u32;
    s.advance(abc).unwrap();
    assert!(s.is_done());
}

#[test]
fn verification_emits_the_tokens_of_constrained_decoding_without_drafts() {
    let v = vocab();
    let n = v.size();
    let g = v.compile(spec(GrammarKind::JsonSchema, SCHEMA)).unwrap();
    for p in [
        SamplingParams::default(),
        SamplingParams {
            greedy: false,
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            seed: 3,
            ..SamplingParams::default()
        },
    ] {
        let (plain, _) = decode(&g, &p, 7, 400);
        // Drafts: the right tokens, then wrong ones (some the grammar rejects), in pieces.
        let mut sampler = Sampler::new(p.clone()).unwrap();
        let mut state = g.start();
        let mut out: Vec<u32> = Vec::new();
        let mut k = 0usize;
        let mut done = false;
        while !done {
            let at = out.len();
            let mut drafts: Vec<u32> = plain[at..].iter().copied().take(k % 4).collect();
            if k % 3 == 1 {
                drafts.push(b'~' as u32); // never valid JSON here
            }
            if k % 5 == 2 {
                drafts.push(b'{' as u32);
            }
            let rows: Vec<f32> = (0..=drafts.len())
                .flat_map(|j| row(n, (at + j) as u64, 7))
                .collect();
            let before = out.len();
            done = verify(
                &mut sampler,
                Some(&mut state),
                &rows,
                n,
                &drafts,
                at as u64,
                &mut out,
            )
            .unwrap();
            assert!(out.len() > before && out.len() - before <= drafts.len() + 1);
            k += 1;
        }
        assert_eq!(out, plain, "{p:?}");
        assert_eq!(state.consumed(), plain.len());
    }
}

#[test]
fn drafts_are_cut_at_the_first_token_the_grammar_rejects() {
    let v = vocab();
    let g = v.compile(spec(GrammarKind::Regex, "a(bc)*")).unwrap();
    let mut s = g.start();
    let t = |c: u8| c as u32;
    assert_eq!(s.accepted_prefix(&[t(b'a'), t(b'b'), t(b'c'), t(b'a')]), 3);
    assert_eq!(s.accepted_prefix(&[t(b'b')]), 0);
    assert_eq!(s.consumed(), 0, "nothing consumed");
    s.advance(t(b'a')).unwrap();
    assert_eq!(s.accepted_prefix(&[t(b'b'), t(b'c'), t(b'b')]), 3);
}

#[test]
fn align_rolls_back_or_catches_up_by_one() {
    let v = vocab();
    let g = v.compile(spec(GrammarKind::Regex, "[a-c]{1,8}")).unwrap();
    let mut s = g.start();
    for c in [b'a', b'b', b'c'] {
        s.advance(c as u32).unwrap();
    }
    s.align(1, 0).unwrap();
    assert_eq!(s.consumed(), 1);
    // One short: the step's first token is consumed.
    s.align(2, b'c' as u32).unwrap();
    assert_eq!(s.consumed(), 2);
    assert!(s.allowed().unwrap().is_allowed(b'a' as u32));
    // Two short: an error, nothing changed.
    assert!(s.align(4, b'a' as u32).is_err());
    assert_eq!(s.consumed(), 2);
    s.align(2, 0).unwrap();
    assert_eq!(s.consumed(), 2);
}

#[test]
fn bad_grammars_are_refused_with_their_reason() {
    let v = vocab();
    let err = |kind, text: &str| v.compile(spec(kind, text)).unwrap_err().0;
    assert!(err(GrammarKind::JsonSchema, "{not json").contains("not JSON"));
    assert!(err(GrammarKind::JsonSchema, "[1, 2]").contains("is an object"));
    let e = err(GrammarKind::JsonSchema, r#"{"type": "wat"}"#);
    assert!(e.contains("invalid json_schema"), "{e}");
    let e = err(GrammarKind::Lark, "start: foo\n");
    assert!(e.contains("invalid lark"), "{e}");
    let e = err(GrammarKind::Regex, "(unclosed");
    assert!(e.contains("invalid regex"), "{e}");
    let long = format!(r#"{{"description": "{}"}}"#, "x".repeat(MAX_GRAMMAR_BYTES));
    assert!(err(GrammarKind::JsonSchema, &long).contains("at most"));
    assert!(GrammarKind::parse("yaml").is_err());
    for k in ["json_schema", "json_object", "regex", "lark"] {
        assert_eq!(GrammarKind::parse(k).unwrap().as_str(), k);
    }
    // Vocabularies need an end token inside them.
    assert!(Vocabulary::new(words(), &[]).is_err());
    assert!(Vocabulary::new(words(), &[10_000]).is_err());
}

#[test]
fn json_object_and_lark_grammars_constrain_too() {
    let v = vocab();
    let g = v.compile(spec(GrammarKind::JsonObject, "")).unwrap();
    let (tokens, done) = decode(&g, &SamplingParams::default(), 5, 600);
    if done {
        let value: serde_json::Value = serde_json::from_str(&text_of(&tokens)).unwrap();
        assert!(value.is_object());
    } else {
        assert!(text_of(&tokens).starts_with('{'));
    }
    let g = v
        .compile(spec(GrammarKind::Lark, "start: (\"yes\" | \"no\") \"!\"\n"))
        .unwrap();
    let (tokens, done) = decode(&g, &SamplingParams::default(), 9, 10);
    assert!(done);
    assert!(["yes!", "no!"].contains(&text_of(&tokens).as_str()));
}

/// The state of a grammar over `{"p": <number schema>}` after the bytes `text`.
fn number_state_after(number: &str, text: &[u8]) -> GrammarState {
    let schema =
        format!(r#"{{"type": "object", "properties": {{"p": {number}}}, "required": ["p"]}}"#);
    let g = vocab()
        .compile(spec(GrammarKind::JsonSchema, &schema))
        .unwrap();
    let mut s = g.start();
    for b in text {
        s.advance(*b as u32).unwrap();
    }
    s
}

#[test]
fn a_numbers_fraction_digits_are_bounded_and_the_schema_still_holds() {
    let mut s = number_state_after(r#"{"type": "number", "maximum": 1000}"#, br#"{"p": 12.5"#);
    for _ in 1..MAX_FRACTION_DIGITS {
        assert!(s.allowed().unwrap().is_allowed(b'0' as u32));
        s.advance(b'0' as u32).unwrap();
    }
    let mask = s.allowed().unwrap();
    assert!(mask.is_allowed(b'}' as u32), "12.50000000 is a number");
    assert!(!mask.is_allowed(b'0' as u32), "a ninth fraction digit");
    // The bound is the grammar's alone: a stated step still rules.
    let mut s = number_state_after(r#"{"type": "number", "multipleOf": 0.25}"#, br#"{"p": 1.2"#);
    let mask = s.allowed().unwrap();
    assert!(mask.is_allowed(b'5' as u32) && !mask.is_allowed(b'4' as u32));
}
