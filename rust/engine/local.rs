//! The in-process executor: every sequence's KV ring in this process, one batched forward
//! pass per step over the whole model, the volume cache of [`NativeLlamaPipeline`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use rayon::prelude::*;

use super::executor::{Admission, Admitted, BatchEntry, EntryKind, EntryOutcome, Executor};
use super::request::SeqId;
use super::EngineError;
use crate::attention::SharedPrefix;
use crate::grammar::{self, GrammarState};
use crate::model::{
    token_logprobs, ChunkInput, LayerRange, LogitsWanted, ModelError, NativeLlamaPipeline,
    ReplayOutcome, Sampler, Segment, SequenceKv, SessionConfig, StepBuffers, TokenLogprobs,
};
use crate::ring::SpanType;

struct LocalSeq {
    kv: SequenceKv,
    sampler: Sampler,
    prompt: Vec<u32>,
    salt: Option<String>,
    use_cache: bool,
    want_logits: bool,
    logprobs: Option<usize>,
    prompt_logprobs: Option<usize>,
    /// The state of its grammar, when constrained: advanced by every token sampled here.
    grammar: Option<GrammarState>,
}

/// The log-probabilities of `tokens`, one logits row each (`rows`, concatenated), with
/// `top_n` alternatives.
fn logprobs_of(
    rows: &[f32],
    vocab: usize,
    tokens: &[u32],
    top_n: usize,
) -> Result<Vec<TokenLogprobs>, EngineError> {
    tokens
        .iter()
        .zip(rows.chunks_exact(vocab))
        .map(|(&t, row)| token_logprobs(row, t, top_n))
        .collect::<Result<_, _>>()
        .map_err(|e| EngineError::Executor(format!("log-probabilities: {e}")))
}

/// Runs batches in this process over a pipeline that spans the whole model. The pipeline
/// (its volume cache) is shared: its owner may configure or inspect the cache between steps.
pub struct LocalExecutor {
    pipeline: Arc<Mutex<NativeLlamaPipeline>>,
    range: LayerRange,
    session: SessionConfig,
    seqs: HashMap<SeqId, LocalSeq>,
    /// Rings of released sequences, reset, reused so a new sequence pays no page faults.
    pool: Vec<SequenceKv>,
    max_pooled: usize,
    bufs: StepBuffers,
    hidden: Vec<Vec<f32>>,
    logits: Vec<Vec<f32>>,
    /// Captures the last step's prompt chunks owe, run before anything touches the KV,
    /// the step's rows or the cache again (the next admit, run or release), so a request's
    /// first token is handed out before its volume is copied.
    pending_captures: Vec<PendingCapture>,
}

/// A prompt chunk whose volumes are still to be captured: its entry in the last batch
/// (`row`, where its hidden rows and logits still are) and the positions it computed.
struct PendingCapture {
    seq: SeqId,
    row: usize,
    start: usize,
    len: usize,
    last: bool,
}

impl LocalExecutor {
    /// An executor over `pipeline` (which must span every layer) whose sequences get rings
    /// shaped by `session`; up to `max_pooled` released rings are kept for reuse.
    pub fn new(
        pipeline: Arc<Mutex<NativeLlamaPipeline>>,
        session: SessionConfig,
        max_pooled: usize,
    ) -> Result<LocalExecutor, EngineError> {
        let (weights, (lo, hi)) = {
            let p = lock(&pipeline);
            (Arc::clone(p.weights()), p.layer_range())
        };
        if (lo, hi) != (0, weights.config().n_layers) {
            return Err(EngineError::Input(format!(
                "an in-process executor needs every layer, not {lo}..{hi}: use a mesh for ranges"
            )));
        }
        let range = LayerRange::new(weights, lo, hi)?;
        // Validate the ring geometry once, up front.
        let probe = range.new_kv(&session)?;
        let bufs = StepBuffers::new(
            range.weights().config(),
            probe.max_chunk(),
            probe.rings().max_keys(),
        );
        Ok(LocalExecutor {
            pipeline,
            range,
            session,
            seqs: HashMap::new(),
            pool: vec![probe],
            max_pooled,
            bufs,
            hidden: Vec::new(),
            logits: Vec::new(),
            pending_captures: Vec::new(),
        })
    }

    /// The pipeline (its volume cache), locked.
    pub fn pipeline(&self) -> MutexGuard<'_, NativeLlamaPipeline> {
        lock(&self.pipeline)
    }

    /// The ring geometry of new sequences.
    pub fn session_config(&self) -> &SessionConfig {
        &self.session
    }

    /// Sequences holding a ring.
    pub fn live(&self) -> usize {
        self.seqs.len()
    }

    fn take_kv(&mut self) -> Result<SequenceKv, ModelError> {
        match self.pool.pop() {
            Some(kv) => Ok(kv),
            None => self.range.new_kv(&self.session),
        }
    }

    fn admit_one(&mut self, a: &Admission) -> Result<Admitted, EngineError> {
        let vocab = self.range.weights().config().vocab;
        if let Some(bad) = a.prompt.iter().find(|&&t| t as usize >= vocab) {
            // Checked before the cache is consulted, so a bad prompt changes no counter.
            return Err(EngineError::Input(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let input = |e: crate::model::SamplingError| EngineError::Input(e.to_string());
        a.sampling.adjust.check_vocab(vocab).map_err(input)?;
        let mut sampler = Sampler::new(a.sampling.clone()).map_err(input)?;
        sampler.begin(&a.prompt);
        let mut grammar = match &a.grammar {
            Some(g) if g.vocabulary().size() > vocab => {
                return Err(EngineError::Input(format!(
                    "the grammar's vocabulary has {} tokens, the model {vocab}",
                    g.vocabulary().size()
                )))
            }
            Some(g) => Some(g.start()),
            None => None,
        };
        let mut kv = self.take_kv()?;
        let mut admitted = Admitted::default();
        let replay = {
            let mut pipeline = lock(&self.pipeline);
            // Prompt log-probabilities need every prompt row's logits, which no volume keeps.
            if a.use_cache && a.prompt_logprobs.is_none() && pipeline.cache().is_enabled() {
                pipeline.amplituhedron_replay(&mut kv, &a.prompt, a.salt.as_deref())
            } else {
                Ok(ReplayOutcome::Miss)
            }
        };
        match replay {
            Ok(ReplayOutcome::Hit {
                logits: Some(logits),
                ..
            }) => {
                admitted.cached_tokens = a.prompt.len();
                if a.sample_first {
                    // Masked like a fresh row when constrained.
                    let index = a.prompt.len() as u64;
                    let sampled = grammar::sample(&mut sampler, grammar.as_mut(), &logits, index);
                    let (token, done) = match sampled {
                        Ok(t) => t,
                        Err(e) => {
                            kv.reset();
                            self.pool.push(kv);
                            return Err(EngineError::Executor(format!(
                                "sampling a cached token: {e}"
                            )));
                        }
                    };
                    admitted.first_token = Some(token);
                    admitted.done = done;
                    if let Some(n) = a.logprobs {
                        let mut lp = logprobs_of(&logits, logits.len(), &[token], n)?;
                        admitted.first_logprobs = lp.pop();
                    }
                    admitted.first_logits = a.want_logits.then_some(logits);
                }
            }
            // A volume without logits (a long prompt's head, captured mid-prefill) cannot
            // seed sampling: its last position runs again to give the first token (the
            // scheduler plans it; the run rolls the ring back to it).
            Ok(ReplayOutcome::Hit { logits: None, .. }) => admitted.cached_tokens = a.prompt.len(),
            Ok(ReplayOutcome::Miss) => kv.reset(),
            Ok(ReplayOutcome::Partial { kv_len }) => admitted.cached_tokens = kv_len,
            Err(e) => {
                kv.reset();
                self.pool.push(kv);
                return Err(e.into());
            }
        }
        self.seqs.insert(
            a.seq,
            LocalSeq {
                kv,
                sampler,
                prompt: a.prompt.clone(),
                salt: a.salt.clone(),
                use_cache: a.use_cache,
                want_logits: a.want_logits,
                logprobs: a.logprobs,
                prompt_logprobs: a.prompt_logprobs,
                grammar,
            },
        );
        Ok(admitted)
    }

    /// Captures what the last step's prompt chunks completed (a failed capture never fails
    /// the sequence; refusals are counted in the cache's stats): the prompt's first
    /// `max_prefix_len` tokens when the prompt is longer and the chunk computed that
    /// position (its hidden row as the tail, no logits), so the next prompt that shares
    /// them (a long system prompt, a RAG preamble) replays them and prefills only the rest;
    /// and at the prompt's last chunk the whole prompt with its logits. Each from this
    /// sequence's own KV and the chunk's hidden rows, which stay untouched until this runs.
    fn flush_captures(&mut self) {
        if self.pending_captures.is_empty() {
            return;
        }
        let mut pipeline = lock(&self.pipeline);
        let head = pipeline.cache().config().max_prefix_len;
        let hidden_w = self.range.weights().config().hidden;
        let vocab = self.range.weights().config().vocab;
        for c in self.pending_captures.drain(..) {
            let Some(s) = self.seqs.get(&c.seq) else {
                continue;
            };
            if !s.use_cache || !pipeline.cache().is_enabled() {
                continue;
            }
            let hidden = &self.hidden[c.row];
            let tail = |position: usize| {
                let at = (position - c.start) * hidden_w;
                &hidden[at..at + hidden_w]
            };
            let salt = s.salt.as_deref();
            if s.prompt.len() > head && (c.start..c.start + c.len).contains(&(head - 1)) {
                let _ = pipeline.amplituhedron_capture(
                    &s.kv,
                    &s.prompt[..head],
                    tail(head - 1),
                    None,
                    salt,
                );
            }
            if c.last {
                let last = c.start + c.len - 1;
                // The last row's (a chunk that kept every row's logits has them last).
                let rows = &self.logits[c.row];
                let logits = Some(&rows[rows.len() - vocab..]);
                let _ = pipeline.amplituhedron_capture(&s.kv, &s.prompt, tail(last), logits, salt);
            }
        }
    }
}

impl Executor for LocalExecutor {
    fn admit(&mut self, admissions: &[Admission]) -> Vec<Result<Admitted, EngineError>> {
        // An admission may replay what the last step captures.
        self.flush_captures();
        admissions.iter().map(|a| self.admit_one(a)).collect()
    }

    fn run(&mut self, batch: &[BatchEntry]) -> Result<Vec<EntryOutcome>, EngineError> {
        self.flush_captures();
        let vocab = self.range.weights().config().vocab;
        // Every entry's sequence must exist and be at (or past) its start: positions past
        // it are drafts the previous step rejected.
        for e in batch {
            let s = self.seqs.get_mut(&e.seq).ok_or_else(|| {
                EngineError::Executor(format!("sequence {} has no KV here", e.seq))
            })?;
            let clock = s.kv.clock() as usize;
            if clock > e.start {
                s.kv.rollback(e.start as u64)?;
            } else if clock < e.start {
                return Err(EngineError::Executor(format!(
                    "sequence {} holds {clock} positions, the step starts at {}",
                    e.seq, e.start
                )));
            }
        }
        self.hidden.resize_with(batch.len(), Vec::new);
        self.logits.resize_with(batch.len(), Vec::new);
        // Prompt chunks of sequences that asked for prompt log-probabilities keep every row.
        let every_row: Vec<Option<usize>> = batch
            .iter()
            .map(|e| match e.kind {
                EntryKind::Prefill { .. } => self.seqs[&e.seq].prompt_logprobs,
                EntryKind::Decode => None,
            })
            .collect();
        {
            let prompts: Vec<(&[u32], Option<&str>)> = batch
                .iter()
                .map(|e| {
                    let s = &self.seqs[&e.seq];
                    (s.prompt.as_slice(), s.salt.as_deref())
                })
                .collect();
            let shared = shared_prefixes(&prompts);
            // Where each constrained entry's grammar stands before its first sampled row.
            let aligned: HashMap<SeqId, (usize, u32)> = batch
                .iter()
                .filter_map(|e| first_sampled_state(e, self.seqs[&e.seq].prompt.len()))
                .collect();
            // One mutable borrow of each entry's KV (and grammar): entries name distinct
            // sequences.
            let mut kvs: HashMap<SeqId, &mut SequenceKv> = HashMap::new();
            let mut states: Vec<(&mut GrammarState, (usize, u32))> = Vec::new();
            for (id, s) in &mut self.seqs {
                if let (Some(g), Some(&at)) = (s.grammar.as_mut(), aligned.get(id)) {
                    states.push((g, at));
                }
                kvs.insert(*id, &mut s.kv);
            }
            let mut segments = Vec::with_capacity(batch.len());
            for ((((e, h), l), shared_prefix), every_row) in batch
                .iter()
                .zip(&mut self.hidden)
                .zip(&mut self.logits)
                .zip(shared)
                .zip(&every_row)
            {
                let kv = kvs.remove(&e.seq).ok_or_else(|| {
                    EngineError::Executor(format!("sequence {} appears twice in a batch", e.seq))
                })?;
                let (span, logits) = match e.kind {
                    EntryKind::Prefill { .. } if every_row.is_some() => {
                        (SpanType::User, LogitsWanted::All)
                    }
                    EntryKind::Prefill { last: false, .. } => (SpanType::User, LogitsWanted::None),
                    EntryKind::Prefill { last: true, .. } => (SpanType::User, LogitsWanted::Last),
                    EntryKind::Decode if e.tokens.len() == 1 => {
                        (SpanType::ResponseSentence, LogitsWanted::Last)
                    }
                    EntryKind::Decode => (SpanType::ResponseSentence, LogitsWanted::All),
                };
                segments.push(Segment {
                    kv,
                    input: ChunkInput::Tokens(&e.tokens),
                    span,
                    logits,
                    hidden_out: h,
                    logits_out: l,
                    shared_prefix,
                });
            }
            // The masks of the first sampled rows are computed while the forward runs (on
            // whichever worker is free): the same masks, off the step's critical path. A
            // state that cannot be aligned or masked fails below, where its entry samples.
            let (forward, ()) =
                self.range
                    .forward_batch_alongside(&mut segments, &mut self.bufs, || {
                        states.par_iter_mut().for_each(|(g, (n, next))| {
                            if g.align(*n, *next).is_ok() {
                                g.prepare();
                            }
                        })
                    });
            forward?;
        }
        let mut outcomes = Vec::with_capacity(batch.len());
        for (k, e) in batch.iter().enumerate() {
            // Taken for the borrow checker and put back below: the buffers keep their capacity,
            // so a step allocates no logits (1 MB per row for a 262k vocabulary).
            let logits = std::mem::take(&mut self.logits[k]);
            let mut out = EntryOutcome::default();
            if let Some(n) = every_row[k] {
                // Row i predicts the prompt token after it; the last prompt row predicts the
                // first output token instead.
                let prompt = &self.seqs[&e.seq].prompt;
                let next = &prompt[(e.start + 1).min(prompt.len())..];
                let rows = e.tokens.len().min(next.len());
                out.prompt_logprobs = logprobs_of(&logits, vocab, &next[..rows], n)?;
            }
            // The row a prompt's first token is sampled from: its last.
            let last_row = logits.len().saturating_sub(vocab);
            if let EntryKind::Prefill { last, .. } = e.kind {
                self.pending_captures.push(PendingCapture {
                    seq: e.seq,
                    row: k,
                    start: e.start,
                    len: e.tokens.len(),
                    last,
                });
            }
            match e.kind {
                EntryKind::Prefill { last: false, .. } => {}
                EntryKind::Prefill { last: true, emit } => {
                    if emit {
                        let s = self.seqs.get_mut(&e.seq).expect("checked above");
                        let index = (e.start + e.tokens.len()) as u64;
                        let row = &logits[last_row..];
                        let (n, next) = first_sampled_state(e, s.prompt.len()).expect("emits").1;
                        let sampled = match s.grammar.as_mut() {
                            // Nothing emitted yet: the state starts from no token.
                            Some(g) => g.align(n, next).map(|()| Some(g)),
                            None => Ok(None),
                        }
                        .and_then(|g| grammar::sample(&mut s.sampler, g, row, index));
                        match sampled {
                            Ok((token, done)) => {
                                out.emitted.push(token);
                                out.done = done;
                            }
                            Err(err) if s.grammar.is_some() => out.error = Some(err.0),
                            Err(err) => return Err(EngineError::Executor(err.0)),
                        }
                        if let Some(n) = s.logprobs {
                            out.logprobs = logprobs_of(row, vocab, &out.emitted, n)?;
                        }
                        out.logits = s.want_logits.then(|| row.to_vec());
                    }
                }
                EntryKind::Decode => {
                    let s = self.seqs.get_mut(&e.seq).expect("checked above");
                    let (n, next) = first_sampled_state(e, s.prompt.len()).expect("samples").1;
                    let verified = match s.grammar.as_mut() {
                        // The state follows the tokens before the entry's drafts.
                        Some(g) => g.align(n, next).map(|()| Some(g)),
                        None => Ok(None),
                    }
                    .and_then(|g| {
                        grammar::verify(
                            &mut s.sampler,
                            g,
                            &logits,
                            vocab,
                            &e.tokens[1..],
                            (e.start + 1) as u64,
                            &mut out.emitted,
                        )
                    });
                    match verified {
                        Ok(done) => out.done = done,
                        Err(err) if s.grammar.is_some() => out.error = Some(err.0),
                        Err(err) => return Err(EngineError::Executor(err.0)),
                    }
                    if let Some(n) = s.logprobs {
                        out.logprobs = logprobs_of(&logits, vocab, &out.emitted, n)?;
                    }
                    if s.want_logits {
                        out.logits = Some(logits[..out.emitted.len() * vocab].to_vec());
                    }
                }
            }
            self.logits[k] = logits;
            outcomes.push(out);
        }
        Ok(outcomes)
    }

    fn release(&mut self, seq: SeqId) {
        self.flush_captures();
        if let Some(mut s) = self.seqs.remove(&seq) {
            if self.pool.len() < self.max_pooled {
                s.kv.reset();
                self.pool.push(s.kv);
            }
        }
    }
}

/// For an entry that samples from a constrained sequence's logits, the tokens its grammar
/// has consumed before the first sampled row and the token at that place
/// ([`GrammarState::align`]): none at a prompt's last chunk, the emitted tokens before the
/// entry's drafts at a decode step.
fn first_sampled_state(e: &BatchEntry, prompt_len: usize) -> Option<(SeqId, (usize, u32))> {
    match e.kind {
        EntryKind::Prefill {
            last: true,
            emit: true,
        } => Some((e.seq, (0, 0))),
        EntryKind::Prefill { .. } => None,
        EntryKind::Decode => Some((
            e.seq,
            (e.start + 1 - prompt_len.min(e.start + 1), e.tokens[0]),
        )),
    }
}

/// Shorter common prompt prefixes are not worth reading from another sequence's ring.
const MIN_SHARED_PREFIX: usize = 32;

/// For each entry, the first earlier entry of the same tenant (salt) whose prompt starts
/// with the same `MIN_SHARED_PREFIX` tokens or more, and how many they have in common: a
/// system prompt many requests share is then read from one ring by all of them. The rows
/// are the same bits in every ring (same tokens at the same positions), so this changes
/// where attention reads them, never what it computes.
fn shared_prefixes(prompts: &[(&[u32], Option<&str>)]) -> Vec<Option<SharedPrefix>> {
    let common = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    prompts
        .iter()
        .enumerate()
        .map(|(i, &(prompt, salt))| {
            prompts[..i]
                .iter()
                .enumerate()
                .find_map(|(j, &(other, other_salt))| {
                    let clocks = common(prompt, other);
                    (salt == other_salt && clocks >= MIN_SHARED_PREFIX)
                        .then_some(SharedPrefix { chunk: j, clocks })
                })
        })
        .collect()
}

/// The pipeline's lock. A panic while it was held cannot leave the cache half-updated (every
/// cache operation validates before it writes), so a poisoned lock is still usable.
fn lock(p: &Mutex<NativeLlamaPipeline>) -> MutexGuard<'_, NativeLlamaPipeline> {
    p.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_share_the_first_long_enough_prefix_of_their_own_tenant() {
        let system: Vec<u32> = (0..40).collect();
        let with = |tail: &[u32]| [system.as_slice(), tail].concat();
        let (a, b, c) = (with(&[7, 8]), with(&[7, 9, 9]), with(&[5]));
        let short: Vec<u32> = (0..20).collect();
        let prompts: Vec<(&[u32], Option<&str>)> = vec![
            (&short, None),   // 20 tokens in common with the others: too few
            (&a, Some("t1")), // the first of tenant t1
            (&b, None),       // no earlier prompt of its tenant shares enough
            (&c, Some("t1")), // shares the system prompt with a
            (&b, Some("t1")), // shares 41 tokens with a (the first match, not c)
            (&a, None),       // shares 41 with b
        ];
        let got = shared_prefixes(&prompts);
        let sp = |chunk, clocks| Some(SharedPrefix { chunk, clocks });
        assert_eq!(got, vec![None, None, None, sp(1, 40), sp(1, 41), sp(2, 41)]);
    }
}
