//! The engine: requests, the waiting queue, the running set, and the plan of each step.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Instant;

use super::draft::{DraftController, StepCost};
use super::executor::{Admission, Admitted, BatchEntry, EntryKind, EntryOutcome, Executor};
use super::request::{Event, FinishReason, Request, SeqId, SeqStats};
use super::EngineError;
use crate::grammar::GrammarState;
use crate::model::{TokenLogprobs, MAX_TOP_LOGPROBS};

/// Bounds of the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Sequences running (decoding or prefilling) at once: the largest batch.
    pub max_running: usize,
    /// Requests waiting for a place; beyond it `submit` answers [`EngineError::QueueFull`].
    pub max_queue: usize,
    /// Rows per step: every running sequence's decode rows first, then prompt chunks with
    /// what is left. Bounds a step's latency, so a long prompt never stalls the streams.
    pub step_tokens: usize,
    /// Prompt rows per chunk of a sequence that asked for prompt log-probabilities: each of
    /// those rows keeps its vocabulary-wide logits until its score is taken
    /// ([`EngineConfig::scored_rows_for`] sizes it to a model).
    pub scored_rows: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running: 8,
            max_queue: 64,
            step_tokens: 64,
            scored_rows: 32,
        }
    }
}

/// Logits a scored prompt chunk may keep at once.
const SCORED_LOGITS_BYTES: usize = 32 << 20;

impl EngineConfig {
    /// Scored prompt rows per chunk for a `vocab`-wide model: as many as fit
    /// [`SCORED_LOGITS_BYTES`] of logits (170 for a 49k vocabulary, 32 for 262k), 8 to 256.
    pub fn scored_rows_for(vocab: usize) -> usize {
        (SCORED_LOGITS_BYTES / (4 * vocab.max(1))).clamp(8, 256)
    }

    /// Checks the bounds: every running sequence must fit a step with one row.
    pub fn validate(&self) -> Result<(), EngineError> {
        if self.max_running == 0 {
            return Err(EngineError::Input("max_running must be at least 1".into()));
        }
        if self.scored_rows == 0 {
            return Err(EngineError::Input("scored_rows must be at least 1".into()));
        }
        if self.step_tokens < self.max_running {
            return Err(EngineError::Input(format!(
                "step_tokens ({}) must be at least max_running ({}): every running sequence \
                 decodes one row per step",
                self.step_tokens, self.max_running
            )));
        }
        Ok(())
    }
}

#[derive(Debug)]
enum Phase {
    Queued,
    /// Prompt positions `[0, next)` are in the KV.
    Prefill {
        next: usize,
    },
    /// `pending` (the last emitted token) has not been run yet.
    Decode,
}

#[derive(Debug)]
struct Sequence {
    req: Request,
    phase: Phase,
    /// Prompt followed by every emitted token.
    tokens: Vec<u32>,
    drafter: Option<DraftController>,
    stats: SeqStats,
    submitted: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    /// Drafts sent with the sequence's entry in the step under way.
    in_flight_drafts: usize,
    /// Prompt log-probabilities computed so far (when the request asked for them).
    prompt_logprobs: Vec<TokenLogprobs>,
    /// A constrained, speculating sequence: its grammar advanced by every emitted token, to
    /// cut drafts at their first token the grammar rejects (the executor, which samples,
    /// holds the state that masks).
    drafts_grammar: Option<GrammarState>,
}

impl Sequence {
    fn emitted(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }
}

/// The continuous-batching engine. See the module docs of [`crate::engine`].
///
/// With an in-process executor, call [`step`]. An asynchronous executor (the mesh) drives
/// the same state machine in its own loop: [`Engine::plan_admissions`] →
/// [`Engine::admitted`] → [`Engine::plan_batch`] → [`Engine::complete`], releasing
/// [`Engine::take_released`] as it goes.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    running: Vec<SeqId>,
    released: Vec<SeqId>,
    next_id: SeqId,
    draft_buf: Vec<u32>,
    /// The cost of decode steps by rows, learned as they run (sizes the drafts).
    step_cost: StepCost,
    /// The batch being run: when it was planned, and its rows.
    planned: Option<Planned>,
    /// Totals of the batches run so far.
    totals: StepTotals,
}

/// A planned batch, until its outcome is applied.
#[derive(Clone, Copy, Debug)]
struct Planned {
    at: Instant,
    prompt_rows: usize,
    decode_rows: usize,
}

/// Totals of the batches an engine has run (its executor's load, for metrics): how many,
/// what they computed, and how long they were in flight. Over an external executor (a mesh)
/// a batch is in flight from `plan_batch` to `complete`, hops included.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTotals {
    /// Batches run.
    pub steps: u64,
    /// Prompt rows prefilled.
    pub prompt_rows: u64,
    /// Decode rows: one per decoding sequence and step, plus drafts verified.
    pub decode_rows: u64,
    /// Seconds a batch was in flight.
    pub busy_seconds: f64,
}

impl Engine {
    /// An empty engine.
    pub fn new(cfg: EngineConfig) -> Result<Engine, EngineError> {
        cfg.validate()?;
        Ok(Engine {
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            released: Vec::new(),
            next_id: 1,
            draft_buf: Vec::new(),
            step_cost: StepCost::default(),
            planned: None,
            totals: StepTotals::default(),
        })
    }

    /// The bounds.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Queues a request. Refused (nothing queued) when it is invalid or the queue is full.
    pub fn submit(&mut self, req: Request) -> Result<SeqId, EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::Input(
                "the prompt is empty: a volume needs at least one token".into(),
            ));
        }
        req.sampling
            .validate()
            .map_err(|e| EngineError::Input(e.to_string()))?;
        if let Some(d) = &req.draft {
            d.validate().map_err(EngineError::Input)?;
        }
        for n in [req.logprobs, req.prompt_logprobs].into_iter().flatten() {
            if n > MAX_TOP_LOGPROBS {
                return Err(EngineError::Input(format!(
                    "at most {MAX_TOP_LOGPROBS} top log-probabilities per token, got {n}"
                )));
            }
        }
        if self.waiting.len() >= self.cfg.max_queue {
            return Err(EngineError::QueueFull {
                waiting: self.waiting.len(),
                max_queue: self.cfg.max_queue,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        let drafts_grammar = match (&req.grammar, &req.draft) {
            (Some(g), Some(_)) => Some(g.start()),
            _ => None,
        };
        let seq = Sequence {
            drafts_grammar,
            tokens: req.prompt.clone(),
            drafter: req.draft.as_ref().map(DraftController::new),
            stats: SeqStats {
                prompt_tokens: req.prompt.len(),
                ..SeqStats::default()
            },
            req,
            phase: Phase::Queued,
            submitted: Instant::now(),
            admitted: None,
            first_token: None,
            in_flight_drafts: 0,
            prompt_logprobs: Vec::new(),
        };
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Cancels a sequence (waiting or running); its KV is released at the next step. Returns
    /// its `Finished` event, or None when it is unknown or already finished.
    pub fn cancel(&mut self, seq: SeqId) -> Option<Event> {
        self.seqs
            .contains_key(&seq)
            .then(|| self.finish(seq, FinishReason::Cancelled))
    }

    /// Requests waiting for a place.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences admitted and not finished.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Prompt positions of `seq` already in its KV (replayed or prefilled), or None when it
    /// is unknown or finished: progress reports for long prompts.
    pub fn prefilled(&self, seq: SeqId) -> Option<usize> {
        let s = self.seqs.get(&seq)?;
        Some(match s.phase {
            Phase::Queued => 0,
            Phase::Prefill { next } => next,
            Phase::Decode => s.req.prompt.len(),
        })
    }

    /// Whether anything is left to do (waiting, running, or KV to release).
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || !self.released.is_empty()
    }

    /// Sequences whose KV the executor should free now.
    pub fn take_released(&mut self) -> Vec<SeqId> {
        std::mem::take(&mut self.released)
    }

    /// Moves waiting requests into the running set while there is room; the executor must
    /// [`Executor::admit`] them and hand the results to [`Engine::admitted`].
    pub fn plan_admissions(&mut self) -> Vec<Admission> {
        let mut out = Vec::new();
        while self.running.len() < self.cfg.max_running {
            let Some(id) = self.waiting.pop_front() else {
                break;
            };
            let seq = self.seqs.get_mut(&id).expect("waiting sequences exist");
            seq.admitted = Some(Instant::now());
            seq.stats.queue_ms = ms(seq.submitted, Instant::now());
            seq.phase = Phase::Prefill { next: 0 };
            self.running.push(id);
            out.push(Admission {
                seq: id,
                prompt: seq.req.prompt.clone(),
                sampling: seq.req.sampling.clone(),
                salt: seq.req.salt.clone(),
                use_cache: seq.req.use_cache,
                sample_first: seq.req.max_new_tokens > 0,
                want_logits: seq.req.want_logits,
                logprobs: seq.req.logprobs,
                prompt_logprobs: seq.req.prompt_logprobs,
                grammar: seq.req.grammar.clone(),
            });
        }
        out
    }

    /// Applies admission results (one per admission, in order).
    pub fn admitted(
        &mut self,
        admissions: &[Admission],
        results: Vec<Result<Admitted, EngineError>>,
    ) -> Vec<Event> {
        let mut events = Vec::new();
        for (a, result) in admissions.iter().zip(results) {
            let Some(seq) = self.seqs.get_mut(&a.seq) else {
                // Cancelled meanwhile: its KV (if any) is freed by the release list.
                continue;
            };
            match result {
                Err(e) => events.push(self.finish(a.seq, FinishReason::Error(e.to_string()))),
                Ok(adm) => {
                    let n = seq.req.prompt.len();
                    if seq.req.prompt_logprobs.is_some() {
                        // Every prompt row's logits are wanted: nothing replayed counts (the
                        // run rolls back whatever an executor replayed anyway).
                        seq.phase = Phase::Prefill { next: 0 };
                        seq.stats.cached_tokens = 0;
                        continue;
                    }
                    seq.stats.cached_tokens = adm.cached_tokens.min(n);
                    match adm.first_token {
                        Some(token) if adm.cached_tokens == n => {
                            seq.stats.cache_hit = true;
                            seq.phase = Phase::Decode;
                            let logits = adm.first_logits.map(|l| vec![l]);
                            let logprobs = adm.first_logprobs.into_iter().collect();
                            events.extend(self.emit(a.seq, &[token], logits, logprobs, adm.done));
                        }
                        _ if adm.cached_tokens == n && seq.req.max_new_tokens == 0 => {
                            seq.stats.cache_hit = true;
                            events.push(self.finish(a.seq, FinishReason::Length));
                        }
                        _ => {
                            // Keep at least the last prompt position to run: its logits
                            // give the first token.
                            let next = adm.cached_tokens.min(n - 1);
                            seq.phase = Phase::Prefill { next };
                            seq.stats.cached_tokens = next;
                        }
                    }
                }
            }
        }
        events
    }

    /// Plans one batch under the step budget: decode rows (and drafts) of every decoding
    /// sequence, then prompt chunks in admission order with the rows left.
    pub fn plan_batch(&mut self) -> Vec<BatchEntry> {
        let mut budget = self.cfg.step_tokens;
        let mut batch = Vec::new();
        let decoding: Vec<SeqId> = self
            .running
            .iter()
            .copied()
            .filter(|id| matches!(self.seqs[id].phase, Phase::Decode))
            .collect();
        // Rows the other decoding sequences still need, so drafts never crowd them out.
        let mut reserved = decoding.len();
        for id in decoding {
            reserved -= 1;
            let seq = self.seqs.get_mut(&id).expect("running sequences exist");
            let start = seq.tokens.len() - 1;
            let mut tokens = vec![seq.tokens[start]];
            // Drafts beyond the last token the request may still emit are wasted rows.
            let useful = seq.req.max_new_tokens.saturating_sub(seq.emitted() + 1);
            let room = budget.saturating_sub(1 + reserved);
            if let Some(d) = seq.drafter.as_mut() {
                let limit = useful.min(room);
                d.draft(
                    &seq.tokens,
                    limit,
                    Some(&self.step_cost),
                    &mut self.draft_buf,
                );
                if let Some(g) = seq.drafts_grammar.as_mut() {
                    // Rows past a token the grammar rejects could never be accepted.
                    let keep = g.accepted_prefix(&self.draft_buf);
                    self.draft_buf.truncate(keep);
                }
                tokens.extend_from_slice(&self.draft_buf);
            }
            seq.in_flight_drafts = tokens.len() - 1;
            budget -= tokens.len();
            batch.push(BatchEntry {
                seq: id,
                start,
                tokens,
                kind: EntryKind::Decode,
            });
        }
        for &id in &self.running {
            if budget == 0 {
                break;
            }
            let seq = self.seqs.get_mut(&id).expect("running sequences exist");
            let Phase::Prefill { next } = seq.phase else {
                continue;
            };
            let n = seq.req.prompt.len();
            // A chunk whose every row's logits are kept is bounded (they are vocab-wide).
            let rows = match seq.req.prompt_logprobs {
                Some(_) => budget.min(self.cfg.scored_rows),
                None => budget,
            };
            let end = (next + rows).min(n);
            budget -= end - next;
            batch.push(BatchEntry {
                seq: id,
                start: next,
                tokens: seq.req.prompt[next..end].to_vec(),
                kind: EntryKind::Prefill {
                    last: end == n,
                    emit: end == n && seq.req.max_new_tokens > 0,
                },
            });
        }
        let rows_of = |decode: bool| -> usize {
            batch
                .iter()
                .filter(|e| (e.kind == EntryKind::Decode) == decode)
                .map(|e| e.tokens.len())
                .sum()
        };
        self.planned = (!batch.is_empty()).then(|| Planned {
            at: Instant::now(),
            prompt_rows: rows_of(false),
            decode_rows: rows_of(true),
        });
        batch
    }

    /// Totals of the batches run so far.
    pub fn step_totals(&self) -> StepTotals {
        self.totals
    }

    /// Applies the outcome of a batch planned by [`Engine::plan_batch`]. On an executor
    /// error every sequence of the batch finishes with that error (no token is emitted after
    /// a failure).
    pub fn complete(
        &mut self,
        batch: &[BatchEntry],
        outcome: Result<Vec<EntryOutcome>, EngineError>,
    ) -> Vec<Event> {
        let mut events = Vec::new();
        if let Some(p) = self.planned.take() {
            let seconds = p.at.elapsed().as_secs_f64();
            // Only decode-only steps that succeeded teach the draft sizing their cost.
            if p.prompt_rows == 0 && outcome.is_ok() {
                self.step_cost.observe(p.decode_rows, seconds);
            }
            let t = &mut self.totals;
            t.steps += 1;
            t.prompt_rows += p.prompt_rows as u64;
            t.decode_rows += p.decode_rows as u64;
            t.busy_seconds += seconds;
        }
        let outcomes = match outcome {
            Ok(o) if o.len() == batch.len() => o,
            Ok(o) => {
                let msg = format!(
                    "the executor answered {} outcomes for a batch of {}",
                    o.len(),
                    batch.len()
                );
                return self.fail_batch(batch, &msg);
            }
            Err(e) => return self.fail_batch(batch, &e.to_string()),
        };
        for (entry, out) in batch.iter().zip(outcomes) {
            let Some(seq) = self.seqs.get_mut(&entry.seq) else {
                continue; // cancelled while the step ran
            };
            match entry.kind {
                EntryKind::Prefill { last, emit } => {
                    let end = entry.start + entry.tokens.len();
                    seq.phase = Phase::Prefill { next: end };
                    seq.prompt_logprobs.extend(out.prompt_logprobs);
                    if last && seq.req.prompt_logprobs.is_some() {
                        events.push(Event::Prompt {
                            seq: entry.seq,
                            logprobs: std::mem::take(&mut seq.prompt_logprobs),
                        });
                    }
                    if last && !emit {
                        events.push(self.finish(entry.seq, FinishReason::Length));
                    } else if last {
                        seq.phase = Phase::Decode;
                        let logits = split_rows(out.logits, out.emitted.len());
                        events.extend(self.emit(
                            entry.seq,
                            &out.emitted,
                            logits,
                            out.logprobs,
                            out.done,
                        ));
                    }
                }
                EntryKind::Decode => {
                    let proposed = std::mem::take(&mut seq.in_flight_drafts);
                    if proposed > 0 {
                        let accepted = out.emitted.len().saturating_sub(1);
                        seq.stats.draft_proposed += proposed;
                        seq.stats.draft_accepted += accepted;
                        seq.stats.verify_steps += 1;
                        if let Some(d) = seq.drafter.as_mut() {
                            d.observe(proposed, accepted, Some(&self.step_cost));
                        }
                    }
                    let logits = split_rows(out.logits, out.emitted.len());
                    events.extend(self.emit(
                        entry.seq,
                        &out.emitted,
                        logits,
                        out.logprobs,
                        out.done,
                    ));
                }
            }
            if let Some(error) = out.error {
                // This entry alone failed: its sequence ends after what it emitted.
                if self.seqs.contains_key(&entry.seq) {
                    events.push(self.finish(entry.seq, FinishReason::Error(error)));
                }
            }
        }
        events
    }

    fn fail_batch(&mut self, batch: &[BatchEntry], msg: &str) -> Vec<Event> {
        batch
            .iter()
            .filter(|e| self.seqs.contains_key(&e.seq))
            .map(|e| e.seq)
            .collect::<Vec<_>>()
            .into_iter()
            .map(|seq| self.finish(seq, FinishReason::Error(msg.to_string())))
            .collect()
    }

    /// Appends emitted tokens, stopping at a stop id or the length limit, or after the last
    /// one when `done` (the sequence's grammar is complete).
    fn emit(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        logits: Option<Vec<Vec<f32>>>,
        logprobs: Vec<TokenLogprobs>,
        done: bool,
    ) -> Vec<Event> {
        let mut events = Vec::new();
        let mut logits = logits.map(Vec::into_iter);
        let mut logprobs = logprobs.into_iter();
        let mut reason = None;
        {
            let seq = self.seqs.get_mut(&id).expect("emitting sequences exist");
            if tokens.is_empty() {
                reason = Some(FinishReason::Error(
                    "the executor emitted no token for a decode step".into(),
                ));
            }
            for (i, &token) in tokens.iter().enumerate() {
                let index = seq.emitted();
                seq.tokens.push(token);
                if let Some(g) = seq.drafts_grammar.as_mut() {
                    if g.advance(token).is_err() {
                        // Out of step with the executor's state: no more drafts, no harm.
                        seq.drafts_grammar = None;
                    }
                }
                seq.first_token.get_or_insert_with(Instant::now);
                events.push(Event::Token {
                    seq: id,
                    token,
                    index,
                    logits: logits.as_mut().and_then(Iterator::next),
                    logprobs: logprobs.next(),
                });
                if seq.req.stop_ids.contains(&token) {
                    reason = Some(FinishReason::Stop);
                    break;
                }
                if seq.emitted() >= seq.req.max_new_tokens {
                    // The token that completes the grammar completes the output, even at the
                    // length limit.
                    let complete = done && i + 1 == tokens.len();
                    reason = Some(if complete {
                        FinishReason::Stop
                    } else {
                        FinishReason::Length
                    });
                    break;
                }
            }
            if reason.is_none() && done {
                reason = Some(FinishReason::Stop);
            }
        }
        if let Some(r) = reason {
            events.push(self.finish(id, r));
        }
        events
    }

    fn finish(&mut self, id: SeqId, reason: FinishReason) -> Event {
        let mut seq = self.seqs.remove(&id).expect("finishing sequences exist");
        let now = Instant::now();
        if let Some(admitted) = seq.admitted {
            let first = seq.first_token.unwrap_or(now);
            seq.stats.prefill_ms = ms(admitted, first);
            seq.stats.decode_ms = ms(first, now);
        } else {
            seq.stats.queue_ms = ms(seq.submitted, now);
        }
        seq.stats.output_tokens = seq.emitted();
        if let Some(i) = self.waiting.iter().position(|&w| w == id) {
            self.waiting.remove(i);
        }
        if let Some(i) = self.running.iter().position(|&r| r == id) {
            self.running.remove(i);
            self.released.push(id);
        }
        Event::Finished {
            seq: id,
            reason,
            stats: seq.stats,
        }
    }
}

/// One whole step with an in-process executor: release, admit, run one batch.
///
/// The engine is locked only to plan and to apply results, never while the executor runs,
/// so other threads can submit and cancel requests during a step.
pub fn step(engine: &Mutex<Engine>, ex: &mut dyn Executor) -> Vec<Event> {
    let lock = || {
        engine
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    let (released, admissions) = {
        let mut e = lock();
        (e.take_released(), e.plan_admissions())
    };
    for seq in released {
        ex.release(seq);
    }
    let mut events = Vec::new();
    if !admissions.is_empty() {
        let results = ex.admit(&admissions);
        events.extend(lock().admitted(&admissions, results));
    }
    let batch = lock().plan_batch();
    if !batch.is_empty() {
        let outcome = ex.run(&batch);
        events.extend(lock().complete(&batch, outcome));
    }
    for seq in lock().take_released() {
        ex.release(seq);
    }
    events
}

fn split_rows(logits: Option<Vec<f32>>, rows: usize) -> Option<Vec<Vec<f32>>> {
    let l = logits?;
    if rows == 0 || l.len() % rows != 0 {
        return None;
    }
    Some(l.chunks(l.len() / rows).map(<[f32]>::to_vec).collect())
}

fn ms(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64() * 1e3
}
