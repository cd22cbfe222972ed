//! Python surface of the ring buffer and attention: `RingBuffer`, `SpanType`,
//! `SemanticSpan`, `attend`. Argument conversion and error mapping only.

use numpy::{
    dtype, PyArray1, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use super::exceptions::InputError;
use crate::attention::{self, AttnDims, AttnInputs};
use crate::ring::{DynamicRingBuffer, KvDtype, KvSlice, RingConfig, SemanticSpan, SpanType};

fn value_error(message: impl Into<String>) -> PyErr {
    InputError::new_err(message)
}

/// A float32 numpy array of `ndim` dimensions: its shape and C-order data (copied).
fn f32_array(obj: &Bound<'_, PyAny>, name: &str, ndim: usize) -> PyResult<(Vec<usize>, Vec<f32>)> {
    let untyped = obj
        .cast::<PyUntypedArray>()
        .map_err(|_| value_error(format!("{name} must be a numpy array")))?;
    if !untyped.dtype().is_equiv_to(&dtype::<f32>(obj.py())) {
        return Err(value_error(format!(
            "{name} must have dtype float32, got {}",
            untyped.dtype()
        )));
    }
    if untyped.ndim() != ndim {
        return Err(value_error(format!(
            "{name} must have {ndim} dimensions, got shape {:?}",
            untyped.shape()
        )));
    }
    let array = obj.cast::<PyArrayDyn<f32>>()?.readonly();
    let data = match array.as_slice() {
        Ok(slice) => slice.to_vec(),
        Err(_) => array.as_array().iter().copied().collect(),
    };
    Ok((untyped.shape().to_vec(), data))
}

fn check_shape(name: &str, got: &[usize], expected: &[usize]) -> PyResult<()> {
    if got == expected {
        Ok(())
    } else {
        Err(value_error(format!(
            "{name} must have shape {expected:?}, got {got:?}"
        )))
    }
}

/// What a run of positions is, semantically (pruning evicts whole spans).
#[pyclass(
    name = "SpanType",
    module = "amplituhedron_rs._core",
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object
)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PySpanType {
    #[pyo3(name = "SYSTEM")]
    System = 0,
    #[pyo3(name = "USER")]
    User = 1,
    #[pyo3(name = "THOUGHT")]
    Thought = 2,
    #[pyo3(name = "TOOL_CALL")]
    ToolCall = 3,
    #[pyo3(name = "TOOL_RESULT")]
    ToolResult = 4,
    #[pyo3(name = "RESPONSE_SENTENCE")]
    ResponseSentence = 5,
    #[pyo3(name = "TURN_END")]
    TurnEnd = 6,
}

impl From<PySpanType> for SpanType {
    fn from(span: PySpanType) -> SpanType {
        SpanType::from_u8(span as u8).expect("the discriminants match")
    }
}

impl From<SpanType> for PySpanType {
    fn from(span: SpanType) -> PySpanType {
        match span {
            SpanType::System => PySpanType::System,
            SpanType::User => PySpanType::User,
            SpanType::Thought => PySpanType::Thought,
            SpanType::ToolCall => PySpanType::ToolCall,
            SpanType::ToolResult => PySpanType::ToolResult,
            SpanType::ResponseSentence => PySpanType::ResponseSentence,
            SpanType::TurnEnd => PySpanType::TurnEnd,
        }
    }
}

/// A run of positions `[start_clock, end_clock)` of one span type.
#[pyclass(name = "SemanticSpan", module = "amplituhedron_rs._core", frozen, eq)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PySemanticSpan {
    #[pyo3(get)]
    span_type: PySpanType,
    #[pyo3(get)]
    start_clock: u64,
    #[pyo3(get)]
    end_clock: u64,
    #[pyo3(get)]
    start_slot: u32,
    #[pyo3(get)]
    slot_count: u32,
}

#[pymethods]
impl PySemanticSpan {
    fn __repr__(&self) -> String {
        format!(
            "SemanticSpan({:?}, start_clock={}, end_clock={}, start_slot={}, slot_count={})",
            self.span_type, self.start_clock, self.end_clock, self.start_slot, self.slot_count
        )
    }
}

impl From<SemanticSpan> for PySemanticSpan {
    fn from(s: SemanticSpan) -> PySemanticSpan {
        PySemanticSpan {
            span_type: s.span_type.into(),
            start_clock: s.start_clock,
            end_clock: s.end_clock,
            start_slot: s.start_slot,
            slot_count: s.slot_count,
        }
    }
}

/// The ring-buffer KV cache of one session (all layers of a station's range).
#[pyclass(name = "RingBuffer", module = "amplituhedron_rs._core")]
pub struct PyRingBuffer {
    ring: DynamicRingBuffer,
}

impl PyRingBuffer {
    /// A volume-layout slab `(n_layers, kv_heads, n, head_dim)` pair: `n` and the data.
    fn slab(
        &self,
        keys: &Bound<'_, PyAny>,
        vals: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, Vec<f32>, Vec<f32>)> {
        let cfg = self.ring.config();
        let (k_shape, k) = f32_array(keys, "keys", 4)?;
        let (v_shape, v) = f32_array(vals, "vals", 4)?;
        let n = k_shape[2];
        let expected = [cfg.n_layers, cfg.kv_heads, n, cfg.head_dim];
        check_shape("keys", &k_shape, &expected)?;
        check_shape("vals", &v_shape, &expected)?;
        Ok((n, k, v))
    }

    fn layer_array<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        values: bool,
    ) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let cfg = self.ring.config();
        if layer >= cfg.n_layers {
            return Err(value_error(format!(
                "layer {layer} out of range: the ring holds {} layers",
                cfg.n_layers
            )));
        }
        let (k, v) = self.ring.layer_kv(layer);
        let data = if values { v } else { k };
        // Widened to f32 whatever the storage type, as every other ring read.
        PyArray1::from_vec(py, data.to_f32()).reshape(vec![cfg.slots, cfg.kv_heads, cfg.head_dim])
    }
}

#[pymethods]
impl PyRingBuffer {
    #[new]
    #[pyo3(signature = (n_layers, kv_heads, head_dim, slots=RingConfig::new(0, 0, 0).slots, recall=RingConfig::new(0, 0, 0).recall, n_sys=RingConfig::new(0, 0, 0).n_sys, max_chunk=None, undo_capacity=RingConfig::new(0, 0, 0).undo_capacity, kv_dtype=KvDtype::default().name()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        n_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        slots: usize,
        recall: usize,
        n_sys: usize,
        max_chunk: Option<usize>,
        undo_capacity: usize,
        kv_dtype: &str,
    ) -> PyResult<Self> {
        let kv_dtype = super::model::parse_kv_dtype(kv_dtype)?;
        let defaults = RingConfig::new(n_layers, kv_heads, head_dim);
        let window = slots.saturating_sub(recall).saturating_sub(n_sys);
        let cfg = RingConfig {
            slots,
            recall,
            n_sys,
            max_chunk: max_chunk.unwrap_or(defaults.max_chunk.min(window.max(1))),
            undo_capacity,
            kv_dtype,
            ..defaults
        };
        Ok(PyRingBuffer {
            ring: DynamicRingBuffer::new(cfg).map_err(PyErr::from)?,
        })
    }

    /// Positions appended so far.
    #[getter]
    fn clock(&self) -> u64 {
        self.ring.clock()
    }

    /// How K and V are stored: "f16" or "f32".
    #[getter]
    fn kv_dtype(&self) -> &'static str {
        self.ring.config().kv_dtype.name()
    }

    /// Anchor slots.
    #[getter]
    fn n_sys(&self) -> usize {
        self.ring.n_sys()
    }

    /// First recall slot (one past the window).
    #[getter]
    fn window_end(&self) -> usize {
        self.ring.window_end()
    }

    /// Window length.
    #[getter]
    fn window_len(&self) -> usize {
        self.ring.window_len()
    }

    /// Physical slots per layer.
    #[getter]
    fn slots(&self) -> usize {
        self.ring.slots()
    }

    /// Layers held.
    #[getter]
    fn n_layers(&self) -> usize {
        self.ring.config().n_layers
    }

    /// KV heads per layer.
    #[getter]
    fn kv_heads(&self) -> usize {
        self.ring.config().kv_heads
    }

    /// Head dimension.
    #[getter]
    fn head_dim(&self) -> usize {
        self.ring.config().head_dim
    }

    /// Recall rows currently injected.
    #[getter]
    fn recall_count(&self) -> usize {
        self.ring.recall_count()
    }

    /// Physical slot of a clock.
    fn physical_slot(&self, clock: u64) -> u32 {
        self.ring.physical_slot(clock)
    }

    /// StreamingLLM cache position of a query at `clock`.
    fn cache_pos(&self, clock: u64) -> u64 {
        self.ring.cache_pos(clock)
    }

    /// The active-slot table (recall, anchors, window in clock order), as uint32.
    fn active_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_slice(py, self.ring.active_slots())
    }

    /// Recall + anchor entries of the table.
    fn fixed_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_slice(py, self.ring.fixed_slots())
    }

    /// Window entries of the table, in clock order.
    fn window_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_slice(py, self.ring.window_slots())
    }

    /// Spans of the visible positions.
    fn spans(&self) -> Vec<PySemanticSpan> {
        self.ring.spans().map(PySemanticSpan::from).collect()
    }

    /// Appends positions from `(n_layers, kv_heads, n, head_dim)` float32 K and V.
    #[pyo3(signature = (keys, vals, span=PySpanType::User, new_span=true))]
    fn append(
        &mut self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        vals: &Bound<'_, PyAny>,
        span: PySpanType,
        new_span: bool,
    ) -> PyResult<()> {
        let (n, k, v) = self.slab(keys, vals)?;
        let ring = &mut self.ring;
        py.detach(|| ring.append_slab(n, &k, &v, span.into(), new_span))
            .map_err(PyErr::from)
    }

    /// Writes a volume slab into positions `[clock, clock + n)` as one new span; with
    /// `checked`, a slab holding NaN/inf is refused (naming the first such position).
    #[pyo3(signature = (keys, vals, span=PySpanType::System, checked=true))]
    fn splice(
        &mut self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        vals: &Bound<'_, PyAny>,
        span: PySpanType,
        checked: bool,
    ) -> PyResult<()> {
        let (n, k, v) = self.slab(keys, vals)?;
        let ring = &mut self.ring;
        py.detach(|| {
            if checked {
                ring.splice_checked(n, &k, &v, span.into())
            } else {
                ring.splice(n, &k, &v, span.into())
            }
        })
        .map_err(PyErr::from)
    }

    /// Undoes every position after `saved` (exactly).
    fn rollback_clock(&mut self, saved: i64) -> PyResult<()> {
        let saved = u64::try_from(saved)
            .map_err(|_| value_error(format!("clock must be non-negative, got {saved}")))?;
        self.ring.rollback_clock(saved).map_err(PyErr::from)
    }

    /// Adds recall rows `(n_layers, kv_heads, n, head_dim)` float32 to tier 3.
    fn inject_recall(&mut self, keys: &Bound<'_, PyAny>, vals: &Bound<'_, PyAny>) -> PyResult<()> {
        let (n, k, v) = self.slab(keys, vals)?;
        self.ring.inject_recall(n, &k, &v).map_err(PyErr::from)
    }

    /// Removes every recall entry from the table.
    fn clear_recall(&mut self) -> PyResult<()> {
        self.ring.clear_recall().map_err(PyErr::from)
    }

    /// Evicts oldest whole window spans until `min_tokens` positions left; returns how many.
    fn prune_oldest_spans(&mut self, min_tokens: i64) -> PyResult<u64> {
        let min_tokens = u64::try_from(min_tokens).map_err(|_| {
            value_error(format!("min_tokens must be non-negative, got {min_tokens}"))
        })?;
        self.ring
            .prune_oldest_spans(min_tokens)
            .map_err(PyErr::from)
    }

    /// Copy of one layer's keys, `(slots, kv_heads, head_dim)`.
    fn layer_keys<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
    ) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        self.layer_array(py, layer, false)
    }

    /// Copy of one layer's values, `(slots, kv_heads, head_dim)`.
    fn layer_vals<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
    ) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        self.layer_array(py, layer, true)
    }

    /// Logical positions `[0, n)` of layers `[layer_lo, layer_hi)` in the volume layout
    /// `(layers, kv_heads, n, head_dim)`.
    #[pyo3(signature = (n, layer_lo=0, layer_hi=None))]
    #[allow(clippy::type_complexity)]
    fn read_logical<'py>(
        &self,
        py: Python<'py>,
        n: usize,
        layer_lo: usize,
        layer_hi: Option<usize>,
    ) -> PyResult<(Bound<'py, PyArrayDyn<f32>>, Bound<'py, PyArrayDyn<f32>>)> {
        let cfg = self.ring.config();
        let layer_hi = layer_hi.unwrap_or(cfg.n_layers);
        let layers = layer_hi.saturating_sub(layer_lo);
        let len = layers * cfg.row_len() * n;
        let (mut k, mut v) = (vec![0.0; len], vec![0.0; len]);
        self.ring
            .read_logical(layer_lo, layer_hi, n, &mut k, &mut v)
            .map_err(PyErr::from)?;
        let shape = vec![layers, cfg.kv_heads, n, cfg.head_dim];
        Ok((
            PyArray1::from_vec(py, k).reshape(shape.clone())?,
            PyArray1::from_vec(py, v).reshape(shape)?,
        ))
    }

    fn __repr__(&self) -> String {
        let cfg = self.ring.config();
        format!(
            "RingBuffer(n_layers={}, kv_heads={}, head_dim={}, slots={}, recall={}, n_sys={}, clock={})",
            cfg.n_layers,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.slots,
            cfg.recall,
            cfg.n_sys,
            self.ring.clock()
        )
    }
}

/// Attention of one query row `q (n_q_heads, head_dim)` over the rows `active_slots` of
/// `keys`/`vals` `(slots, n_kv_heads, head_dim)`, in table order; scale `1/sqrt(head_dim)`.
#[pyfunction]
fn attend<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    keys: &Bound<'py, PyAny>,
    vals: &Bound<'py, PyAny>,
    active_slots: &Bound<'py, PyAny>,
    n_kv_heads: usize,
) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let (q_shape, q) = f32_array(q, "q", 2)?;
    let (k_shape, k) = f32_array(keys, "keys", 3)?;
    let (v_shape, v) = f32_array(vals, "vals", 3)?;
    let (n_q_heads, head_dim) = (q_shape[0], q_shape[1]);
    check_shape("keys", &k_shape, &[k_shape[0], n_kv_heads, head_dim])?;
    check_shape("vals", &v_shape, &k_shape)?;
    let slots: Vec<i64> = active_slots.extract().map_err(|_| {
        value_error("active_slots must be a 1-D sequence of integers (e.g. a uint32 array)")
    })?;
    let slots: Vec<u32> = slots
        .into_iter()
        .map(|s| {
            u32::try_from(s).map_err(|_| {
                value_error(format!(
                    "slot {s} out of range: the ring has {} slots",
                    k_shape[0]
                ))
            })
        })
        .collect::<PyResult<_>>()?;
    let dims = AttnDims {
        n_q_heads,
        n_kv_heads,
        head_dim,
    };
    let inputs = AttnInputs {
        q_fixed: &q,
        q_window: &q,
        ring_k: KvSlice::F32(&k),
        ring_v: KvSlice::F32(&v),
        fixed_slots: &slots,
        window_slots: &[],
        window_head: None,
        local_k: &[],
        local_v: &[],
    };
    let mut scratch = vec![0.0; attention::scratch_len(dims, slots.len())];
    let mut out = vec![0.0; n_q_heads * head_dim];
    let scale = 1.0 / (head_dim as f32).sqrt();
    py.detach(|| attention::attend(&inputs, dims, scale, &mut scratch, &mut out))
        .map_err(PyErr::from)?;
    PyArray1::from_vec(py, out).reshape(vec![n_q_heads, head_dim])
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySpanType>()?;
    m.add_class::<PySemanticSpan>()?;
    m.add_class::<PyRingBuffer>()?;
    m.add_function(wrap_pyfunction!(attend, m)?)?;
    Ok(())
}
