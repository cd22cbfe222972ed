//! Bindings of the model runtime: weights, range sessions, the pipeline, the sampler.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::model::{
    Architecture, ChunkInput, LayerRange, LogitsAdjust, LogitsWanted, NativeLlamaPipeline,
    RangeSession, ReplayOutcome, Sampler, SamplingParams, Segment, SessionConfig, StepBuffers,
};
use crate::quant::GgmlType;
use crate::ring::{KvDtype, SpanType};
use crate::volume::CacheConfig;

use super::exceptions::InputError;
use super::grammar::PyGrammarState;
use super::ring::PySpanType;
use super::volume::{cache_config, stats_dict};
use super::weights::PyModelWeights;

/// `(hidden rows, logits rows or None)` returned by a forward call.
type Forwarded<'py> = (Bound<'py, PyArray2<f32>>, Option<Bound<'py, PyArray2<f32>>>);

fn parse_logits(which: &str) -> PyResult<LogitsWanted> {
    match which {
        "none" => Ok(LogitsWanted::None),
        "last" => Ok(LogitsWanted::Last),
        "all" => Ok(LogitsWanted::All),
        other => Err(InputError::new_err(format!(
            "logits must be 'none', 'last' or 'all', got {other:?}"
        ))),
    }
}

fn rows_array<'py>(
    py: Python<'py>,
    data: Vec<f32>,
    width: usize,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let rows = data.len() / width;
    PyArray1::from_vec(py, data).reshape([rows, width])
}

/// One session's live state (ring buffer + work buffers) for a layer range.
///
/// The ring is shared with the step stream (`mesh`), which steps registered sessions without
/// the GIL; Python and the stream take the session's `RingLock` before touching it, so the
/// mutex here is never contended.
#[pyclass(name = "RangeSession", module = "amplituhedron_rs._core", frozen)]
pub struct PyRangeSession {
    pub(crate) inner: Arc<Mutex<RangeSession>>,
}

impl PyRangeSession {
    pub(crate) fn lock(&self) -> MutexGuard<'_, RangeSession> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn run<'py>(
        &self,
        py: Python<'py>,
        input: ChunkInput<'_>,
        logits: &str,
        span: PySpanType,
    ) -> PyResult<Forwarded<'py>> {
        let wanted = parse_logits(logits)?;
        let span = SpanType::from(span);
        let (hidden_w, vocab) = {
            let session = self.lock();
            let c = session.weights().config();
            (c.hidden, c.vocab)
        };
        let mut hidden = Vec::new();
        let mut out_logits = Vec::new();
        // The ring is locked and unlocked without the GIL: never wait for the GIL holding it.
        let ring = &self.inner;
        py.detach(|| {
            let mut session = ring.lock().unwrap_or_else(PoisonError::into_inner);
            session.forward(input, span, wanted, &mut hidden, &mut out_logits)
        })
        .map_err(PyErr::from)?;
        let logits = if wanted == LogitsWanted::None {
            None
        } else {
            Some(rows_array(py, out_logits, vocab)?)
        };
        Ok((rows_array(py, hidden, hidden_w)?, logits))
    }
}

#[pymethods]
impl PyRangeSession {
    /// A fresh session over `[layer_lo, layer_hi)`.
    #[new]
    #[pyo3(signature = (weights, layer_lo, layer_hi, slots=SessionConfig::default().slots, recall=SessionConfig::default().recall, n_sys=SessionConfig::default().n_sys, max_chunk=SessionConfig::default().max_chunk))]
    fn new(
        weights: PyRef<'_, PyModelWeights>,
        layer_lo: usize,
        layer_hi: usize,
        slots: usize,
        recall: usize,
        n_sys: usize,
        max_chunk: usize,
    ) -> PyResult<Self> {
        let cfg = SessionConfig {
            slots,
            recall,
            n_sys,
            max_chunk,
        };
        let inner = RangeSession::new(Arc::clone(&weights.inner), layer_lo, layer_hi, &cfg)
            .map_err(PyErr::from)?;
        Ok(PyRangeSession {
            inner: Arc::new(Mutex::new(inner)),
        })
    }

    /// Positions processed so far.
    #[getter]
    fn clock(&self) -> u64 {
        self.lock().clock()
    }

    /// Physical KV slots of each layer of the range (sliding-window layers keep only their
    /// window, global layers the session's slots).
    #[getter]
    fn kv_slots(&self) -> Vec<usize> {
        self.lock().kv_slots()
    }

    /// First layer of the range.
    #[getter]
    fn layer_lo(&self) -> usize {
        self.lock().layer_lo()
    }

    /// One past the last layer.
    #[getter]
    fn layer_hi(&self) -> usize {
        self.lock().layer_hi()
    }

    /// True when the range embeds token ids (layer 0).
    #[getter]
    fn is_entry(&self) -> bool {
        self.lock().is_entry()
    }

    /// True when the range ends with the LM head.
    #[getter]
    fn is_exit(&self) -> bool {
        self.lock().is_exit()
    }

    /// Runs token ids (entry range). Returns `(hidden (n, hidden), logits (rows, vocab) | None)`.
    #[pyo3(signature = (tokens, logits="last", span=PySpanType::User))]
    fn forward_tokens<'py>(
        &self,
        py: Python<'py>,
        tokens: Vec<u32>,
        logits: &str,
        span: PySpanType,
    ) -> PyResult<Forwarded<'py>> {
        self.run(py, ChunkInput::Tokens(&tokens), logits, span)
    }

    /// Runs hidden states `(n, hidden)` float32 from the previous range.
    #[pyo3(signature = (hidden, logits="none", span=PySpanType::User))]
    fn forward_hidden<'py>(
        &self,
        py: Python<'py>,
        hidden: PyReadonlyArray2<'py, f32>,
        logits: &str,
        span: PySpanType,
    ) -> PyResult<Forwarded<'py>> {
        let width = self.lock().weights().config().hidden;
        if hidden.shape()[1] != width {
            return Err(InputError::new_err(format!(
                "hidden states must have {width} columns, got {}",
                hidden.shape()[1]
            )));
        }
        let owned;
        let rows = match hidden.as_slice() {
            Ok(s) => s,
            Err(_) => {
                owned = hidden.as_array().iter().copied().collect::<Vec<f32>>();
                &owned
            }
        };
        self.run(py, ChunkInput::Hidden(rows), logits, span)
    }

    /// Undoes every position after `clock` (bit-exact rollback of probe tokens).
    fn rollback(&self, clock: u64) -> PyResult<()> {
        self.lock().rollback(clock).map_err(PyErr::from)
    }

    /// Forgets every position (clock 0), keeping the allocation.
    fn reset(&self) {
        self.lock().reset();
    }
}

/// The sampler: greedy, or temperature with top-k / top-p, seeded.
///
/// Frozen, its state behind a mutex: a station's step stream samples a session's decode
/// steps with the same sampler, without the GIL (see `rust/mesh`).
#[pyclass(name = "Sampler", module = "amplituhedron_rs._core", frozen)]
pub struct PySampler {
    pub(crate) inner: Arc<Mutex<Sampler>>,
}

impl PySampler {
    fn lock(&self) -> MutexGuard<'_, Sampler> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl PySampler {
    #[new]
    #[pyo3(signature = (greedy=SamplingParams::default().greedy, temperature=SamplingParams::default().temperature, top_k=SamplingParams::default().top_k, top_p=SamplingParams::default().top_p, seed=SamplingParams::default().seed, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=Vec::new(), min_tokens=0, min_tokens_banned=Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        greedy: bool,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        seed: u64,
        presence_penalty: f32,
        frequency_penalty: f32,
        repetition_penalty: f32,
        logit_bias: Vec<(u32, f32)>,
        min_tokens: usize,
        min_tokens_banned: Vec<u32>,
    ) -> PyResult<Self> {
        let inner = Sampler::new(SamplingParams {
            greedy,
            temperature,
            top_k,
            top_p,
            seed,
            adjust: LogitsAdjust {
                presence_penalty,
                frequency_penalty,
                repetition_penalty,
                logit_bias,
                min_tokens,
                min_tokens_banned,
            },
        })
        .map_err(PyErr::from)?;
        Ok(PySampler {
            inner: Arc::new(Mutex::new(inner)),
        })
    }

    /// Starts a sequence at `prompt` (the penalties count from it); needed before the first
    /// draw when a penalty, bias or `min_tokens` is set. The sampler then records each token
    /// it picks.
    fn begin(&self, prompt: Vec<u32>) {
        self.lock().begin(&prompt);
    }

    /// The sequence's tokens at positions `start..` (a step's rows), for a sampler that
    /// joins a sequence midway; positions inside the prompt are ignored.
    fn observe(&self, start: u64, tokens: Vec<u32>) -> PyResult<()> {
        self.lock().observe(start, &tokens).map_err(PyErr::from)
    }

    /// Picks the token for position `index` (prompt length + tokens before it) from float32
    /// logits. A pure function of the logits, the parameters, the seed and `index`. With
    /// `grammar`, only the tokens its state allows are candidates (the same rule on the
    /// masked row), and the state consumes the token (see its `done`).
    #[pyo3(signature = (logits, index, grammar=None))]
    fn sample(
        &self,
        logits: PyReadonlyArray1<'_, f32>,
        index: u64,
        mut grammar: Option<PyRefMut<'_, PyGrammarState>>,
    ) -> PyResult<u32> {
        let owned;
        let values = match logits.as_slice() {
            Ok(s) => s,
            Err(_) => {
                owned = logits.as_array().to_vec();
                &owned
            }
        };
        let state = grammar.as_deref_mut().map(|g| &mut g.inner);
        Ok(crate::grammar::sample(&mut self.lock(), state, values, index)?.0)
    }

    /// Speculative verification: `rows` (`len(drafts) + 1` rows of logits, row `j` scoring
    /// position `first_index + j`) against `drafts`. Returns the emitted tokens: the accepted
    /// drafts, then the model's own token (the correction, or the bonus after the last
    /// draft). Greedy accepts exactly the argmax; sampled uses the exact rule for a
    /// deterministic draft. Position-keyed, like `sample`.
    ///
    /// With `grammar`, each row is sampled under the state's mask and consumed by it, so a
    /// draft the grammar rejects is never accepted; fewer tokens are emitted when the
    /// grammar is complete first (its `done`).
    #[pyo3(signature = (rows, drafts, first_index, grammar=None))]
    fn verify(
        &self,
        rows: PyReadonlyArray2<'_, f32>,
        drafts: Vec<u32>,
        first_index: u64,
        mut grammar: Option<PyRefMut<'_, PyGrammarState>>,
    ) -> PyResult<Vec<u32>> {
        let vocab = rows.shape()[1];
        let values = rows.as_array().iter().copied().collect::<Vec<f32>>();
        let mut out = Vec::with_capacity(drafts.len() + 1);
        let state = grammar.as_deref_mut().map(|g| &mut g.inner);
        crate::grammar::verify(
            &mut self.lock(),
            state,
            &values,
            vocab,
            &drafts,
            first_index,
            &mut out,
        )?;
        Ok(out)
    }
}

/// One batched forward step of many sessions over a layer range (a station's step of many
/// sequences): the weights are read once per step for every row, attention stays per
/// session over its own ring, and each row's result is bit-identical to its session run
/// alone. Holds one set of step buffers for every batch (they grow to the largest step).
#[pyclass(name = "BatchForward", module = "amplituhedron_rs._core", frozen)]
pub struct PyBatchForward {
    range: LayerRange,
    bufs: Mutex<StepBuffers>,
}

/// One entry's input, owned so that the step can run without the GIL.
enum OwnedInput {
    Tokens(Vec<u32>),
    Hidden(Vec<f32>),
}

#[pymethods]
impl PyBatchForward {
    #[new]
    fn new(weights: PyRef<'_, PyModelWeights>, layer_lo: usize, layer_hi: usize) -> PyResult<Self> {
        let range =
            LayerRange::new(Arc::clone(&weights.inner), layer_lo, layer_hi).map_err(PyErr::from)?;
        let bufs = StepBuffers::new(range.weights().config(), 1, 1);
        Ok(PyBatchForward {
            range,
            bufs: Mutex::new(bufs),
        })
    }

    /// `(layer_lo, layer_hi)`.
    #[getter]
    fn layer_range(&self) -> (usize, usize) {
        (self.range.layer_lo(), self.range.layer_hi())
    }

    /// Runs `inputs[i]` through `sessions[i]`, all in one pass: token-id lists at the entry
    /// range, `(n, hidden)` float32 arrays elsewhere. `logits[i]` is "none", "last" or "all"
    /// (exit range only); `spans[i]` the rows' span (default USER). Returns per session
    /// `(hidden (n, hidden), logits (rows, vocab) | None)`. A session given twice or in use
    /// elsewhere, of other weights or layers, or any bad input raises before anything runs;
    /// a failed pass leaves every ring as it was.
    #[pyo3(signature = (sessions, inputs, logits, spans=None))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        sessions: Vec<Bound<'py, PyRangeSession>>,
        inputs: Vec<Bound<'py, PyAny>>,
        logits: Vec<String>,
        spans: Option<Vec<PySpanType>>,
    ) -> PyResult<Vec<Forwarded<'py>>> {
        let n = sessions.len();
        let spans = spans.unwrap_or_else(|| vec![PySpanType::User; n]);
        if inputs.len() != n || logits.len() != n || spans.len() != n {
            return Err(InputError::new_err(format!(
                "{n} sessions need as many inputs, logits and spans; got {}, {} and {}",
                inputs.len(),
                logits.len(),
                spans.len()
            )));
        }
        let (hidden_w, vocab) = {
            let c = self.range.weights().config();
            (c.hidden, c.vocab)
        };
        let wanted = logits
            .iter()
            .map(|l| parse_logits(l))
            .collect::<PyResult<Vec<_>>>()?;
        let mut owned = Vec::with_capacity(n);
        for (i, input) in inputs.iter().enumerate() {
            owned.push(if self.range.is_entry() {
                OwnedInput::Tokens(input.extract::<Vec<u32>>().map_err(|_| {
                    InputError::new_err(format!(
                        "input {i}: the entry range takes a list of token ids"
                    ))
                })?)
            } else {
                let a = input.extract::<PyReadonlyArray2<'py, f32>>().map_err(|_| {
                    InputError::new_err(format!(
                        "input {i}: layers {}..{} take an (n, {hidden_w}) float32 array",
                        self.range.layer_lo(),
                        self.range.layer_hi()
                    ))
                })?;
                if a.shape()[1] != hidden_w {
                    return Err(InputError::new_err(format!(
                        "input {i}: hidden states must have {hidden_w} columns, got {}",
                        a.shape()[1]
                    )));
                }
                OwnedInput::Hidden(a.as_array().iter().copied().collect())
            });
        }
        // Every session's ring: one given twice (or busy) fails to lock.
        let mut borrowed = Vec::with_capacity(n);
        for (i, s) in sessions.iter().enumerate() {
            borrowed.push(s.get().inner.try_lock().map_err(|_| {
                InputError::new_err(format!(
                    "session {i} is given twice or is in use by another call"
                ))
            })?);
        }
        let mut kvs = Vec::with_capacity(n);
        for (i, b) in borrowed.iter_mut().enumerate() {
            kvs.push(
                b.kv_for(&self.range)
                    .map_err(|e| InputError::new_err(format!("session {i}: {e}")))?,
            );
        }
        let mut outs: Vec<(Vec<f32>, Vec<f32>)> = vec![Default::default(); n];
        let range = &self.range;
        let bufs = &self.bufs;
        py.detach(|| {
            let mut segments: Vec<Segment<'_>> = kvs
                .into_iter()
                .zip(&owned)
                .zip(outs.iter_mut())
                .zip(wanted.iter().zip(&spans))
                .map(|(((kv, input), (h, l)), (&logits, &span))| Segment {
                    kv,
                    input: match input {
                        OwnedInput::Tokens(t) => ChunkInput::Tokens(t),
                        OwnedInput::Hidden(h) => ChunkInput::Hidden(h),
                    },
                    span: SpanType::from(span),
                    logits,
                    hidden_out: h,
                    logits_out: l,
                    // A station sees hidden rows, not the sequences' tokens: no sharing.
                    shared_prefix: None,
                })
                .collect();
            let mut bufs = bufs.lock().unwrap_or_else(PoisonError::into_inner);
            range.forward_batch(&mut segments, &mut bufs)
        })
        .map_err(PyErr::from)?;
        outs.into_iter()
            .zip(&wanted)
            .map(|((h, l), &w)| {
                let logits = if w == LogitsWanted::None {
                    None
                } else {
                    Some(rows_array(py, l, vocab)?)
                };
                Ok((rows_array(py, h, hidden_w)?, logits))
            })
            .collect()
    }

    /// Drops the step buffers grown by earlier steps (a prefill's chunk rows: ≈ 26 MB at a
    /// 7B shape) and returns the freed heap to the system; the next step grows them again.
    /// For an idle station. False (nothing done) while a step holds them.
    fn release_buffers(&self) -> bool {
        let Ok(mut bufs) = self.bufs.try_lock() else {
            return false;
        };
        *bufs = StepBuffers::new(self.range.weights().config(), 1, 1);
        drop(bufs);
        crate::model::return_free_heap();
        true
    }
}

/// A replayed volume: `status` is `"hit"` (whole prompt) or `"partial"` (after an erasure).
#[pyclass(
    name = "ReplayResult",
    module = "amplituhedron_rs._core",
    frozen,
    get_all
)]
pub struct PyReplayResult {
    status: String,
    kv_len: usize,
    tail: Option<Py<PyArray1<f32>>>,
    logits: Option<Py<PyArray1<f32>>>,
}

/// A layer range with its own volume cache (the design's API, one-for-one). Thread-safe: the
/// pipeline sits behind a lock shared with any engine built on it.
#[pyclass(
    name = "NativeLlamaPipeline",
    module = "amplituhedron_rs._core",
    frozen
)]
pub struct PyPipeline {
    pub(crate) inner: Arc<Mutex<NativeLlamaPipeline>>,
}

impl PyPipeline {
    fn lock(&self) -> MutexGuard<'_, NativeLlamaPipeline> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl PyPipeline {
    #[new]
    #[pyo3(signature = (weights, layer_lo, layer_hi, max_entries=CacheConfig::default().max_entries as i64, max_prefix_len=CacheConfig::default().max_prefix_len as i64, max_bytes=None, policy=None, cache_dir=None, max_disk_bytes=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        weights: PyRef<'_, PyModelWeights>,
        layer_lo: usize,
        layer_hi: usize,
        max_entries: i64,
        max_prefix_len: i64,
        max_bytes: Option<i64>,
        policy: Option<&str>,
        cache_dir: Option<PathBuf>,
        max_disk_bytes: Option<i64>,
    ) -> PyResult<Self> {
        let cache = cache_config(
            max_entries,
            max_prefix_len,
            max_bytes,
            policy,
            cache_dir,
            max_disk_bytes,
        )?;
        let weights = Arc::clone(&weights.inner);
        // Opening a cache directory reads every file header: no GIL needed for that.
        let inner = py
            .detach(|| NativeLlamaPipeline::new(weights, layer_lo, layer_hi, cache))
            .map_err(PyErr::from)?;
        Ok(PyPipeline {
            inner: Arc::new(Mutex::new(inner)),
        })
    }

    /// `(layer_lo, layer_hi)`.
    #[getter]
    fn layer_range(&self) -> (usize, usize) {
        self.lock().layer_range()
    }

    fn amplituhedron_enable(&self, on: bool) {
        self.lock().amplituhedron_enable(on);
    }

    fn amplituhedron_set_max_entries(&self, n: usize) -> PyResult<()> {
        self.lock()
            .amplituhedron_set_max_entries(n)
            .map_err(PyErr::from)
    }

    fn amplituhedron_set_max_prefix_len(&self, n: usize) -> PyResult<()> {
        self.lock()
            .amplituhedron_set_max_prefix_len(n)
            .map_err(PyErr::from)
    }

    #[pyo3(signature = (n))]
    fn amplituhedron_set_max_bytes(&self, n: Option<usize>) -> PyResult<()> {
        self.lock()
            .amplituhedron_set_max_bytes(n)
            .map_err(PyErr::from)
    }

    /// Longest-prefix replay threshold: after an exact miss, reuse a cached volume sharing
    /// at least `n` leading tokens (0: exact-prompt replay only; default 16).
    fn amplituhedron_set_min_prefix_reuse(&self, n: usize) {
        self.lock().amplituhedron_set_min_prefix_reuse(n);
    }

    /// The longest-prefix replay threshold (0: off).
    #[getter]
    fn min_prefix_reuse(&self) -> usize {
        self.lock().min_prefix_reuse()
    }

    fn amplituhedron_clear(&self) {
        self.lock().amplituhedron_clear();
    }

    /// Counters: hits, misses, evictions, entries, bytes, … (disk writes that finished are
    /// counted; call ``amplituhedron_flush`` first to wait for the queued ones).
    fn amplituhedron_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut p = self.lock();
        p.amplituhedron_settle();
        stats_dict(py, &p.amplituhedron_stats().as_pairs())
    }

    /// Waits until every volume write queued by a capture is on disk (a no-op without a
    /// cache directory). The GIL is released meanwhile.
    fn amplituhedron_flush(&self, py: Python<'_>) {
        py.detach(|| self.lock().amplituhedron_flush());
    }

    /// Whether the cache is on.
    #[getter]
    fn amplituhedron_enabled(&self) -> bool {
        self.lock().cache().is_enabled()
    }

    /// The tail residual stored under `prefix_hash`, or None.
    fn amplituhedron_tail<'py>(
        &self,
        py: Python<'py>,
        prefix_hash: u64,
    ) -> Option<Bound<'py, PyArray1<f32>>> {
        self.lock()
            .amplituhedron_tail(prefix_hash)
            .map(|t| PyArray1::from_vec(py, t))
    }

    /// Freezes the session's positions `[0, len(tokens))` + `tail` (+ exit logits) as a
    /// volume. Returns the entry's bytes, or 0 when the cache declined (disabled, too long…).
    #[pyo3(signature = (session, tokens, tail, logits=None, salt=None))]
    fn amplituhedron_capture(
        &self,
        py: Python<'_>,
        session: PyRef<'_, PyRangeSession>,
        tokens: Vec<u32>,
        tail: PyReadonlyArray1<'_, f32>,
        logits: Option<PyReadonlyArray1<'_, f32>>,
        salt: Option<String>,
    ) -> PyResult<usize> {
        let tail = tail.as_array().to_vec();
        let logits = logits.map(|l| l.as_array().to_vec());
        let guard = session.lock();
        let session = guard.kv();
        let outcome = py
            .detach(|| {
                self.lock().amplituhedron_capture(
                    session,
                    &tokens,
                    &tail,
                    logits.as_deref(),
                    salt.as_deref(),
                )
            })
            .map_err(PyErr::from)?;
        Ok(outcome.cached_bytes())
    }

    /// Splices the volume of `tokens` into a fresh session: a ReplayResult, or None on a miss.
    #[pyo3(signature = (session, tokens, salt=None))]
    fn amplituhedron_replay(
        &self,
        py: Python<'_>,
        session: PyRef<'_, PyRangeSession>,
        tokens: Vec<u32>,
        salt: Option<String>,
    ) -> PyResult<Option<PyReplayResult>> {
        let mut guard = session.lock();
        let session = guard.kv_mut();
        let outcome = py
            .detach(|| {
                self.lock()
                    .amplituhedron_replay(session, &tokens, salt.as_deref())
            })
            .map_err(PyErr::from)?;
        Ok(match outcome {
            ReplayOutcome::Miss => None,
            ReplayOutcome::Hit { tail, logits } => Some(PyReplayResult {
                status: "hit".into(),
                kv_len: tokens.len(),
                tail: Some(PyArray1::from_vec(py, tail).unbind()),
                logits: logits.map(|l| PyArray1::from_vec(py, l).unbind()),
            }),
            ReplayOutcome::Partial { kv_len } => Some(PyReplayResult {
                status: "partial".into(),
                kv_len,
                tail: None,
                logits: None,
            }),
        })
    }

    /// Fault injection (tests and failure drills): poisons position `position` of the cached
    /// volume of `tokens` with NaN. Returns whether an entry was found.
    #[pyo3(signature = (tokens, position, salt=None))]
    fn amplituhedron_inject_fault(
        &self,
        tokens: Vec<u32>,
        position: usize,
        salt: Option<String>,
    ) -> PyResult<bool> {
        self.lock()
            .amplituhedron_inject_fault(&tokens, position, salt.as_deref())
            .map_err(PyErr::from)
    }
}

/// The host's read bandwidth as the runtime's workers see it (a buffer larger than the
/// caches, folded by every worker of the pool): the floor of a memory-bound decode step.
#[pyclass(name = "ReadProbe", module = "amplituhedron_rs._core", frozen)]
struct PyReadProbe {
    probe: crate::model::ReadProbe,
}

#[pymethods]
impl PyReadProbe {
    #[new]
    #[pyo3(signature = (bytes = 1 << 30))]
    fn new(py: Python<'_>, bytes: usize) -> PyResult<Self> {
        if bytes > 1 << 36 {
            return Err(InputError::new_err(format!(
                "a read probe of {bytes} bytes; at most 64 GiB"
            )));
        }
        Ok(PyReadProbe {
            probe: py.detach(|| crate::model::ReadProbe::new(bytes)),
        })
    }

    /// Bytes read per pass.
    #[getter]
    fn bytes(&self) -> usize {
        self.probe.bytes()
    }

    /// Bytes per second: the fastest of `passes` passes.
    #[pyo3(signature = (passes = 3))]
    fn measure(&self, py: Python<'_>, passes: usize) -> f64 {
        py.detach(|| self.probe.measure(passes))
    }
}

/// GGUF architectures the runtime runs (`general.architecture` values).
#[pyfunction]
fn supported_architectures() -> Vec<&'static str> {
    Architecture::ALL.iter().map(|a| a.name()).collect()
}

/// ggml tensor types the runtime's kernels run, by ggml name.
#[pyfunction]
fn supported_tensor_types() -> Vec<String> {
    GgmlType::ALL.iter().map(|t| t.name().to_string()).collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(supported_architectures, m)?)?;
    m.add_function(wrap_pyfunction!(supported_tensor_types, m)?)?;
    m.add_class::<PyReadProbe>()?;
    m.add_class::<PyRangeSession>()?;
    m.add_class::<PySampler>()?;
    m.add_class::<PyBatchForward>()?;
    m.add_class::<PyReplayResult>()?;
    m.add_class::<PyPipeline>()?;
    Ok(())
}

/// Parses a KV storage name for the Python API.
pub(crate) fn parse_kv_dtype(name: &str) -> PyResult<KvDtype> {
    KvDtype::parse(name).ok_or_else(|| {
        InputError::new_err(format!("kv_dtype must be 'f16' or 'f32', got {name:?}"))
    })
}
