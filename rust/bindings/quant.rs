//! Python surface of `quant`: thin numpy wrappers for reference tests against ggml's own
//! numpy dequantizer and numpy matmuls.

use numpy::ndarray::Array2;
use numpy::{
    IntoPyArray, PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use super::exceptions::InputError;
use crate::quant::{self, GgmlType, Kernel, QMatrix, QuantError, QuantScratch, QuantizedInput};

/// A dimension argument as `usize`, or a `ValueError` naming it.
fn dim(name: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value)
        .map_err(|_| InputError::new_err(format!("{name} must be non-negative, got {value}")))
}

/// Validates `(qtype, data, rows, cols)` into a matrix view of the array's bytes.
fn matrix<'a>(
    qtype: i64,
    data: &'a PyReadonlyArrayDyn<'_, u8>,
    rows: usize,
    cols: usize,
) -> PyResult<QMatrix<'a>> {
    let id = u32::try_from(qtype).map_err(|_| {
        InputError::new_err(format!(
            "unknown ggml type id {qtype} (supported: {})",
            quant::SUPPORTED_TYPES
        ))
    })?;
    let dtype = GgmlType::from_id(id).map_err(PyErr::from)?;
    // `as_slice` also accepts Fortran order, whose bytes are not in row order.
    let bytes = data
        .as_slice()
        .ok()
        .filter(|_| data.is_c_contiguous())
        .ok_or_else(|| InputError::new_err("data must be a C-contiguous uint8 array"))?;
    QMatrix::new(dtype, rows, cols, bytes).map_err(PyErr::from)
}

fn to_2d<'py>(
    py: Python<'py>,
    values: Vec<f32>,
    rows: usize,
    cols: usize,
) -> Bound<'py, PyArray2<f32>> {
    Array2::from_shape_vec((rows, cols), values)
        .expect("length is rows × cols by construction")
        .into_pyarray(py)
}

/// Dequantizes a `(rows, cols)` matrix of ggml type id `qtype` from its raw bytes.
#[pyfunction]
fn quant_dequantize<'py>(
    py: Python<'py>,
    qtype: i64,
    data: PyReadonlyArrayDyn<'py, u8>,
    rows: i64,
    cols: i64,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let (rows, cols) = (dim("rows", rows)?, dim("cols", cols)?);
    let m = matrix(qtype, &data, rows, cols)?;
    let values = py.detach(|| m.dequantize());
    Ok(to_2d(py, values, rows, cols))
}

/// `x (n, cols) @ W.T` for a `(rows, cols)` matrix of ggml type id `qtype` → `(n, rows)`;
/// `refined` uses the two-level activation quantization (16-bit codes, or a residual pass for
/// the k-quants).
#[pyfunction]
#[pyo3(signature = (qtype, data, rows, cols, x, kernel = None, refined = false))]
#[allow(clippy::too_many_arguments)]
fn quant_matmul<'py>(
    py: Python<'py>,
    qtype: i64,
    data: PyReadonlyArrayDyn<'py, u8>,
    rows: i64,
    cols: i64,
    x: PyReadonlyArray2<'py, f32>,
    kernel: Option<&str>,
    refined: bool,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let (rows, cols) = (dim("rows", rows)?, dim("cols", cols)?);
    let m = matrix(qtype, &data, rows, cols)?;
    let kernel = match kernel {
        None => Kernel::detect(),
        Some(name) => Kernel::from_name(name).ok_or_else(|| {
            let names: Vec<&str> = Kernel::ALL.iter().map(|k| k.name()).collect();
            InputError::new_err(format!("unknown kernel {name:?} (one of {names:?})"))
        })?,
    };
    let (n, x_cols) = x.as_array().dim();
    if x_cols != cols {
        return Err(PyErr::from(QuantError::ColsMismatch {
            weight_cols: cols,
            input_cols: x_cols,
        }));
    }
    let x = x
        .as_slice()
        .ok()
        .filter(|_| x.is_c_contiguous())
        .ok_or_else(|| InputError::new_err("x must be a C-contiguous float32 array"))?;
    let out = py.detach(|| -> Result<Vec<f32>, QuantError> {
        let mut scratch = QuantScratch::new();
        let mut out = vec![0.0f32; n * rows];
        if refined {
            let mut stacked = Vec::new();
            let input = QuantizedInput::quantize_refined(x, n, cols, &mut stacked, &mut scratch)?;
            let tokens = input.product_tokens(m.dtype());
            if tokens == n {
                quant::matmul_with_kernel(kernel, &m, &input, &mut out)?;
            } else {
                // A k-quant's residual rows, folded into the value rows.
                let mut full = vec![0.0f32; tokens * rows];
                quant::matmul_with_kernel(kernel, &m, &input, &mut full)?;
                quant::fold_refined(&full, &mut out);
            }
        } else {
            let input = QuantizedInput::quantize(x, n, cols, &mut scratch)?;
            quant::matmul_with_kernel(kernel, &m, &input, &mut out)?;
        }
        Ok(out)
    });
    Ok(to_2d(py, out.map_err(PyErr::from)?, n, rows))
}

/// Embedding lookup: rows `ids` of a `(rows, cols)` matrix, dequantized → `(len(ids), cols)`.
#[pyfunction]
fn quant_embed<'py>(
    py: Python<'py>,
    qtype: i64,
    data: PyReadonlyArrayDyn<'py, u8>,
    rows: i64,
    cols: i64,
    ids: PyReadonlyArray1<'py, u32>,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let (rows, cols) = (dim("rows", rows)?, dim("cols", cols)?);
    let m = matrix(qtype, &data, rows, cols)?;
    let ids = ids.as_array().to_vec();
    let mut out = vec![0.0f32; ids.len() * cols];
    m.embed(&ids, &mut out).map_err(PyErr::from)?;
    Ok(to_2d(py, out, ids.len(), cols))
}

/// Names of the matmul kernels this CPU can run, slowest first (the last is the default).
#[pyfunction]
fn quant_kernels() -> Vec<&'static str> {
    Kernel::available().into_iter().map(Kernel::name).collect()
}

/// The tensor types the kernels compute with, as `(ggml name, ggml type id)`, in id order.
#[pyfunction]
fn quant_types() -> Vec<(&'static str, u32)> {
    GgmlType::ALL.iter().map(|t| (t.name(), t.id())).collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_types, m)?)?;
    m.add_function(wrap_pyfunction!(quant_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant_embed, m)?)?;
    m.add_function(wrap_pyfunction!(quant_kernels, m)?)?;
    Ok(())
}
