//! Python surface of the oracle kernel: plain `oracle_*` functions, one per Lean quantity.
//! Semantic errors (`OracleError`) become `InputError` (a `ValueError`) with the kernel's
//! message.

use std::collections::BTreeMap;

use pyo3::prelude::*;

use crate::oracle::{self, HomogeneousPoint, LeanCacheKey, Mat2x4, Point, Rational};

fn pair(q: Rational) -> (i128, i128) {
    q.to_pair()
}

/// Points go to Python as tuples (immutable, like the Lean triples).
fn triple<T: Copy>(p: [T; 3]) -> (T, T, T) {
    (p[0], p[1], p[2])
}

/// Plücker coordinates [p12, p13, p14, p23, p24, p34] of a 2×4 integer matrix.
#[pyfunction]
fn oracle_plucker_coordinates(m: Mat2x4) -> [i128; 6] {
    oracle::plucker_coordinates(&m)
}

/// True iff every Plücker coordinate is > 0 (Gr_{>0}(2,4)).
#[pyfunction]
fn oracle_totally_positive(m: Mat2x4) -> bool {
    oracle::totally_positive(&m)
}

/// True iff every Plücker coordinate is ≥ 0 (Gr_{≥0}(2,4)).
#[pyfunction]
fn oracle_totally_nonnegative(m: Mat2x4) -> bool {
    oracle::totally_nonnegative(&m)
}

/// Number of vanishing Plücker coordinates.
#[pyfunction]
fn oracle_zero_minor_count(m: Mat2x4) -> usize {
    oracle::zero_minor_count(&m)
}

/// (totally positive, totally nonnegative, number of zero minors).
#[pyfunction]
fn oracle_boundary_profile(m: Mat2x4) -> (bool, bool, usize) {
    let p = oracle::boundary_profile(&m);
    (p.totally_positive, p.totally_nonnegative, p.zero_minors)
}

/// p13·p24 − p12·p34 − p14·p23 (0 on every 2×4 matrix).
#[pyfunction]
fn oracle_plucker_residual(m: Mat2x4) -> PyResult<i128> {
    oracle::plucker_residual(&m).map_err(PyErr::from)
}

/// The 3×3 bracket ⟨a b c⟩ = det[a; b; c].
#[pyfunction]
fn oracle_bracket(a: HomogeneousPoint, b: HomogeneousPoint, c: HomogeneousPoint) -> PyResult<i128> {
    oracle::bracket(&a, &b, &c).map_err(PyErr::from)
}

/// Moment-curve points (1, t, t²), one per node.
#[pyfunction]
fn oracle_moment_curve(nodes: Vec<i64>) -> PyResult<Vec<(i64, i64, i64)>> {
    let points = oracle::moment_curve(&nodes).map_err(PyErr::from)?;
    Ok(points.into_iter().map(triple).collect())
}

/// Maximal minors ⟨i j k⟩ (i < j < k, lexicographic) of the n×3 matrix Z.
#[pyfunction]
fn oracle_maximal_minors(py: Python<'_>, z: Vec<Point>) -> PyResult<Vec<i128>> {
    py.detach(|| oracle::maximal_minors(&z))
        .map_err(PyErr::from)
}

/// Vertex count of the convex hull of the rows of Z in P² (general position, Z_i^0 > 0).
#[pyfunction]
fn oracle_vertex_count(py: Python<'_>, z: Vec<Point>) -> PyResult<usize> {
    py.detach(|| oracle::vertex_count(&z)).map_err(PyErr::from)
}

/// Y = C·Z.
#[pyfunction]
fn oracle_y_of(c: Vec<i64>, z: Vec<Point>) -> PyResult<(i128, i128, i128)> {
    oracle::y_of(&c, &z).map(triple).map_err(PyErr::from)
}

/// Canonical-form amplitude ω at Y, affine chart Y_0 = 1, as a reduced (num, den).
#[pyfunction]
fn oracle_canonical_form(
    py: Python<'_>,
    z: Vec<Point>,
    y: HomogeneousPoint,
) -> PyResult<(i128, i128)> {
    py.detach(|| oracle::canonical_form(&z, &y))
        .map(pair)
        .map_err(PyErr::from)
}

/// ω at Y via the fan triangulation from row `vertex` (0-based), as a reduced (num, den).
#[pyfunction]
fn oracle_fan_form(
    py: Python<'_>,
    z: Vec<Point>,
    vertex: usize,
    y: HomogeneousPoint,
) -> PyResult<(i128, i128)> {
    py.detach(|| oracle::fan_form(&z, vertex, &y))
        .map(pair)
        .map_err(PyErr::from)
}

/// True iff a prefix of `prefix_len` tokens admits a volume (≥ the swerve).
#[pyfunction]
fn oracle_admits_volume(prefix_len: u64) -> bool {
    oracle::admits_volume(prefix_len)
}

/// Fibonacci F(n) as u64, or None when it overflows (first at n = 94).
#[pyfunction]
fn oracle_fib(n: u64) -> Option<u64> {
    oracle::fib(n)
}

/// Fibonacci F(n) as u128, or None when it overflows (first at n = 187).
#[pyfunction]
fn oracle_fib_u128(n: u64) -> Option<u128> {
    oracle::fib_u128(n)
}

/// Execution volume of an n-step prefix (= F(n)), or None on u64 overflow.
#[pyfunction]
fn oracle_execution_volume(n: u64) -> Option<u64> {
    oracle::execution_volume(n)
}

/// Volume after one defect: volume − 1, saturating at 0.
#[pyfunction]
fn oracle_topological_erasure(volume: u64) -> u64 {
    oracle::topological_erasure(volume)
}

/// The list without its last element (empty stays empty).
#[pyfunction]
fn oracle_trim_trailing(xs: Vec<u64>) -> Vec<u64> {
    oracle::trim_trailing(&xs).to_vec()
}

/// Volume of a compiled prefix: prompt_len × num_layers (ValueError on u64 overflow).
#[pyfunction]
fn oracle_grassmannian_volume(prompt_len: u64, num_layers: u64) -> PyResult<u64> {
    oracle::compile_cfg_to_grassmannian(prompt_len, num_layers)
        .volume()
        .map_err(PyErr::from)
}

/// True iff prompt_len ≥ 1 and num_layers ≥ 1.
#[pyfunction]
fn oracle_well_formed_prefix(prompt_len: u64, num_layers: u64) -> bool {
    oracle::well_formed_prefix(prompt_len, num_layers)
}

/// (tag of a memo key, tag of a volume key): the crate's MEMO_TAG and VOLUME_TAG.
#[pyfunction]
fn oracle_key_tags() -> (u8, u8) {
    let memo = LeanCacheKey::Memo { input_hash: 0 };
    let volume = LeanCacheKey::Volume {
        model_fingerprint: 0,
        prefix_hash: 0,
        layer_lo: 0,
        layer_hi: 0,
    };
    (memo.tag(), volume.tag())
}

/// Serialised memo key: [tag, input_hash].
#[pyfunction]
fn oracle_encode_memo_key(input_hash: u64) -> Vec<u64> {
    LeanCacheKey::Memo { input_hash }.encode()
}

/// Serialised volume key: [tag, model_fingerprint, prefix_hash, layer_lo, layer_hi].
#[pyfunction]
fn oracle_encode_volume_key(
    model_fingerprint: u64,
    prefix_hash: u64,
    layer_lo: u16,
    layer_hi: u16,
) -> Vec<u64> {
    LeanCacheKey::Volume {
        model_fingerprint,
        prefix_hash,
        layer_lo,
        layer_hi,
    }
    .encode()
}

mod lean {
    // `LEAN_MODULES`, generated by build.rs from lean/**/*.lean.
    include!(concat!(env!("OUT_DIR"), "/lean_modules.rs"));
}

/// The Lean oracle modules built into the extension: `{path relative to lean/: text}`.
#[pyfunction]
fn lean_modules() -> BTreeMap<&'static str, &'static str> {
    lean::LEAN_MODULES.iter().copied().collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ORACLE_CLINAMEN_SWERVE", oracle::CLINAMEN_SWERVE)?;
    m.add_function(wrap_pyfunction!(lean_modules, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_plucker_coordinates, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_totally_positive, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_totally_nonnegative, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_zero_minor_count, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_boundary_profile, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_plucker_residual, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_bracket, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_moment_curve, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_maximal_minors, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_vertex_count, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_y_of, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_canonical_form, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_fan_form, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_admits_volume, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_fib, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_fib_u128, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_execution_volume, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_topological_erasure, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_trim_trailing, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_grassmannian_volume, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_well_formed_prefix, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_key_tags, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_encode_memo_key, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_encode_volume_key, m)?)?;
    Ok(())
}
