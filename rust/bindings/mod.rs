//! Thin PyO3 layer: argument conversion, error mapping, GIL release. No logic lives here.
//! One file per core module; each exposes `register(m)`.

use pyo3::prelude::*;

mod engine;
mod model;
mod oracle;
mod quant;
mod ring;
mod volume;

/// The native module `amplituhedron_rs._core`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    volume::register(m)?;
    oracle::register(m)?;
    ring::register(m)?;
    model::register(m)?;
    engine::register(m)?;
    quant::register(m)?;
    Ok(())
}
