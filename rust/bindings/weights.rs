//! Bindings of the weights: loading a model file (whole, or one station's layer range), the
//! per-tensor digests the fingerprint is made of, and what the weights keep in memory.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::model::{
    tensor_digests as core_tensor_digests, Architecture, Digest, LlamaWeights, LoadOptions,
    ModelConfig, Precision, SlidingWindow, TensorInfo,
};
use crate::ring::KvDtype;

use super::exceptions::InputError;
use super::model::parse_kv_dtype;

/// A tensor table as Python passes it: `(name, ggml type id, dims, absolute offset)`.
type Table = Vec<(String, u32, Vec<u64>, u64)>;

fn table_of(tensors: Table) -> Vec<TensorInfo> {
    tensors
        .into_iter()
        .map(|(name, ggml_type, dims, offset)| TensorInfo {
            name,
            ggml_type,
            dims,
            offset,
        })
        .collect()
}

/// The model description the GGUF reader derived (`runtime.gguf_file.model_config`).
fn config_of(config: &Bound<'_, PyDict>) -> PyResult<ModelConfig> {
    fn get<'py, T: for<'a> FromPyObject<'a, 'py>>(
        d: &Bound<'py, PyDict>,
        key: &str,
    ) -> PyResult<T> {
        d.get_item(key)?
            .ok_or_else(|| InputError::new_err(format!("config is missing {key:?}")))?
            .extract::<T>()
            .map_err(|_| InputError::new_err(format!("config[{key:?}] has the wrong type")))
    }
    let sliding = match config.get_item("sliding_window")? {
        Some(window) if !window.is_none() => Some(SlidingWindow {
            window: window
                .extract()
                .map_err(|_| InputError::new_err("config[\"sliding_window\"] must be an int"))?,
            rope_base: get(config, "rope_base_local")?,
            local: get(config, "local_layers")?,
        }),
        _ => None,
    };
    let arch: String = get(config, "arch")?;
    Ok(ModelConfig {
        arch: Architecture::from_name(&arch).map_err(PyErr::from)?,
        n_layers: get(config, "n_layers")?,
        hidden: get(config, "hidden")?,
        ffn: get(config, "ffn")?,
        n_heads: get(config, "n_heads")?,
        n_kv_heads: get(config, "n_kv_heads")?,
        key_length: get(config, "head_dim")?,
        vocab: get(config, "vocab")?,
        rope_base: get(config, "rope_base")?,
        rms_eps: get(config, "rms_eps")?,
        context_len: get(config, "context_len")?,
        attn_scale: get(config, "attn_scale")?,
        sliding,
    })
}

fn digests_of(digests: Vec<Vec<u8>>) -> PyResult<Vec<Digest>> {
    digests
        .into_iter()
        .map(|d| {
            <Digest>::try_from(d.as_slice()).map_err(|_| {
                InputError::new_err(format!("a tensor digest is 32 bytes, got {}", d.len()))
            })
        })
        .collect()
}

/// The BLAKE3 digest of every tensor's bytes, in table order, read from `path` with `read`
/// (the file is never mapped, so none of it stays resident): what the mesh launcher computes
/// once so that each station hashes only its own layers.
#[pyfunction]
fn tensor_digests<'py>(
    py: Python<'py>,
    path: PathBuf,
    tensors: Table,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let table = table_of(tensors);
    let digests = py
        .detach(|| core_tensor_digests(&path, &table))
        .map_err(PyErr::from)?;
    Ok(digests.iter().map(|d| PyBytes::new(py, d)).collect())
}

/// Memory-mapped GGUF weights of a model of a supported architecture.
#[pyclass(name = "ModelWeights", module = "amplituhedron_rs._core", frozen)]
pub struct PyModelWeights {
    pub(crate) inner: Arc<LlamaWeights>,
}

#[pymethods]
impl PyModelWeights {
    /// Maps `path` and validates `tensors` (name, ggml type id, dims, absolute offset).
    /// `layers=(lo, hi)` materialises only that range (a station's); `digests` (in table
    /// order, from `tensor_digests`) spare hashing the other ranges' tensors.
    #[new]
    #[pyo3(signature = (path, config, tensors, precision="refined", kv_dtype=KvDtype::default().name(), *, layers=None, digests=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        config: &Bound<'_, PyDict>,
        tensors: Table,
        precision: &str,
        kv_dtype: &str,
        layers: Option<(usize, usize)>,
        digests: Option<Vec<Vec<u8>>>,
    ) -> PyResult<Self> {
        let precision = Precision::from_name(precision).ok_or_else(|| {
            InputError::new_err(format!(
                "precision must be 'refined' or 'fast', got {precision:?}"
            ))
        })?;
        let kv_dtype = parse_kv_dtype(kv_dtype)?;
        let config = config_of(config)?;
        let table = table_of(tensors);
        let options = LoadOptions {
            layers,
            digests: digests.map(digests_of).transpose()?,
        };
        let weights = py
            .detach(|| {
                LlamaWeights::from_file_with(&path, config, &table, precision, kv_dtype, options)
            })
            .map_err(PyErr::from)?;
        Ok(PyModelWeights {
            inner: Arc::new(weights),
        })
    }

    /// The layers these weights hold, `(lo, hi)`: all of them unless loaded with `layers`.
    #[getter]
    fn layers_held(&self) -> (usize, usize) {
        self.inner.layers_held()
    }

    /// What the weights hold and keep resident, in bytes: ``held`` (their tensors: what the
    /// memory check counted), ``copied`` (anonymous interleaved copies), ``mapped`` (this
    /// process's resident pages of the file mapping, from /proc/self/smaps; None where it
    /// cannot be read) and ``resident`` (copied + mapped).
    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = py.detach(|| self.inner.memory());
        let d = PyDict::new(py);
        d.set_item("held", m.held)?;
        d.set_item("copied", m.copied)?;
        d.set_item("mapped", m.mapped)?;
        d.set_item("resident", m.resident())?;
        Ok(d)
    }

    /// Content hash of weights + config: the model fingerprint of every volume key.
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }

    /// Activation precision: "refined" (16-bit codes in two byte planes) or "fast" (8-bit).
    #[getter]
    fn precision(&self) -> &'static str {
        self.inner.precision().name()
    }

    /// How sessions store K and V: "f16" (default) or "f32".
    #[getter]
    fn kv_dtype(&self) -> &'static str {
        self.inner.kv_dtype().name()
    }

    /// Bytes a ring spends per stored K or V value.
    #[getter]
    fn kv_value_bytes(&self) -> usize {
        self.inner.kv_dtype().bytes()
    }

    /// Number of transformer blocks.
    #[getter]
    fn n_layers(&self) -> usize {
        self.inner.config().n_layers
    }

    /// Residual-stream width.
    #[getter]
    fn hidden(&self) -> usize {
        self.inner.config().hidden
    }

    /// Vocabulary size.
    #[getter]
    fn vocab(&self) -> usize {
        self.inner.config().vocab
    }

    /// KV heads.
    #[getter]
    fn n_kv_heads(&self) -> usize {
        self.inner.config().n_kv_heads
    }

    /// Width of one head.
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.config().head_dim()
    }

    /// Trained context length.
    #[getter]
    fn context_len(&self) -> usize {
        self.inner.config().context_len
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(tensor_digests, m)?)?;
    m.add_class::<PyModelWeights>()?;
    Ok(())
}
