//! Thin PyO3 layer: argument conversion, GIL release. No logic lives here. One file per
//! core module, each exposing `register(m)`; every core error becomes a Python exception in
//! `exceptions`, and the core's defaults are exposed once in `defaults`.

use pyo3::prelude::*;

mod defaults;
mod engine;
mod exceptions;
mod grammar;
mod mesh;
mod model;
mod oracle;
mod quant;
mod ring;
mod volume;
mod weights;

/// The native module `amplituhedron_rs._core`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    exceptions::register(m)?;
    defaults::register(m)?;
    volume::register(m)?;
    oracle::register(m)?;
    ring::register(m)?;
    weights::register(m)?;
    model::register(m)?;
    mesh::register(m)?;
    engine::register(m)?;
    grammar::register(m)?;
    quant::register(m)?;
    Ok(())
}
