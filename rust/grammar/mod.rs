//! Constrained decoding (SPEC §16): grammars compiled by `llguidance` against a model's own
//! vocabulary, and per sequence a grammar state whose allowed-token mask is applied to the
//! logits before the one sampling rule.
//!
//! - [`Vocabulary`]: the model's tokens as bytes (special tokens marked), built once per model;
//!   it compiles [`GrammarSpec`]s (JSON Schema, any JSON object, regex, Lark) into
//!   [`Grammar`]s. Compiling validates: a grammar llguidance rejects, or one too large, is an
//!   error with its reason, before anything runs.
//! - [`GrammarState`]: one sequence's position in its grammar. [`sample`] and [`verify`] are
//!   the sampler's two entry points with an optional state: the mask of the state, the
//!   sampler's rule on the masked row ([`Sampler::sample_masked`]: greedy and seeded alike),
//!   then the state advanced by the chosen token. End-of-sequence tokens are allowed only
//!   where the grammar accepts, and a grammar that admits no further token is *done*: the
//!   sequence finishes there.
//!
//! The mask is a pure function of the grammar and the tokens consumed, so constrained
//! sequences keep every invariant: batched ≡ alone, mesh ≡ one process (the exit station holds
//! the state), speculation ≡ plain decoding (drafts are verified row by row under the mask,
//! and the engine cuts a draft at its first token the grammar rejects), cache on ≡ off (a
//! cached first-token row is masked like a fresh one).

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::model::Sampler;

mod numbers;
#[cfg(test)]
mod tests;

pub use numbers::MAX_FRACTION_DIGITS;

/// The longest grammar text accepted (a JSON schema, a regex or a Lark grammar): bounds the
/// work of compiling one, with llguidance's own limits on the compiled size and lexer states.
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

/// A grammar that cannot be compiled or followed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrammarError(pub String);

impl fmt::Display for GrammarError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GrammarError {}

/// How a grammar's text is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GrammarKind {
    /// A JSON Schema (its JSON text).
    JsonSchema,
    /// Any JSON object (the text is ignored; OpenAI's `json_object`).
    JsonObject,
    /// A regular expression the whole output matches (Rust `regex` syntax).
    Regex,
    /// A grammar in llguidance's Lark syntax (may inline `%json` schemas).
    Lark,
}

impl GrammarKind {
    /// The kind named `name`: `json_schema`, `json_object`, `regex` or `lark`.
    pub fn parse(name: &str) -> Result<GrammarKind, GrammarError> {
        Ok(match name {
            "json_schema" => GrammarKind::JsonSchema,
            "json_object" => GrammarKind::JsonObject,
            "regex" => GrammarKind::Regex,
            "lark" => GrammarKind::Lark,
            other => {
                return Err(GrammarError(format!(
                    "unknown grammar kind {other:?} (json_schema, json_object, regex or lark)"
                )))
            }
        })
    }

    /// The kind's name (what [`GrammarKind::parse`] reads).
    pub fn as_str(self) -> &'static str {
        match self {
            GrammarKind::JsonSchema => "json_schema",
            GrammarKind::JsonObject => "json_object",
            GrammarKind::Regex => "regex",
            GrammarKind::Lark => "lark",
        }
    }
}

/// A grammar as written: what crosses a wire (the mesh ships it once per sequence).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrammarSpec {
    /// How `text` is written.
    pub kind: GrammarKind,
    /// The schema, regex or grammar.
    pub text: String,
}

/// JSON written the way models write it: one space after `,` and `:`, no other whitespace.
/// Without it a grammar allows any whitespace between tokens, and a small model can spend
/// its whole budget on newlines; a schema's own `x-guidance` object overrides it.
const JSON_LAYOUT: &str =
    r#"{"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}"#;

impl GrammarSpec {
    fn top_level(&self) -> Result<TopLevelGrammar, GrammarError> {
        let json = |text: &str, bound_numbers: bool| -> Result<TopLevelGrammar, GrammarError> {
            let mut schema: serde_json::Value = serde_json::from_str(text)
                .map_err(|e| GrammarError(format!("the JSON schema is not JSON: {e}")))?;
            // `true` / `false` are schemas too (anything / nothing).
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(GrammarError("a JSON schema is an object".into()));
            }
            if bound_numbers {
                numbers::bound_fraction_digits(&mut schema);
            }
            if let Some(o) = schema.as_object_mut() {
                if !o.contains_key("x-guidance") {
                    let layout = serde_json::from_str(JSON_LAYOUT).expect("a JSON constant");
                    o.insert("x-guidance".into(), layout);
                }
            }
            Ok(TopLevelGrammar::from_json_schema(schema))
        };
        match self.kind {
            GrammarKind::JsonSchema => json(&self.text, true),
            GrammarKind::JsonObject => json(r#"{"type": "object"}"#, false),
            GrammarKind::Regex => Ok(TopLevelGrammar::from_regex(&self.text)),
            GrammarKind::Lark => Ok(TopLevelGrammar::from_lark(self.text.clone())),
        }
    }
}

/// A model's vocabulary for llguidance: each token's bytes (a special token's are `0xFF`
/// followed by its name, as llguidance expects, so no text ever matches it) and the
/// end-of-sequence tokens, allowed only where a grammar accepts. Built once per model (it
/// indexes every token: ~0.2 s for 49k tokens, ~2 s for 262k).
pub struct Vocabulary {
    factory: ParserFactory,
    size: usize,
    eos: Vec<u32>,
}

impl fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Vocabulary")
            .field("size", &self.size)
            .field("eos", &self.eos)
            .finish()
    }
}

impl Vocabulary {
    /// The vocabulary of `tokens` (token `i` is `tokens[i]`), ending sequences with `eos`
    /// (at least one id, each within the vocabulary).
    pub fn new(tokens: Vec<Vec<u8>>, eos: &[u32]) -> Result<Vocabulary, GrammarError> {
        let size = tokens.len();
        if size == 0 || size > u32::MAX as usize {
            return Err(GrammarError(format!("a vocabulary of {size} tokens")));
        }
        let Some(&first) = eos.first() else {
            return Err(GrammarError(
                "a vocabulary needs an end-of-sequence token".into(),
            ));
        };
        if let Some(bad) = eos.iter().find(|&&t| t as usize >= size) {
            return Err(GrammarError(format!(
                "end-of-sequence token {bad} is outside the vocabulary of {size}"
            )));
        }
        let info = TokRxInfo::new(size as u32, first);
        let trie = TokTrie::from(&info, &tokens).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError(e.to_string()))?;
        // Errors are returned to the caller, never printed.
        factory.quiet();
        Ok(Vocabulary {
            factory,
            size,
            eos: eos.to_vec(),
        })
    }

    /// Tokens in the vocabulary.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The end-of-sequence tokens.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// Compiles `spec` against this vocabulary. An error (with llguidance's reason) when the
    /// text is too long, is not valid in its kind, uses what llguidance does not support, or
    /// admits no output at all.
    pub fn compile(self: &Arc<Self>, spec: GrammarSpec) -> Result<Grammar, GrammarError> {
        if spec.text.len() > MAX_GRAMMAR_BYTES {
            return Err(GrammarError(format!(
                "the {} is {} bytes; at most {MAX_GRAMMAR_BYTES} are accepted",
                spec.kind.as_str(),
                spec.text.len()
            )));
        }
        let top = spec.top_level()?;
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| GrammarError(format!("invalid {}: {e}", spec.kind.as_str())))?;
        let mut start = Matcher::new(Ok(parser));
        // The first mask proves the grammar can start (and warms the lexer, which every
        // sequence of this grammar shares).
        let first = start.compute_mask();
        match first {
            Ok(mask) if !mask.is_zero() => {}
            Ok(_) => {
                return Err(GrammarError(format!(
                    "the {} admits no output",
                    spec.kind.as_str()
                )))
            }
            Err(e) => return Err(GrammarError(format!("invalid {}: {e}", spec.kind.as_str()))),
        }
        Ok(Grammar {
            inner: Arc::new(Compiled {
                spec,
                start: Mutex::new(start),
                vocab: Arc::clone(self),
            }),
        })
    }
}

struct Compiled {
    spec: GrammarSpec,
    /// The state before any token (cloned for each sequence; clones share the lexer).
    start: Mutex<Matcher>,
    vocab: Arc<Vocabulary>,
}

/// A compiled grammar: cheap to clone, shared by every sequence that follows it.
#[derive(Clone)]
pub struct Grammar {
    inner: Arc<Compiled>,
}

impl fmt::Debug for Grammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammar")
            .field("kind", &self.inner.spec.kind)
            .field("bytes", &self.inner.spec.text.len())
            .finish()
    }
}

impl PartialEq for Grammar {
    fn eq(&self, other: &Grammar) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            || (self.inner.spec == other.inner.spec
                && Arc::ptr_eq(&self.inner.vocab, &other.inner.vocab))
    }
}

impl Grammar {
    /// The grammar as written.
    pub fn spec(&self) -> &GrammarSpec {
        &self.inner.spec
    }

    /// The vocabulary it was compiled for.
    pub fn vocabulary(&self) -> &Arc<Vocabulary> {
        &self.inner.vocab
    }

    /// A fresh state: no token consumed.
    pub fn start(&self) -> GrammarState {
        let matcher = self
            .inner
            .start
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        GrammarState {
            matcher,
            consumed: 0,
            next_mask: None,
        }
    }
}

/// One sequence's position in its grammar: the tokens it consumed (the sequence's emitted
/// tokens, in order).
pub struct GrammarState {
    matcher: Matcher,
    consumed: usize,
    /// The mask of the current state, computed ahead ([`GrammarState::prepare`]); dropped
    /// whenever the state moves.
    next_mask: Option<SimpleVob>,
}

impl fmt::Debug for GrammarState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrammarState")
            .field("consumed", &self.consumed)
            .field("done", &self.is_done())
            .finish()
    }
}

impl GrammarState {
    /// Tokens consumed so far.
    pub fn consumed(&self) -> usize {
        self.consumed
    }

    /// Whether the grammar is complete: it admits no further token (an end-of-sequence token
    /// was consumed, or the output cannot be extended).
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    /// The tokens allowed next, as a bit set (bit `i % 32` of word `i / 32`): never empty
    /// while the grammar is not done.
    pub fn allowed(&mut self) -> Result<SimpleVob, GrammarError> {
        let mask = match self.next_mask.take() {
            Some(mask) => mask,
            None => self.matcher.compute_mask().map_err(grammar_error)?,
        };
        if mask.is_zero() {
            return Err(GrammarError("the grammar allows no token here".into()));
        }
        Ok(mask)
    }

    /// Computes the mask of the current state ahead of [`GrammarState::allowed`], so it can
    /// run while the forward that produces the logits does. Does nothing when the grammar is
    /// done or in error (then `allowed` reports it).
    pub fn prepare(&mut self) {
        if self.next_mask.is_none() && !self.matcher.is_stopped() {
            self.next_mask = self.matcher.compute_mask().ok();
        }
    }

    /// Consumes `token` (it must be allowed).
    pub fn advance(&mut self, token: u32) -> Result<(), GrammarError> {
        self.next_mask = None;
        self.matcher.consume_token(token).map_err(grammar_error)?;
        self.consumed += 1;
        Ok(())
    }

    /// How many of `tokens`, in order from this state, the grammar accepts (nothing is
    /// consumed): a draft is cut there.
    pub fn accepted_prefix(&mut self, tokens: &[u32]) -> usize {
        if tokens.is_empty() || self.matcher.is_stopped() {
            return 0;
        }
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }

    /// Brings the state to `n` consumed tokens, the emitted tokens before a step's rows:
    /// what it consumed beyond them is rolled back (a step retried after a failure), and when
    /// it is exactly one short, `next` — the token at that place, the step's first row, which
    /// was emitted where this state did not see it (a session rebuilt on another station) —
    /// is consumed. Anything else is an error.
    pub fn align(&mut self, n: usize, next: u32) -> Result<(), GrammarError> {
        if self.consumed > n {
            self.next_mask = None;
            self.matcher
                .rollback(self.consumed - n)
                .map_err(grammar_error)?;
            self.consumed = n;
        } else if self.consumed + 1 == n {
            self.advance(next)?;
        } else if self.consumed < n {
            return Err(GrammarError(format!(
                "the grammar state has consumed {} tokens; the step follows {n}",
                self.consumed
            )));
        }
        Ok(())
    }
}

fn grammar_error(e: impl fmt::Display) -> GrammarError {
    GrammarError(format!("grammar: {e}"))
}

/// The token for position `index` from one logits row, under `state`'s mask when there is
/// one (then consumed by it); and whether the grammar is done after it.
pub fn sample(
    sampler: &mut Sampler,
    state: Option<&mut GrammarState>,
    row: &[f32],
    index: u64,
) -> Result<(u32, bool), GrammarError> {
    let Some(state) = state else {
        let token = sampler.sample(row, index).map_err(|e| GrammarError(e.0))?;
        return Ok((token, false));
    };
    let mask = state.allowed()?;
    let token = sampler
        .sample_masked(row, mask.as_slice(), index)
        .map_err(|e| GrammarError(e.0))?;
    state.advance(token)?;
    Ok((token, state.is_done()))
}

/// Speculative verification ([`Sampler::verify`]) under `state`'s mask when there is one:
/// row by row, the token plain constrained decoding would emit at that position (the mask of
/// the state, the sampler's rule), consumed; a draft is accepted exactly when it is that
/// token. So a draft the grammar rejects is never accepted, and the tokens are those of
/// constrained decoding without drafts. Appends the emitted tokens to `out` (1 to
/// `drafts.len() + 1`, fewer when the grammar is done first); returns whether it is done.
pub fn verify(
    sampler: &mut Sampler,
    state: Option<&mut GrammarState>,
    rows: &[f32],
    vocab: usize,
    drafts: &[u32],
    first_index: u64,
    out: &mut Vec<u32>,
) -> Result<bool, GrammarError> {
    let Some(state) = state else {
        sampler
            .verify(rows, vocab, drafts, first_index, out)
            .map_err(|e| GrammarError(e.0))?;
        return Ok(false);
    };
    if vocab == 0 || rows.len() != (drafts.len() + 1) * vocab {
        return Err(GrammarError(format!(
            "verification needs {} rows of {vocab} logits, got {} values",
            drafts.len() + 1,
            rows.len()
        )));
    }
    for (j, row) in rows.chunks_exact(vocab).enumerate() {
        let (token, done) = sample(sampler, Some(state), row, first_index + j as u64)?;
        out.push(token);
        if done || drafts.get(j) != Some(&token) {
            return Ok(done);
        }
    }
    Ok(false)
}
