//! Thin PyO3 layer: argument conversion, error mapping, GIL release. No logic lives here.

use pyo3::prelude::*;

/// The native module `amplituhedron_rs._core`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
