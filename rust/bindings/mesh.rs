//! Bindings of the step stream (`crate::mesh`): the ring lock Python shares with it, and the
//! listening stream with its registry of sessions.

use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::mesh::{
    Address, Answer, ChainPool, FastStep, FrameLimits, Handler, HopFailure, HopSession,
    Observation, RingLock, StepStream,
};
use crate::model::LayerRange;

use super::exceptions::InputError;
use super::model::{PyRangeSession, PySampler};
use super::weights::PyModelWeights;

/// A session's lock, shared by Python and the step stream: `threading.Lock`'s interface
/// (`acquire(blocking=True, timeout=-1)`, `release()`, `locked()`, a context manager); a
/// wait releases the GIL.
#[pyclass(name = "RingLock", module = "amplituhedron_rs._core", frozen)]
pub struct PyRingLock {
    inner: Arc<RingLock>,
}

#[pymethods]
impl PyRingLock {
    #[new]
    fn new() -> Self {
        PyRingLock {
            inner: Arc::new(RingLock::new()),
        }
    }

    #[pyo3(signature = (blocking=true, timeout=-1.0))]
    fn acquire(&self, py: Python<'_>, blocking: bool, timeout: f64) -> PyResult<bool> {
        // The arguments are checked first, as threading.Lock does.
        let wait = if !blocking {
            if timeout != -1.0 {
                return Err(InputError::new_err(
                    "can't specify a timeout for a non-blocking call",
                ));
            }
            Some(Duration::ZERO)
        } else if timeout == -1.0 {
            None
        } else {
            Some(Duration::try_from_secs_f64(timeout).map_err(|_| {
                InputError::new_err("timeout value must be a non-negative number of seconds")
            })?)
        };
        if self.inner.try_acquire() {
            return Ok(true);
        }
        if wait == Some(Duration::ZERO) {
            return Ok(false);
        }
        let lock = &self.inner;
        Ok(py.detach(|| lock.acquire(wait)))
    }

    fn release(&self) -> PyResult<()> {
        if self.inner.release() {
            Ok(())
        } else {
            Err(PyRuntimeError::new_err("release unlocked lock"))
        }
    }

    fn locked(&self) -> bool {
        self.inner.is_held()
    }

    fn __enter__(&self, py: Python<'_>) -> PyResult<bool> {
        self.acquire(py, true, -1.0)
    }

    fn __exit__(
        &self,
        exc_type: &Bound<'_, PyAny>,
        exc: &Bound<'_, PyAny>,
        tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let _ = (exc_type, exc, tb); // never suppresses the exception
        self.release()?;
        Ok(false)
    }
}

/// The station's Python handler of the frames the fast path declines.
struct PyHandler {
    handle: Py<PyAny>,
}

impl Handler for PyHandler {
    fn handle(&self, head: Vec<u8>, payload: Vec<u8>, received: f64) -> Answer {
        Python::attach(|py| {
            let args = (
                PyBytes::new(py, &head),
                PyBytes::new(py, &payload),
                received,
            );
            let answered = self.handle.call1(py, args).and_then(|out| {
                let (status, head, payload): (u16, Vec<u8>, Vec<u8>) = out.extract(py)?;
                Ok(Answer {
                    status,
                    head,
                    payload,
                })
            });
            answered.unwrap_or_else(|err| {
                // The handler maps every refusal itself; what escapes it is a bug.
                err.print(py);
                Answer::refusal(500, &format!("the step failed: {err}"), None)
            })
        })
    }
}

/// The step stream of one station: a Rust thread per connection reads the frames; decode
/// steps and prompt pieces (all but the last) of registered sessions run without Python (at
/// the exit, decode sampled with each session's own sampler), every other frame goes to `handler(head: bytes, payload: bytes, received:
/// float) -> (status, header bytes, payload bytes)`, called from the connection's thread
/// (it may wait).
#[pyclass(name = "StepStream", module = "amplituhedron_rs._core", frozen)]
pub struct PyStepStream {
    stream: StepStream,
}

#[pymethods]
impl PyStepStream {
    #[new]
    #[pyo3(signature = (weights, layer_lo, layer_hi, host, port, *, token, handler, max_rows, max_logits_rows, max_json_bytes, max_octet_bytes, max_connections, keepalive_s, header_timeout_s, body_timeout_s, fast=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        weights: PyRef<'_, PyModelWeights>,
        layer_lo: usize,
        layer_hi: usize,
        host: &str,
        port: u16,
        token: Option<Vec<u8>>,
        handler: Py<PyAny>,
        max_rows: usize,
        max_logits_rows: usize,
        max_json_bytes: usize,
        max_octet_bytes: usize,
        max_connections: usize,
        keepalive_s: f64,
        header_timeout_s: f64,
        body_timeout_s: f64,
        fast: bool,
    ) -> PyResult<Self> {
        let range =
            LayerRange::new(Arc::clone(&weights.inner), layer_lo, layer_hi).map_err(PyErr::from)?;
        let seconds = |s: f64, what: &str| {
            Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| InputError::new_err(format!("{what} must be positive, got {s}")))
        };
        if max_connections == 0 {
            return Err(InputError::new_err("max_connections must be at least 1"));
        }
        let limits = FrameLimits {
            token,
            max_json_bytes,
            max_octet_bytes,
            max_connections,
            keepalive: seconds(keepalive_s, "keepalive_s")?,
            header_timeout: seconds(header_timeout_s, "header_timeout_s")?,
            body_timeout: seconds(body_timeout_s, "body_timeout_s")?,
        };
        let fast = Arc::new(FastStep::new(range, max_rows, max_logits_rows, fast));
        let handler = Box::new(PyHandler { handle: handler });
        let host = host.to_owned();
        let stream = py
            .detach(|| StepStream::bind(&host, port, limits, fast, handler))
            .map_err(|e| PyOSError::new_err(format!("cannot listen on {host}:{port}: {e}")))?;
        Ok(PyStepStream { stream })
    }

    /// The bound port.
    #[getter]
    fn port(&self) -> u16 {
        self.stream.port()
    }

    /// Lets the stream step session `sid` (its ring and the lock Python holds it with, its
    /// prompt's tokens). At the exit station, `sampler` (the session's own) lets it emit
    /// too; without one, the session's decode steps there are Python's (under a grammar).
    #[pyo3(signature = (sid, session, lock, prompt, sampler=None))]
    fn register(
        &self,
        sid: &str,
        session: PyRef<'_, PyRangeSession>,
        lock: PyRef<'_, PyRingLock>,
        prompt: Vec<u32>,
        sampler: Option<PyRef<'_, PySampler>>,
    ) {
        let hop = HopSession::new(
            Arc::clone(&session.inner),
            Arc::clone(&lock.inner),
            prompt,
            sampler.map(|s| Arc::clone(&s.inner)),
        );
        self.stream.fast().registry.register(sid, hop);
    }

    /// Follows the station's `max_prefix_len` (a prompt longer than it has its head captured
    /// by the piece that computes its last position: Python's).
    fn set_max_prefix_len(&self, n: usize) {
        self.stream.fast().set_max_prefix_len(n);
    }

    /// Forgets session `sid` (call holding its lock, before its ring is reused); whether it
    /// was registered.
    fn unregister(&self, sid: &str) -> bool {
        self.stream.fast().registry.unregister(sid)
    }

    /// When a step of the stream last used session `sid` (`time.monotonic()`), or None.
    fn last_used(&self, sid: &str) -> Option<f64> {
        self.stream.fast().registry.get(sid)?.last_used()
    }

    /// Sessions registered now.
    #[getter]
    fn sessions(&self) -> usize {
        self.stream.fast().registry.len()
    }

    /// Rows the stream ran without Python.
    #[getter]
    fn fast_rows(&self) -> u64 {
        self.stream.fast().rows()
    }

    /// Steps the stream answered without Python.
    #[getter]
    fn fast_steps(&self) -> u64 {
        self.stream.fast().steps()
    }

    /// Open connections.
    #[getter]
    fn connections(&self) -> usize {
        self.stream.connections()
    }

    /// `(seconds, status)` of every answer the stream wrote itself since the last call.
    fn take_observations(&self) -> Vec<Observation> {
        self.stream.take_observations()
    }

    /// Drops the fast path's step buffers (an idle station); false while a step holds them.
    fn release_buffers(&self) -> bool {
        self.stream.fast().release_buffers()
    }

    /// Stops listening and closes every connection (a step being answered finishes first).
    fn close(&self, py: Python<'_>) {
        let stream = &self.stream;
        py.detach(|| stream.close());
    }
}

/// A step's answers at every station of a chain: `(header, sent, answered)` each, and the
/// last station's payload.
type ChainAnswers<'py> = (Vec<(Bound<'py, PyBytes>, f64, f64)>, Bound<'py, PyBytes>);

/// Where a chain stopped: `(station index, status or None, timed out, detail)`.
type ChainStop = (usize, Option<u16>, bool, String);

/// The coordinator's end of the step stream for a whole chain: pooled connections per
/// station address; `run` sends one step through every station in order without the GIL.
#[pyclass(name = "StepChain", module = "amplituhedron_rs._core", frozen)]
pub struct PyStepChain {
    pool: ChainPool,
}

#[pymethods]
impl PyStepChain {
    #[new]
    fn new() -> Self {
        PyStepChain {
            pool: ChainPool::new(),
        }
    }

    /// Runs one step through `stations` (`(host, stream port)` each) in order: station `i`
    /// gets `heads[i]` and the previous answer's payload (the first: `payload`); every
    /// answer must hold `entries` entries. Returns `(answers, None)` with `answers` as
    /// `([(header, sent, answered)], last payload)`, or `(None, stop)` with `stop` as
    /// `(station index, status or None, timed out, detail)` where the chain stopped: no
    /// answer (status None), a refusal (its status and JSON header), or a malformed answer
    /// (status 200). Times are `time.monotonic()` seconds.
    #[allow(clippy::too_many_arguments)]
    fn run<'py>(
        &self,
        py: Python<'py>,
        stations: Vec<Address>,
        token: &[u8],
        heads: Vec<Vec<u8>>,
        payload: Vec<u8>,
        entries: usize,
        timeout: f64,
    ) -> PyResult<(Option<ChainAnswers<'py>>, Option<ChainStop>)> {
        if stations.len() != heads.len() || stations.is_empty() {
            return Err(InputError::new_err(format!(
                "{} stations need as many headers (at least one); got {}",
                stations.len(),
                heads.len()
            )));
        }
        let timeout = Duration::try_from_secs_f64(timeout)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                InputError::new_err(format!("timeout must be positive, got {timeout}"))
            })?;
        let pool = &self.pool;
        let token = token.to_vec();
        let ran = py.detach(|| pool.run(&stations, &token, &heads, payload, entries, timeout));
        Ok(match ran {
            Ok((replies, out)) => {
                let replies = replies
                    .into_iter()
                    .map(|r| (PyBytes::new(py, &r.head), r.sent, r.answered))
                    .collect();
                (Some((replies, PyBytes::new(py, &out))), None)
            }
            Err(stop) => {
                let (status, timed_out, detail) = match stop.failure {
                    HopFailure::NoAnswer { timeout, message } => (None, timeout, message),
                    HopFailure::Refused { status, head } => (
                        Some(status),
                        false,
                        String::from_utf8_lossy(&head).into_owned(),
                    ),
                    HopFailure::Malformed { message } => (Some(200), false, message),
                };
                (None, Some((stop.station, status, timed_out, detail)))
            }
        })
    }

    /// Closes the idle connections to `(host, port)` (its station failed or moved).
    fn forget(&self, host: String, port: u16) {
        self.pool.forget(&(host, port));
    }

    /// Closes every idle connection.
    fn close(&self) {
        self.pool.clear();
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStepChain>()?;
    m.add_class::<PyRingLock>()?;
    m.add_class::<PyStepStream>()?;
    Ok(())
}
