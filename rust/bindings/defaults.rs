//! The core's defaults, exposed once as `_core.DEFAULTS` so that Python (runtime options,
//! station settings, CLI defaults and help) reads them instead of repeating the numbers.

use pyo3::prelude::*;

use crate::model::{SessionConfig, DEFAULT_MIN_PREFIX_REUSE};
use crate::ring::KvDtype;
use crate::volume::CacheConfig;

/// Defaults of the volume cache (`CacheConfig`), the longest-prefix replay threshold and a
/// session's ring (`SessionConfig`).
#[pyclass(name = "Defaults", module = "amplituhedron_rs._core", frozen, get_all)]
pub struct PyDefaults {
    /// Most volumes a cache holds at once.
    max_entries: usize,
    /// Longest prefix captured, in tokens.
    max_prefix_len: usize,
    /// Most bytes a cache holds at once (None: unbounded).
    max_bytes: Option<usize>,
    /// Eviction policy name.
    policy: &'static str,
    /// Longest-prefix replay reuses a cached prefix of at least this many tokens.
    min_prefix_reuse: usize,
    /// Physical KV slots of a session's ring.
    slots: usize,
    /// Recall slots reserved at the top of the ring.
    recall: usize,
    /// Locked anchor slots for the system prompt.
    n_sys: usize,
    /// Rows computed together in one prefill chunk.
    max_chunk: usize,
    /// How sessions store K and V ("f16" or "f32").
    kv_dtype: &'static str,
}

#[pymethods]
impl PyDefaults {
    fn __repr__(&self) -> String {
        format!(
            "Defaults(max_entries={}, max_prefix_len={}, max_bytes={:?}, policy={:?}, \
             min_prefix_reuse={}, slots={}, recall={}, n_sys={}, max_chunk={}, kv_dtype={:?})",
            self.max_entries,
            self.max_prefix_len,
            self.max_bytes,
            self.policy,
            self.min_prefix_reuse,
            self.slots,
            self.recall,
            self.n_sys,
            self.max_chunk,
            self.kv_dtype
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let cache = CacheConfig::default();
    let session = SessionConfig::default();
    let defaults = PyDefaults {
        max_entries: cache.max_entries,
        max_prefix_len: cache.max_prefix_len,
        max_bytes: cache.max_bytes,
        policy: cache.policy.name(),
        min_prefix_reuse: DEFAULT_MIN_PREFIX_REUSE,
        slots: session.slots,
        recall: session.recall,
        n_sys: session.n_sys,
        max_chunk: session.max_chunk,
        kv_dtype: KvDtype::default().name(),
    };
    m.add_class::<PyDefaults>()?;
    m.add("DEFAULTS", defaults)?;
    Ok(())
}
