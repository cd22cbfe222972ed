//! Bindings of the continuous-batching engine.
//!
//! `Engine` is thread-safe: one thread may run `step()` (the GIL is released while the model
//! runs) while others `submit()` and `cancel()`; the engine's own lock is held only to plan
//! and to apply results, never while a batch runs.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::{
    step, Admission, Admitted, BatchEntry, DraftConfig, Engine, EngineConfig, EngineError,
    EntryKind, EntryOutcome, Event, LocalExecutor, Request, StepTotals,
};
use crate::model::{
    token_logprobs, SamplingParams, SessionConfig, TokenLogprobs, MAX_TOP_LOGPROBS,
};

use super::exceptions::InputError;
use super::grammar::PyGrammar;
use super::model::PyPipeline;

/// One thing a step reported: a token (`kind == "token"`), a computed prompt's
/// log-probabilities (`kind == "prompt"`, `prompt_logprobs`: one per prompt token after the
/// first; only for requests that asked) or the end of a sequence (`kind == "finished"`, with
/// `reason` and `stats`).
#[pyclass(
    name = "EngineEvent",
    module = "amplituhedron_rs._core",
    frozen,
    get_all
)]
pub struct PyEvent {
    kind: &'static str,
    seq: u64,
    token: Option<u32>,
    index: Option<usize>,
    logits: Option<Py<PyArray1<f32>>>,
    logprobs: Option<Py<PyTokenLogprobs>>,
    prompt_logprobs: Option<Vec<Py<PyTokenLogprobs>>>,
    reason: Option<&'static str>,
    error: Option<String>,
    stats: Option<Py<PyDict>>,
}

/// A token's log-probability under the model's own distribution (the softmax of the raw
/// logits) and the most likely tokens with theirs (`top`: `(id, logprob)`, higher first).
#[pyclass(
    name = "TokenLogprobs",
    module = "amplituhedron_rs._core",
    frozen,
    get_all
)]
pub struct PyTokenLogprobs {
    token: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
}

impl From<TokenLogprobs> for PyTokenLogprobs {
    fn from(t: TokenLogprobs) -> Self {
        PyTokenLogprobs {
            token: t.token,
            logprob: t.logprob,
            top: t.top,
        }
    }
}

#[pymethods]
impl PyTokenLogprobs {
    fn __repr__(&self) -> String {
        format!(
            "TokenLogprobs(token={}, logprob={}, top={:?})",
            self.token, self.logprob, self.top
        )
    }
}

/// What an external executor reports for one emitted token's log-probabilities:
/// `(token, logprob, [(id, logprob), …])`.
type LogprobsTuple = (u32, f32, Vec<(u32, f32)>);

fn from_tuple((token, logprob, top): LogprobsTuple) -> TokenLogprobs {
    TokenLogprobs {
        token,
        logprob,
        top,
    }
}

/// The log-probability of `token` in one logits row and its `top_n` (≤ 20) most likely
/// alternatives: the computation the engine runs, for executors that hold the logits
/// elsewhere (a mesh's exit station). Raises InputError for a bad row, token or count.
#[pyfunction(name = "token_logprobs")]
fn py_token_logprobs(
    logits: PyReadonlyArray1<'_, f32>,
    token: u32,
    top_n: usize,
) -> PyResult<PyTokenLogprobs> {
    let row = logits.as_slice()?;
    token_logprobs(row, token, top_n)
        .map(PyTokenLogprobs::from)
        .map_err(|e| InputError::new_err(e.to_string()))
}

fn to_py(py: Python<'_>, ev: Event) -> PyResult<PyEvent> {
    Ok(match ev {
        Event::Token {
            seq,
            token,
            index,
            logits,
            logprobs,
        } => PyEvent {
            kind: "token",
            seq,
            token: Some(token),
            index: Some(index),
            logits: logits.map(|l| PyArray1::from_vec(py, l).unbind()),
            logprobs: logprobs
                .map(|t| Py::new(py, PyTokenLogprobs::from(t)))
                .transpose()?,
            prompt_logprobs: None,
            reason: None,
            error: None,
            stats: None,
        },
        Event::Prompt { seq, logprobs } => PyEvent {
            kind: "prompt",
            seq,
            token: None,
            index: None,
            logits: None,
            logprobs: None,
            prompt_logprobs: Some(
                logprobs
                    .into_iter()
                    .map(|t| Py::new(py, PyTokenLogprobs::from(t)))
                    .collect::<PyResult<_>>()?,
            ),
            reason: None,
            error: None,
            stats: None,
        },
        Event::Finished { seq, reason, stats } => {
            let d = PyDict::new(py);
            d.set_item("prompt_tokens", stats.prompt_tokens)?;
            d.set_item("output_tokens", stats.output_tokens)?;
            d.set_item("cached_tokens", stats.cached_tokens)?;
            d.set_item("cache_hit", stats.cache_hit)?;
            d.set_item("queue_ms", stats.queue_ms)?;
            d.set_item("prefill_ms", stats.prefill_ms)?;
            d.set_item("decode_ms", stats.decode_ms)?;
            d.set_item("draft_proposed", stats.draft_proposed)?;
            d.set_item("draft_accepted", stats.draft_accepted)?;
            d.set_item("verify_steps", stats.verify_steps)?;
            let error = match &reason {
                crate::engine::FinishReason::Error(m) => Some(m.clone()),
                _ => None,
            };
            PyEvent {
                kind: "finished",
                seq,
                token: None,
                index: None,
                logits: None,
                logprobs: None,
                prompt_logprobs: None,
                reason: Some(reason.as_str()),
                error,
                stats: Some(d.unbind()),
            }
        }
    })
}

/// A new sequence an external executor must prepare (see `Engine.plan_admissions`).
/// `grammar`: its grammar as `(kind, text)` when constrained (the executor builds its state
/// where it samples).
#[pyclass(
    name = "EngineAdmission",
    module = "amplituhedron_rs._core",
    frozen,
    get_all
)]
pub struct PyAdmission {
    seq: u64,
    prompt: Vec<u32>,
    greedy: bool,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    seed: u64,
    salt: Option<String>,
    use_cache: bool,
    sample_first: bool,
    logprobs: Option<usize>,
    prompt_logprobs: Option<usize>,
    grammar: Option<(&'static str, String)>,
}

impl From<&Admission> for PyAdmission {
    fn from(a: &Admission) -> Self {
        PyAdmission {
            seq: a.seq,
            prompt: a.prompt.clone(),
            greedy: a.sampling.greedy,
            temperature: a.sampling.temperature,
            top_k: a.sampling.top_k,
            top_p: a.sampling.top_p,
            seed: a.sampling.seed,
            salt: a.salt.clone(),
            use_cache: a.use_cache,
            sample_first: a.sample_first,
            logprobs: a.logprobs,
            prompt_logprobs: a.prompt_logprobs,
            grammar: a
                .grammar
                .as_ref()
                .map(|g| (g.spec().kind.as_str(), g.spec().text.clone())),
        }
    }
}

/// One sequence's rows of a planned step (see `Engine.plan_batch`): `tokens[0]` sits at
/// position `start`. `kind` is "prefill" (`last`: it ends the prompt; `emit`: sample the
/// first token) or "decode" (`tokens[1:]` are drafts to verify).
#[pyclass(
    name = "EngineEntry",
    module = "amplituhedron_rs._core",
    frozen,
    get_all
)]
pub struct PyEntry {
    seq: u64,
    start: usize,
    tokens: Vec<u32>,
    kind: &'static str,
    last: bool,
    emit: bool,
}

impl From<&BatchEntry> for PyEntry {
    fn from(e: &BatchEntry) -> Self {
        let (kind, last, emit) = match e.kind {
            EntryKind::Prefill { last, emit } => ("prefill", last, emit),
            EntryKind::Decode => ("decode", false, true),
        };
        PyEntry {
            seq: e.seq,
            start: e.start,
            tokens: e.tokens.clone(),
            kind,
            last,
            emit,
        }
    }
}

/// Totals of the batches an engine has run (see `Engine.step_totals`).
#[pyclass(
    name = "EngineStepTotals",
    module = "amplituhedron_rs._core",
    frozen,
    get_all
)]
pub struct PyStepTotals {
    steps: u64,
    prompt_rows: u64,
    decode_rows: u64,
    busy_seconds: f64,
}

impl From<StepTotals> for PyStepTotals {
    fn from(t: StepTotals) -> Self {
        PyStepTotals {
            steps: t.steps,
            prompt_rows: t.prompt_rows,
            decode_rows: t.decode_rows,
            busy_seconds: t.busy_seconds,
        }
    }
}

/// The continuous-batching engine. Built over an in-process executor (`Engine(pipeline,
/// …)`: `step()` runs one batched forward pass over the whole model, sharing the pipeline's
/// volume cache), or for an external executor (`Engine.external(…)`: the caller runs each
/// planned step itself, e.g. through a mesh of stations, with `plan_admissions` →
/// `admitted` → `plan_batch` → `complete`).
#[pyclass(name = "Engine", module = "amplituhedron_rs._core", frozen)]
pub struct PyEngine {
    engine: Mutex<Engine>,
    executor: Option<Mutex<LocalExecutor>>,
    /// External mode: the admissions and the batch handed out and not yet answered.
    planned_admissions: Mutex<Vec<Admission>>,
    planned_batch: Mutex<Vec<BatchEntry>>,
}

impl PyEngine {
    fn engine(&self) -> MutexGuard<'_, Engine> {
        lock(&self.engine)
    }

    fn from_parts(engine: Engine, executor: Option<LocalExecutor>) -> Self {
        PyEngine {
            engine: Mutex::new(engine),
            executor: executor.map(Mutex::new),
            planned_admissions: Mutex::new(Vec::new()),
            planned_batch: Mutex::new(Vec::new()),
        }
    }

    fn external_only(&self) -> PyResult<()> {
        if self.executor.is_some() {
            return Err(InputError::new_err(
                "this engine runs its own in-process executor: call step()",
            ));
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[pymethods]
impl PyEngine {
    /// An engine over `pipeline` (which must span every layer). `slots`, `recall`, `n_sys`
    /// and `max_chunk` shape each sequence's ring; `max_running` sequences run at once,
    /// `max_queue` wait, and a step runs at most `step_tokens` rows.
    #[new]
    #[pyo3(signature = (pipeline, *, slots, recall, n_sys, max_chunk, max_running, max_queue, step_tokens))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        pipeline: PyRef<'_, PyPipeline>,
        slots: usize,
        recall: usize,
        n_sys: usize,
        max_chunk: usize,
        max_running: usize,
        max_queue: usize,
        step_tokens: usize,
    ) -> PyResult<Self> {
        let session = SessionConfig {
            slots,
            recall,
            n_sys,
            max_chunk,
        };
        let vocab = (pipeline.inner.lock())
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .weights()
            .config()
            .vocab;
        let cfg = EngineConfig {
            max_running,
            max_queue,
            step_tokens,
            scored_rows: EngineConfig::scored_rows_for(vocab),
        };
        let engine = Engine::new(cfg).map_err(PyErr::from)?;
        let executor = LocalExecutor::new(Arc::clone(&pipeline.inner), session, max_running)
            .map_err(PyErr::from)?;
        Ok(PyEngine::from_parts(engine, Some(executor)))
    }

    /// An engine whose steps the caller executes (a mesh executor).
    #[staticmethod]
    #[pyo3(signature = (*, max_running, max_queue, step_tokens))]
    fn external(max_running: usize, max_queue: usize, step_tokens: usize) -> PyResult<Self> {
        let cfg = EngineConfig {
            max_running,
            max_queue,
            step_tokens,
            ..EngineConfig::default()
        };
        Ok(PyEngine::from_parts(
            Engine::new(cfg).map_err(PyErr::from)?,
            None,
        ))
    }

    /// External mode: moves waiting requests into the running set; the caller prepares each
    /// (opens its sessions, replays the cache) and answers with `admitted`.
    fn plan_admissions(&self) -> PyResult<Vec<PyAdmission>> {
        self.external_only()?;
        let planned = self.engine().plan_admissions();
        let out = planned.iter().map(PyAdmission::from).collect();
        lock(&self.planned_admissions).extend(planned);
        Ok(out)
    }

    /// External mode: the result of preparing planned admissions, one per admission:
    /// `(seq, cached_tokens, first_token or None, error message or None)`; `logprobs`, when
    /// given, holds per admission the first token's `(token, logprob, top)` or None; `done`,
    /// when given, per admission whether the sequence's grammar is complete after its first
    /// token.
    #[pyo3(signature = (results, logprobs=None, done=None))]
    fn admitted(
        &self,
        py: Python<'_>,
        results: Vec<(u64, usize, Option<u32>, Option<String>)>,
        logprobs: Option<Vec<Option<LogprobsTuple>>>,
        done: Option<Vec<bool>>,
    ) -> PyResult<Vec<PyEvent>> {
        self.external_only()?;
        if logprobs.as_ref().is_some_and(|l| l.len() != results.len())
            || done.as_ref().is_some_and(|d| d.len() != results.len())
        {
            return Err(InputError::new_err(
                "logprobs and done must hold one entry per admission result",
            ));
        }
        let mut firsts = logprobs.unwrap_or_default().into_iter();
        let mut dones = done.unwrap_or_default().into_iter();
        let mut planned = lock(&self.planned_admissions);
        let mut admissions = Vec::with_capacity(results.len());
        let mut outcomes = Vec::with_capacity(results.len());
        for (seq, cached_tokens, first_token, error) in results {
            let first_logprobs = firsts.next().flatten().map(from_tuple);
            let done = dones.next().unwrap_or(false);
            let Some(i) = planned.iter().position(|a| a.seq == seq) else {
                return Err(InputError::new_err(format!(
                    "sequence {seq} has no planned admission"
                )));
            };
            admissions.push(planned.swap_remove(i));
            outcomes.push(match error {
                Some(m) => Err(EngineError::Executor(m)),
                None => Ok(Admitted {
                    cached_tokens,
                    first_token,
                    first_logits: None,
                    first_logprobs,
                    done,
                }),
            });
        }
        drop(planned);
        let events = self.engine().admitted(&admissions, outcomes);
        events.into_iter().map(|ev| to_py(py, ev)).collect()
    }

    /// External mode: plans the next step (nothing to run: an empty list). Answer with
    /// `complete` before planning again.
    fn plan_batch(&self) -> PyResult<Vec<PyEntry>> {
        self.external_only()?;
        let mut pending = lock(&self.planned_batch);
        if !pending.is_empty() {
            return Err(InputError::new_err(
                "the previous step was not completed: call complete() first",
            ));
        }
        *pending = self.engine().plan_batch();
        Ok(pending.iter().map(PyEntry::from).collect())
    }

    /// External mode: the outcome of the planned step — per entry, the emitted tokens; with
    /// `logprobs` per entry each emitted token's `(token, logprob, top)`, with
    /// `prompt_logprobs` per entry those of the prompt tokens its rows predict, with `done`
    /// per entry whether its grammar is complete (the sequence then finishes), with
    /// `errors` per entry an error that ends that sequence alone (None: none) — or `error`
    /// when the step failed (every sequence of the step then finishes with it).
    #[pyo3(signature = (emitted, error=None, logprobs=None, prompt_logprobs=None, done=None, errors=None))]
    #[allow(clippy::too_many_arguments)]
    fn complete(
        &self,
        py: Python<'_>,
        emitted: Vec<Vec<u32>>,
        error: Option<String>,
        logprobs: Option<Vec<Vec<LogprobsTuple>>>,
        prompt_logprobs: Option<Vec<Vec<LogprobsTuple>>>,
        done: Option<Vec<bool>>,
        errors: Option<Vec<Option<String>>>,
    ) -> PyResult<Vec<PyEvent>> {
        self.external_only()?;
        for (name, lists) in [
            ("logprobs", &logprobs),
            ("prompt_logprobs", &prompt_logprobs),
        ] {
            if lists.as_ref().is_some_and(|l| l.len() != emitted.len()) {
                return Err(InputError::new_err(format!(
                    "{name} must hold one list per entry of the step"
                )));
            }
        }
        if done.as_ref().is_some_and(|d| d.len() != emitted.len())
            || errors.as_ref().is_some_and(|e| e.len() != emitted.len())
        {
            return Err(InputError::new_err(
                "done and errors must hold one value per entry of the step",
            ));
        }
        let mut dones = done.unwrap_or_default().into_iter();
        let mut entry_errors = errors.unwrap_or_default().into_iter();
        let batch = std::mem::take(&mut *lock(&self.planned_batch));
        let mut per_entry = logprobs.unwrap_or_default().into_iter();
        let mut prompt_per_entry = prompt_logprobs.unwrap_or_default().into_iter();
        let next = |lists: &mut std::vec::IntoIter<Vec<LogprobsTuple>>| -> Vec<TokenLogprobs> {
            lists
                .next()
                .unwrap_or_default()
                .into_iter()
                .map(from_tuple)
                .collect()
        };
        let outcome = match error {
            Some(m) => Err(EngineError::Executor(m)),
            None => Ok(emitted
                .into_iter()
                .map(|emitted| EntryOutcome {
                    emitted,
                    logits: None,
                    logprobs: next(&mut per_entry),
                    prompt_logprobs: next(&mut prompt_per_entry),
                    done: dones.next().unwrap_or(false),
                    error: entry_errors.next().flatten(),
                })
                .collect()),
        };
        let events = self.engine().complete(&batch, outcome);
        events.into_iter().map(|ev| to_py(py, ev)).collect()
    }

    /// Sequences whose resources (sessions, KV) the executor should free now.
    fn take_released(&self) -> Vec<u64> {
        self.engine().take_released()
    }

    /// Queues a request; returns its sequence id. Raises InputError for a bad request and
    /// QueueFullError when the queue is full (nothing is queued either way). With
    /// `grammar`, every token is sampled under its mask and the sequence finishes once it is
    /// complete.
    #[pyo3(signature = (prompt, max_new_tokens, *, greedy=SamplingParams::default().greedy, temperature=SamplingParams::default().temperature, top_k=SamplingParams::default().top_k, top_p=SamplingParams::default().top_p, seed=SamplingParams::default().seed, stop_ids=Vec::new(), salt=None, use_cache=true, draft_max=None, want_logits=false, logprobs=None, prompt_logprobs=None, grammar=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        prompt: Vec<u32>,
        max_new_tokens: usize,
        greedy: bool,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        seed: u64,
        stop_ids: Vec<u32>,
        salt: Option<String>,
        use_cache: bool,
        draft_max: Option<usize>,
        want_logits: bool,
        logprobs: Option<usize>,
        prompt_logprobs: Option<usize>,
        grammar: Option<PyRef<'_, PyGrammar>>,
    ) -> PyResult<u64> {
        let req = Request {
            prompt,
            max_new_tokens,
            sampling: SamplingParams {
                greedy,
                temperature,
                top_k,
                top_p,
                seed,
            },
            stop_ids,
            salt,
            use_cache,
            draft: draft_max.map(|draft_max| DraftConfig {
                draft_max,
                ..DraftConfig::default()
            }),
            want_logits,
            logprobs,
            prompt_logprobs,
            grammar: grammar.map(|g| g.inner.clone()),
        };
        self.engine().submit(req).map_err(PyErr::from)
    }

    /// Cancels a sequence; returns its `finished` event, or None if it already finished.
    fn cancel(&self, py: Python<'_>, seq: u64) -> PyResult<Option<PyEvent>> {
        self.engine()
            .cancel(seq)
            .map(|ev| to_py(py, ev))
            .transpose()
    }

    /// Runs one step with the in-process executor (the GIL is released meanwhile); returns
    /// what it reported.
    fn step(&self, py: Python<'_>) -> PyResult<Vec<PyEvent>> {
        let Some(executor) = &self.executor else {
            return Err(InputError::new_err(
                "an external engine is stepped by its executor (plan_batch/complete)",
            ));
        };
        let events = py.detach(|| step(&self.engine, &mut *lock(executor)));
        events.into_iter().map(|ev| to_py(py, ev)).collect()
    }

    /// Prompt positions of `seq` already in its KV (progress of a long prefill), or None once
    /// it finished.
    fn prefilled(&self, seq: u64) -> Option<usize> {
        self.engine().prefilled(seq)
    }

    /// Whether anything is waiting, running, or left to release.
    #[getter]
    fn has_work(&self) -> bool {
        self.engine().has_work()
    }

    /// Requests waiting for a place.
    #[getter]
    fn waiting(&self) -> usize {
        self.engine().waiting()
    }

    /// Sequences running.
    #[getter]
    fn running(&self) -> usize {
        self.engine().running()
    }

    /// Sequences holding KV in the in-process executor (0 once everything finished and was
    /// released; None for an external engine, whose executor knows).
    #[getter]
    fn live_sequences(&self) -> Option<usize> {
        self.executor.as_ref().map(|ex| lock(ex).live())
    }

    /// Totals of the batches run so far: steps, prompt and decode rows, and the seconds a
    /// batch was in flight (the executor's load: `busy_seconds` over a wall time is how busy
    /// it was).
    #[getter]
    fn step_totals(&self) -> PyStepTotals {
        self.engine().step_totals().into()
    }

    /// `(max_running, max_queue, step_tokens)`.
    #[getter]
    fn limits(&self) -> (usize, usize, usize) {
        let e = self.engine();
        let c = e.config();
        (c.max_running, c.max_queue, c.step_tokens)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_class::<PyStepTotals>()?;
    m.add_class::<PyEvent>()?;
    m.add_class::<PyTokenLogprobs>()?;
    m.add("MAX_TOP_LOGPROBS", MAX_TOP_LOGPROBS)?;
    m.add_function(wrap_pyfunction!(py_token_logprobs, m)?)?;
    m.add_class::<PyAdmission>()?;
    m.add_class::<PyEntry>()?;
    Ok(())
}
