//! Python bindings of the volume cache, the matvec memo and `prefix_hash`.
//!
//! Argument conversion and error mapping only: every rule lives in `crate::volume`,
//! `crate::memo` and `crate::keys`. Bad input raises `InputError` (a `ValueError`) and leaves state as it
//! was (the core validates before mutating; conversions here happen before the core runs).

use std::fmt::Display;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use numpy::ndarray::{ArrayView1, ArrayView4, ArrayViewD, ShapeBuilder};
use numpy::{
    PyArray, PyArray1, PyArray4, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods,
    PyReadonlyArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::conversion::FromPyObjectOwned;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use super::exceptions::{poisoned, CacheError, InputError};
use crate::eviction::EvictionPolicy;
use crate::keys;
use crate::memo::{MatVecMemo, MemoConfig};
use crate::volume::{
    AmplituhedronCache, AmplituhedronVolume, CacheConfig, DamageOutcome, OwnedVolumeData,
    VolumeData, VolumeKey,
};

/// An integer argument of a fixed-width type; anything else is an `InputError`.
fn int_arg<'py, T: FromPyObjectOwned<'py>>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    range: &str,
) -> PyResult<T> {
    obj.extract::<T>().map_err(|_| {
        let shown = obj
            .repr()
            .map_or_else(|_| "<unprintable>".to_owned(), |r| r.to_string());
        InputError::new_err(format!("{name} must be an integer in {range}, got {shown}"))
    })
}

fn u64_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    int_arg(obj, name, "[0, 2**64)")
}

fn u16_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u16> {
    int_arg(obj, name, "[0, 65535]")
}

/// A size limit given as a Python int: it must be at least 1 (the core says so too; this
/// only keeps negative numbers from turning into an `OverflowError`).
fn limit_arg(value: i64, name: &str) -> PyResult<usize> {
    usize::try_from(value)
        .ok()
        .filter(|&v| v >= 1)
        .ok_or_else(|| InputError::new_err(format!("{name} must be at least 1, got {value}")))
}

fn policy_arg(policy: &str) -> PyResult<EvictionPolicy> {
    policy.parse().map_err(PyErr::from)
}

/// The volume cache's configuration from the Python arguments shared by `AmplituhedronCache`
/// and `NativeLlamaPipeline`; `policy=None` takes the core's default.
pub(crate) fn cache_config(
    max_entries: i64,
    max_prefix_len: i64,
    max_bytes: Option<i64>,
    policy: Option<&str>,
    cache_dir: Option<PathBuf>,
    max_disk_bytes: Option<i64>,
) -> PyResult<CacheConfig> {
    let defaults = CacheConfig::default();
    Ok(CacheConfig {
        max_entries: limit_arg(max_entries, "max_entries")?,
        max_prefix_len: limit_arg(max_prefix_len, "max_prefix_len")?,
        max_bytes: max_bytes.map(|b| limit_arg(b, "max_bytes")).transpose()?,
        policy: policy.map_or(Ok(defaults.policy), policy_arg)?,
        cache_dir,
        max_disk_bytes: max_disk_bytes
            .map(|b| limit_arg(b, "max_disk_bytes").map(|b| b as u64))
            .transpose()?,
    })
}

/// Token ids from a sequence of ints or a 1-D integer numpy array; each must fit `u32`.
fn tokens_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let py = obj.py();
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(InputError::new_err(format!(
                "tokens must be a 1-D array, got {}-D",
                arr.ndim()
            )));
        }
        let dtype = arr.dtype();
        if let Ok(a) = arr.cast::<PyArray1<u32>>() {
            return Ok(a.readonly().as_array().to_vec());
        }
        // Widen to 64 bits (lossless for every integer dtype), then range-check.
        return match dtype.kind() {
            b'u' => {
                let wide = arr.call_method1("astype", (numpy::dtype::<u64>(py),))?;
                let wide = wide.cast::<PyArray1<u64>>()?.readonly();
                wide.as_array()
                    .iter()
                    .enumerate()
                    .map(|(i, &t)| u32::try_from(t).map_err(|_| token_range_error(i, t)))
                    .collect()
            }
            b'i' => {
                let wide = arr.call_method1("astype", (numpy::dtype::<i64>(py),))?;
                let wide = wide.cast::<PyArray1<i64>>()?.readonly();
                wide.as_array()
                    .iter()
                    .enumerate()
                    .map(|(i, &t)| u32::try_from(t).map_err(|_| token_range_error(i, t)))
                    .collect()
            }
            _ => Err(InputError::new_err(format!(
                "tokens must be integers, got an array of dtype {dtype}"
            ))),
        };
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(InputError::new_err(
            "tokens must be a sequence of ints, not a string",
        ));
    }
    let iter = obj
        .try_iter()
        .map_err(|_| InputError::new_err("tokens must be a sequence of ints or a 1-D array"))?;
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for (i, item) in iter.enumerate() {
        let item = item?;
        match item.extract::<i128>() {
            Ok(t) => out.push(u32::try_from(t).map_err(|_| token_range_error(i, t))?),
            Err(_) => {
                return Err(InputError::new_err(format!(
                    "token at index {i} is not an integer: {}",
                    item.repr()?
                )))
            }
        }
    }
    Ok(out)
}

fn token_range_error(index: usize, value: impl Display) -> PyErr {
    InputError::new_err(format!(
        "token id {value} at index {index} does not fit u32 (must be in [0, 4294967295])"
    ))
}

/// A float32 numpy array of `ndim` dimensions (any strides), borrowed read-only.
fn f32_array<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    ndim: usize,
) -> PyResult<PyReadonlyArrayDyn<'py, f32>> {
    let arr = obj.cast::<PyUntypedArray>().map_err(|_| {
        let ty = obj
            .get_type()
            .name()
            .map_or_else(|_| "?".to_owned(), |n| n.to_string());
        InputError::new_err(format!("{name} must be a float32 numpy array, got {ty}"))
    })?;
    if !arr.dtype().is_equiv_to(&numpy::dtype::<f32>(obj.py())) {
        return Err(InputError::new_err(format!(
            "{name} must have dtype float32, got {}",
            arr.dtype()
        )));
    }
    if arr.ndim() != ndim {
        return Err(InputError::new_err(format!(
            "{name} must be {ndim}-D, got {}-D with shape {:?}",
            arr.ndim(),
            arr.shape()
        )));
    }
    arr.cast::<PyArrayDyn<f32>>()?
        .try_readonly()
        .map_err(|e| InputError::new_err(format!("{name} cannot be borrowed: {e}")))
}

/// The values in logical (C) order, copied once.
fn to_vec(a: &ArrayViewD<'_, f32>) -> Vec<f32> {
    match a.as_slice() {
        Some(s) => s.to_vec(),
        None => a.iter().copied().collect(),
    }
}

pub(crate) fn stats_dict<'py>(
    py: Python<'py>,
    items: &[(&str, u64)],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in items {
        d.set_item(k, v)?;
    }
    Ok(d)
}

// ---------------------------------------------------------------------------------------

/// One cached prefix volume. Immutable; its arrays are read-only zero-copy views.
#[pyclass(
    module = "amplituhedron_rs._core",
    name = "AmplituhedronVolume",
    frozen
)]
struct PyVolume {
    inner: Arc<AmplituhedronVolume>,
}

impl PyVolume {
    /// A read-only numpy view of `data` (shape `dims`, element `strides`) owned by `slf`.
    fn view<'py, D: numpy::ndarray::Dimension>(
        slf: &Bound<'py, Self>,
        view: numpy::ndarray::ArrayView<'_, f32, D>,
    ) -> Bound<'py, PyArray<f32, D>> {
        // SAFETY: the view points into buffers owned by `slf.inner` (an `Arc` of an
        // immutable volume): the Python object `slf` becomes the array's base, so the buffers
        // outlive the array, and nothing ever reallocates or writes them.
        let arr = unsafe { PyArray::borrow_from_array(&view, slf.clone().into_any()) };
        // Read-only: a write through the view would mutate a shared cache entry.
        arr.readwrite().make_nonwriteable();
        arr
    }

    fn kv_view<'py>(slf: &Bound<'py, Self>, keys: bool) -> PyResult<Bound<'py, PyArray4<f32>>> {
        let v = &slf.get().inner;
        let s = v.slab_shape();
        let slab = if keys { v.kv_keys() } else { v.kv_vals() };
        // Only the covered positions; the stride stays prefix_len (after an erasure the
        // trailing row is still in the buffer but outside the view).
        let shape = (s.layers, s.kv_heads, v.kv_len(), s.head_dim).strides((
            s.kv_heads * s.positions * s.head_dim,
            s.positions * s.head_dim,
            s.head_dim,
            1,
        ));
        let view =
            ArrayView4::from_shape(shape, slab).map_err(|e| CacheError::new_err(e.to_string()))?;
        Ok(Self::view(slf, view))
    }

    fn vec_view<'py>(
        slf: &Bound<'py, Self>,
        data: Option<&[f32]>,
    ) -> Option<Bound<'py, PyArray1<f32>>> {
        data.map(|d| Self::view(slf, ArrayView1::from(d)))
    }
}

#[pymethods]
impl PyVolume {
    /// Model fingerprint the volume was captured under.
    #[getter]
    fn model_fingerprint(&self) -> u64 {
        self.inner.model_fingerprint()
    }

    /// Lookup hash (the wire prefix_hash if unsalted, the tenant-keyed one if salted).
    #[getter]
    fn prefix_hash(&self) -> u64 {
        self.inner.prefix_hash()
    }

    /// First layer of the range.
    #[getter]
    fn layer_lo(&self) -> u16 {
        self.inner.layer_lo()
    }

    /// One past the last layer.
    #[getter]
    fn layer_hi(&self) -> u16 {
        self.inner.layer_hi()
    }

    /// Tokens in the prefix.
    #[getter]
    fn prefix_len(&self) -> usize {
        self.inner.prefix_len()
    }

    /// Positions the KV views cover (prefix_len, or prefix_len - 1 after an erasure).
    #[getter]
    fn kv_len(&self) -> usize {
        self.inner.kv_len()
    }

    /// KV heads per layer.
    #[getter]
    fn kv_heads(&self) -> usize {
        self.inner.kv_heads()
    }

    /// Floats per row.
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.head_dim()
    }

    /// Byte size counted against max_bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// How the KV is stored: "f16" for a volume an f16 session captured (half the bytes;
    /// kv_keys/kv_vals widen it to f32 exactly), "f32" otherwise.
    #[getter]
    fn kv_dtype(&self) -> &'static str {
        self.inner.kv_dtype().name()
    }

    /// Pisot drift of the tail at capture.
    #[getter]
    fn drift(&self) -> f32 {
        self.inner.drift()
    }

    /// Whether the volume belongs to a salted tenant.
    #[getter]
    fn salted(&self) -> bool {
        self.inner.is_salted()
    }

    /// The prefix token ids (read-only uint32 view).
    #[getter]
    fn tokens<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyArray1<u32>> {
        let tokens = slf.get().inner.tokens();
        // SAFETY: as in `view`: the tokens live in the immutable `Arc`'d volume owned by
        // `slf`, which becomes the array's base.
        let arr = unsafe {
            PyArray1::borrow_from_array(&ArrayView1::from(tokens), slf.clone().into_any())
        };
        arr.readwrite().make_nonwriteable();
        arr
    }

    /// Tail residual (read-only view), None after an erasure.
    #[getter]
    fn tail<'py>(slf: &Bound<'py, Self>) -> Option<Bound<'py, PyArray1<f32>>> {
        Self::vec_view(slf, slf.get().inner.tail())
    }

    /// Exit-station logits (read-only view), or None.
    #[getter]
    fn logits<'py>(slf: &Bound<'py, Self>) -> Option<Bound<'py, PyArray1<f32>>> {
        Self::vec_view(slf, slf.get().inner.logits())
    }

    /// Keys, shape (layer_hi - layer_lo, kv_heads, kv_len, head_dim), read-only view.
    #[getter]
    fn kv_keys<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArray4<f32>>> {
        Self::kv_view(slf, true)
    }

    /// Values, shape (layer_hi - layer_lo, kv_heads, kv_len, head_dim), read-only view.
    #[getter]
    fn kv_vals<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArray4<f32>>> {
        Self::kv_view(slf, false)
    }

    /// Smallest covered position holding a non-finite value in either slab, or None.
    fn first_non_finite_position(&self, py: Python<'_>) -> Option<usize> {
        let v = &self.inner;
        py.detach(|| v.first_non_finite_position())
    }

    fn __repr__(&self) -> String {
        let v = &self.inner;
        format!(
            "AmplituhedronVolume(prefix_hash={}, layers=[{}, {}), prefix_len={}, kv_len={}, kv_heads={}, head_dim={}, nbytes={})",
            v.prefix_hash(),
            v.layer_lo(),
            v.layer_hi(),
            v.prefix_len(),
            v.kv_len(),
            v.kv_heads(),
            v.head_dim(),
            v.nbytes()
        )
    }
}

// ---------------------------------------------------------------------------------------

/// A station's bounded cache of prefix volumes (thread-safe; the GIL is released around
/// hashing and copying).
#[pyclass(module = "amplituhedron_rs._core", name = "AmplituhedronCache", frozen)]
struct PyCache {
    inner: Mutex<AmplituhedronCache>,
}

impl PyCache {
    fn lock(&self) -> PyResult<MutexGuard<'_, AmplituhedronCache>> {
        self.inner.lock().map_err(|_| poisoned("volume cache"))
    }
}

/// The owned arguments that address a volume.
struct KeyArgs {
    fingerprint: u64,
    tokens: Vec<u32>,
    layer_lo: u16,
    layer_hi: u16,
    salt: Option<String>,
}

impl KeyArgs {
    fn parse(
        fingerprint: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        layer_lo: &Bound<'_, PyAny>,
        layer_hi: &Bound<'_, PyAny>,
        salt: Option<String>,
    ) -> PyResult<Self> {
        Ok(KeyArgs {
            fingerprint: u64_arg(fingerprint, "fingerprint")?,
            tokens: tokens_arg(tokens)?,
            layer_lo: u16_arg(layer_lo, "layer_lo")?,
            layer_hi: u16_arg(layer_hi, "layer_hi")?,
            salt,
        })
    }

    fn key(&self) -> VolumeKey<'_> {
        VolumeKey {
            model_fingerprint: self.fingerprint,
            tokens: &self.tokens,
            layer_lo: self.layer_lo,
            layer_hi: self.layer_hi,
            salt: self.salt.as_deref(),
        }
    }
}

#[pymethods]
impl PyCache {
    #[new]
    #[pyo3(signature = (max_entries=CacheConfig::default().max_entries as i64, max_prefix_len=CacheConfig::default().max_prefix_len as i64, max_bytes=None, policy=None, cache_dir=None, max_disk_bytes=None))]
    fn new(
        py: Python<'_>,
        max_entries: i64,
        max_prefix_len: i64,
        max_bytes: Option<i64>,
        policy: Option<&str>,
        cache_dir: Option<PathBuf>,
        max_disk_bytes: Option<i64>,
    ) -> PyResult<Self> {
        let config = cache_config(
            max_entries,
            max_prefix_len,
            max_bytes,
            policy,
            cache_dir,
            max_disk_bytes,
        )?;
        // Opening a directory reads every file header: no GIL needed for that.
        let cache = py
            .detach(|| AmplituhedronCache::new(config))
            .map_err(PyErr::from)?;
        Ok(PyCache {
            inner: Mutex::new(cache),
        })
    }

    /// Captures a volume; returns the bytes now cached for this key (0 when skipped).
    #[pyo3(signature = (fingerprint, tokens, layer_lo, layer_hi, tail, kv_keys, kv_vals, logits=None, salt=None))]
    #[allow(clippy::too_many_arguments)]
    fn capture(
        &self,
        py: Python<'_>,
        fingerprint: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        layer_lo: &Bound<'_, PyAny>,
        layer_hi: &Bound<'_, PyAny>,
        tail: &Bound<'_, PyAny>,
        kv_keys: &Bound<'_, PyAny>,
        kv_vals: &Bound<'_, PyAny>,
        logits: Option<&Bound<'_, PyAny>>,
        salt: Option<String>,
    ) -> PyResult<usize> {
        let args = KeyArgs::parse(fingerprint, tokens, layer_lo, layer_hi, salt)?;
        let tail = f32_array(tail, "tail", 1)?;
        let keys = f32_array(kv_keys, "kv_keys", 4)?;
        let vals = f32_array(kv_vals, "kv_vals", 4)?;
        let logits = logits.map(|l| f32_array(l, "logits", 1)).transpose()?;
        if keys.shape() != vals.shape() {
            return Err(InputError::new_err(format!(
                "kv_vals shape {:?} differs from kv_keys shape {:?}",
                vals.shape(),
                keys.shape()
            )));
        }
        let kv_shape: [usize; 4] = keys
            .shape()
            .try_into()
            .map_err(|_| InputError::new_err("kv_keys must be 4-D"))?;
        let (tail, keys, vals) = (tail.as_array(), keys.as_array(), vals.as_array());
        let logits = logits.as_ref().map(|l| l.as_array());
        let key = args.key();
        let outcome = py.detach(|| -> PyResult<_> {
            let tail = to_vec(&tail);
            let logits = logits.as_ref().map(to_vec);
            let result = match (keys.as_slice(), vals.as_slice()) {
                // C-contiguous: the one copy is the cache's own (fused with the check).
                (Some(k), Some(v)) => self.lock()?.capture(
                    &key,
                    VolumeData {
                        kv_shape,
                        tail: &tail,
                        kv_keys: k.into(),
                        kv_vals: v.into(),
                        logits: logits.as_deref(),
                    },
                ),
                // Strided: one logical-order copy each, moved into the cache.
                _ => {
                    let owned = OwnedVolumeData {
                        kv_shape,
                        tail: tail.clone(),
                        kv_keys: to_vec(&keys),
                        kv_vals: to_vec(&vals),
                        logits: logits.clone(),
                    };
                    self.lock()?.capture_owned(&key, owned)
                }
            };
            result.map_err(PyErr::from)
        })?;
        Ok(outcome.cached_bytes())
    }

    /// The cached volume for this key, or None on a miss.
    #[pyo3(signature = (fingerprint, tokens, layer_lo, layer_hi, salt=None))]
    fn replay(
        &self,
        py: Python<'_>,
        fingerprint: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        layer_lo: &Bound<'_, PyAny>,
        layer_hi: &Bound<'_, PyAny>,
        salt: Option<String>,
    ) -> PyResult<Option<PyVolume>> {
        let args = KeyArgs::parse(fingerprint, tokens, layer_lo, layer_hi, salt)?;
        let key = args.key();
        let hit = py.detach(|| self.lock()?.replay(&key).map_err(PyErr::from))?;
        Ok(hit.map(|inner| PyVolume { inner }))
    }

    /// After an exact miss: the cached volume sharing the longest token prefix with `tokens`
    /// (same model, layer range and salt) and how many of its positions serve them (capped at
    /// len(tokens) - 1), if at least `min_len`; else None.
    #[pyo3(signature = (fingerprint, tokens, layer_lo, layer_hi, salt=None, min_len=16))]
    #[allow(clippy::too_many_arguments)]
    fn replay_longest(
        &self,
        py: Python<'_>,
        fingerprint: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        layer_lo: &Bound<'_, PyAny>,
        layer_hi: &Bound<'_, PyAny>,
        salt: Option<String>,
        min_len: i64,
    ) -> PyResult<Option<(PyVolume, usize)>> {
        let args = KeyArgs::parse(fingerprint, tokens, layer_lo, layer_hi, salt)?;
        let min_len = limit_arg(min_len, "min_len")?;
        let key = args.key();
        let hit = py.detach(|| {
            self.lock()?
                .replay_longest_prefix(&key, min_len)
                .map_err(PyErr::from)
        })?;
        Ok(hit.map(|(inner, n)| (PyVolume { inner }, n)))
    }

    /// Tail residual of the most recent hit if its lookup hash is prefix_hash, else None.
    fn tail<'py>(
        &self,
        py: Python<'py>,
        prefix_hash: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyArray1<f32>>>> {
        let h = u64_arg(prefix_hash, "prefix_hash")?;
        let tail = self.lock()?.tail(h);
        Ok(tail.map(|t| PyArray1::from_vec(py, t)))
    }

    /// Reports damage at `position` of this key's volume: "trimmed", "cleared" or "absent".
    #[pyo3(signature = (fingerprint, tokens, layer_lo, layer_hi, position, salt=None))]
    fn report_damage(
        &self,
        fingerprint: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        layer_lo: &Bound<'_, PyAny>,
        layer_hi: &Bound<'_, PyAny>,
        position: &Bound<'_, PyAny>,
        salt: Option<String>,
    ) -> PyResult<&'static str> {
        let args = KeyArgs::parse(fingerprint, tokens, layer_lo, layer_hi, salt)?;
        let position: usize = int_arg(position, "position", "[0, prefix_len)")?;
        let outcome = self
            .lock()?
            .report_damage(&args.key(), position)
            .map_err(PyErr::from)?;
        Ok(match outcome {
            DamageOutcome::Trimmed { .. } => "trimmed",
            DamageOutcome::Cleared => "cleared",
            DamageOutcome::Absent => "absent",
        })
    }

    /// Counters and occupancy (disk writes that finished are counted; call ``flush`` first
    /// to wait for the queued ones).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut cache = self.lock()?;
        cache.settle();
        stats_dict(py, &cache.stats().as_pairs())
    }

    /// Waits until every volume write queued by a capture is on disk (a no-op without a
    /// cache directory). The GIL is released meanwhile.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.lock().map(|mut c| c.flush()))
    }

    /// Turns the cache on or off (entries are kept).
    fn enable(&self, on: bool) -> PyResult<()> {
        self.lock()?.enable(on);
        Ok(())
    }

    /// Sets the entry limit and evicts down to it at once.
    fn set_max_entries(&self, n: i64) -> PyResult<()> {
        let n = limit_arg(n, "max_entries")?;
        self.lock()?.set_max_entries(n).map_err(PyErr::from)
    }

    /// Sets the longest prefix future captures accept.
    fn set_max_prefix_len(&self, n: i64) -> PyResult<()> {
        let n = limit_arg(n, "max_prefix_len")?;
        self.lock()?.set_max_prefix_len(n).map_err(PyErr::from)
    }

    /// Sets the byte limit (None = unbounded) and evicts down to it at once.
    #[pyo3(signature = (n))]
    fn set_max_bytes(&self, n: Option<i64>) -> PyResult<()> {
        let n = n.map(|b| limit_arg(b, "max_bytes")).transpose()?;
        self.lock()?.set_max_bytes(n).map_err(PyErr::from)
    }

    /// Drops every entry (counters are kept).
    fn clear(&self) -> PyResult<()> {
        self.lock()?.clear();
        Ok(())
    }

    /// Whether the cache is on.
    #[getter]
    fn enabled(&self) -> PyResult<bool> {
        Ok(self.lock()?.is_enabled())
    }

    /// Current entry limit.
    #[getter]
    fn max_entries(&self) -> PyResult<usize> {
        Ok(self.lock()?.config().max_entries)
    }

    /// Current prefix-length limit.
    #[getter]
    fn max_prefix_len(&self) -> PyResult<usize> {
        Ok(self.lock()?.config().max_prefix_len)
    }

    /// Current byte limit (None = unbounded).
    #[getter]
    fn max_bytes(&self) -> PyResult<Option<usize>> {
        Ok(self.lock()?.config().max_bytes)
    }

    /// Eviction policy name ("pisot", "lru" or "gdsf").
    #[getter]
    fn policy(&self) -> PyResult<&'static str> {
        Ok(self.lock()?.config().policy.name())
    }

    /// The directory keeping volumes across restarts, or None.
    #[getter]
    fn cache_dir(&self) -> PyResult<Option<PathBuf>> {
        Ok(self.lock()?.config().cache_dir.clone())
    }

    /// The byte budget of the cache directory (None = unbounded).
    #[getter]
    fn max_disk_bytes(&self) -> PyResult<Option<u64>> {
        Ok(self.lock()?.config().max_disk_bytes)
    }

    /// Entries resident in memory.
    fn __len__(&self) -> PyResult<usize> {
        Ok(self.lock()?.len())
    }
}

// ---------------------------------------------------------------------------------------

/// Exact-match memo of decode matvecs y = W·x, keyed by (weight id, BLAKE3 of x). Off by
/// default.
#[pyclass(module = "amplituhedron_rs._core", name = "MatVecMemo", frozen)]
struct PyMemo {
    inner: Mutex<MatVecMemo>,
}

impl PyMemo {
    fn lock(&self) -> PyResult<MutexGuard<'_, MatVecMemo>> {
        self.inner.lock().map_err(|_| poisoned("memo"))
    }
}

#[pymethods]
impl PyMemo {
    #[new]
    #[pyo3(signature = (max_entries=MemoConfig::default().max_entries as i64, max_bytes=None, policy=MemoConfig::default().policy.name()))]
    fn new(max_entries: i64, max_bytes: Option<i64>, policy: &str) -> PyResult<Self> {
        let config = MemoConfig {
            max_entries: limit_arg(max_entries, "max_entries")?,
            max_bytes: max_bytes.map(|b| limit_arg(b, "max_bytes")).transpose()?,
            policy: policy_arg(policy)?,
        };
        Ok(PyMemo {
            inner: Mutex::new(MatVecMemo::new(config).map_err(PyErr::from)?),
        })
    }

    /// The memoised y for (weight_id, x) as a new array, or None.
    fn get<'py>(
        &self,
        py: Python<'py>,
        weight_id: &Bound<'py, PyAny>,
        x: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyArray1<f32>>>> {
        let w = u64_arg(weight_id, "weight_id")?;
        let x = to_vec(&f32_array(x, "x", 1)?.as_array());
        let mut memo = self.lock()?;
        Ok(memo.get(w, &x).map(|y| PyArray1::from_slice(py, y)))
    }

    /// Memoises y = W·x; returns the bytes now memoised for this key (0 when not stored).
    fn insert(
        &self,
        weight_id: &Bound<'_, PyAny>,
        x: &Bound<'_, PyAny>,
        y: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let w = u64_arg(weight_id, "weight_id")?;
        let x = to_vec(&f32_array(x, "x", 1)?.as_array());
        let y = to_vec(&f32_array(y, "y", 1)?.as_array());
        let outcome = self.lock()?.insert(w, &x, &y).map_err(PyErr::from)?;
        Ok(outcome.cached_bytes())
    }

    /// Counters and occupancy.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.lock()?.stats();
        stats_dict(
            py,
            &[
                ("hits", s.hits),
                ("misses", s.misses),
                ("evictions", s.evictions),
                ("entries", s.entries as u64),
                ("bytes", s.bytes as u64),
            ],
        )
    }

    /// Turns the memo on or off (entries are kept).
    fn enable(&self, on: bool) -> PyResult<()> {
        self.lock()?.enable(on);
        Ok(())
    }

    /// Drops every entry (counters are kept).
    fn clear(&self) -> PyResult<()> {
        self.lock()?.clear();
        Ok(())
    }

    /// Sets the entry limit and evicts down to it at once.
    fn set_max_entries(&self, n: i64) -> PyResult<()> {
        let n = limit_arg(n, "max_entries")?;
        self.lock()?.set_max_entries(n).map_err(PyErr::from)
    }

    /// Sets the byte limit (None = unbounded) and evicts down to it at once.
    #[pyo3(signature = (n))]
    fn set_max_bytes(&self, n: Option<i64>) -> PyResult<()> {
        let n = n.map(|b| limit_arg(b, "max_bytes")).transpose()?;
        self.lock()?.set_max_bytes(n).map_err(PyErr::from)
    }

    /// Whether the memo is on.
    #[getter]
    fn enabled(&self) -> PyResult<bool> {
        Ok(self.lock()?.is_enabled())
    }

    /// Eviction policy name ("pisot", "lru" or "gdsf").
    #[getter]
    fn policy(&self) -> PyResult<&'static str> {
        Ok(self.lock()?.config().policy.name())
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.lock()?.stats().entries)
    }
}

// ---------------------------------------------------------------------------------------

/// The wire prefix_hash: first 8 bytes (LE u64) of BLAKE3 over the ids as LE u32.
#[pyfunction]
fn prefix_hash(tokens: &Bound<'_, PyAny>) -> PyResult<u64> {
    Ok(keys::prefix_hash(&tokens_arg(tokens)?))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyVolume>()?;
    m.add_class::<PyCache>()?;
    m.add_class::<PyMemo>()?;
    m.add_function(wrap_pyfunction!(prefix_hash, m)?)?;
    Ok(())
}
