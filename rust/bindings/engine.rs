//! Bindings of the continuous-batching engine.
//!
//! `Engine` is thread-safe: one thread may run `step()` (the GIL is released while the model
//! runs) while others `submit()` and `cancel()`; the engine's own lock is held only to plan
//! and to apply results, never while a batch runs.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use numpy::PyArray1;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::{
    step, DraftConfig, Engine, EngineConfig, EngineError, Event, LocalExecutor, Request,
};
use crate::model::{SamplingParams, SessionConfig};

use super::model::PyPipeline;

fn engine_error(e: EngineError) -> PyErr {
    match e {
        EngineError::QueueFull { .. } => PyRuntimeError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

/// One thing a step reported: a token (`kind == "token"`) or the end of a sequence
/// (`kind == "finished"`, with `reason` and `stats`).
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
    reason: Option<&'static str>,
    error: Option<String>,
    stats: Option<Py<PyDict>>,
}

fn to_py(py: Python<'_>, ev: Event) -> PyResult<PyEvent> {
    Ok(match ev {
        Event::Token {
            seq,
            token,
            index,
            logits,
        } => PyEvent {
            kind: "token",
            seq,
            token: Some(token),
            index: Some(index),
            logits: logits.map(|l| PyArray1::from_vec(py, l).unbind()),
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
                reason: Some(reason.as_str()),
                error,
                stats: Some(d.unbind()),
            }
        }
    })
}

/// The continuous-batching engine over an in-process executor (one batched forward pass per
/// step over the whole model, sharing the pipeline's volume cache).
#[pyclass(name = "Engine", module = "amplituhedron_rs._core", frozen)]
pub struct PyEngine {
    engine: Mutex<Engine>,
    executor: Mutex<LocalExecutor>,
}

impl PyEngine {
    fn engine(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(PoisonError::into_inner)
    }
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
        let cfg = EngineConfig {
            max_running,
            max_queue,
            step_tokens,
        };
        let engine = Engine::new(cfg).map_err(engine_error)?;
        let executor = LocalExecutor::new(Arc::clone(&pipeline.inner), session, max_running)
            .map_err(engine_error)?;
        Ok(PyEngine {
            engine: Mutex::new(engine),
            executor: Mutex::new(executor),
        })
    }

    /// Queues a request; returns its sequence id. Raises ValueError for a bad request and
    /// RuntimeError when the queue is full (nothing is queued either way).
    #[pyo3(signature = (prompt, max_new_tokens, *, greedy=true, temperature=1.0, top_k=0, top_p=1.0, seed=0, stop_ids=Vec::new(), salt=None, use_cache=true, draft_max=None, want_logits=false))]
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
        };
        self.engine().submit(req).map_err(engine_error)
    }

    /// Cancels a sequence; returns its `finished` event, or None if it already finished.
    fn cancel(&self, py: Python<'_>, seq: u64) -> PyResult<Option<PyEvent>> {
        self.engine()
            .cancel(seq)
            .map(|ev| to_py(py, ev))
            .transpose()
    }

    /// Runs one step (the GIL is released meanwhile); returns what it reported.
    fn step(&self, py: Python<'_>) -> PyResult<Vec<PyEvent>> {
        let events = py.detach(|| {
            let mut ex = self.executor.lock().unwrap_or_else(PoisonError::into_inner);
            step(&self.engine, &mut *ex)
        });
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

    /// Sequences holding KV in the executor (0 once everything finished and was released).
    #[getter]
    fn live_sequences(&self) -> usize {
        self.executor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .live()
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
    m.add_class::<PyEvent>()?;
    Ok(())
}
