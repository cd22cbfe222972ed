//! amplituhedron-rs: a prefix-cached, pipeline-parallel LLM inference core.
//!
//! One module per concept; the PyO3 layer (`bindings`, feature `python`) is thin and
//! everything else is plain Rust, testable with `cargo test` alone.

pub mod attention;
pub mod engine;
pub mod eviction;
pub mod grammar;
pub mod keys;
pub mod memo;
pub mod mesh;
pub mod model;
pub mod oracle;
pub mod quant;
pub mod ring;
pub mod volume;

#[cfg(feature = "python")]
mod bindings;

#[cfg(test)]
mod ring_alloc_tests;
