//! The tensor table checked against a model's recipe: each tensor's type, shape and byte
//! range, which tensors a block reads, and which range owns which tensor.

use std::collections::HashMap;

use super::TensorInfo;
use crate::model::{ModelConfig, ModelError};
use crate::quant::{unsupported_type_message, GgmlType, QMatrix};

/// A validated tensor: its type, shape and byte range in the storage.
#[derive(Clone, Debug)]
pub(super) struct TensorEntry {
    /// Its index in the tensor table.
    pub(super) index: usize,
    pub(super) dtype: GgmlType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) start: usize,
    pub(super) len: usize,
    /// Start of the interleaved copy in `LlamaWeights::interleaved`, if the matrix has one.
    pub(super) interleaved: Option<usize>,
    /// Start of the copy in `LlamaWeights::vectors` (in floats), if it is an F32 vector.
    pub(super) vector: Option<usize>,
}

/// Byte ranges of the tensors of one transformer block.
#[derive(Clone, Debug)]
pub(super) struct LayerTensors {
    pub(super) attn_norm: TensorEntry,
    pub(super) wq: TensorEntry,
    pub(super) wk: TensorEntry,
    pub(super) wv: TensorEntry,
    pub(super) wo: TensorEntry,
    pub(super) ffn_norm: TensorEntry,
    pub(super) w_gate: TensorEntry,
    pub(super) w_up: TensorEntry,
    pub(super) w_down: TensorEntry,
    pub(super) bq: Option<TensorEntry>,
    pub(super) bk: Option<TensorEntry>,
    pub(super) bv: Option<TensorEntry>,
    pub(super) q_norm: Option<TensorEntry>,
    pub(super) k_norm: Option<TensorEntry>,
    pub(super) post_attn_norm: Option<TensorEntry>,
    pub(super) post_ffn_norm: Option<TensorEntry>,
}

impl LayerTensors {
    /// Every tensor the block's recipe reads.
    pub(super) fn entries_mut(&mut self) -> impl Iterator<Item = &mut TensorEntry> {
        [
            Some(&mut self.attn_norm),
            Some(&mut self.wq),
            Some(&mut self.wk),
            Some(&mut self.wv),
            Some(&mut self.wo),
            Some(&mut self.ffn_norm),
            Some(&mut self.w_gate),
            Some(&mut self.w_up),
            Some(&mut self.w_down),
            self.bq.as_mut(),
            self.bk.as_mut(),
            self.bv.as_mut(),
            self.q_norm.as_mut(),
            self.k_norm.as_mut(),
            self.post_attn_norm.as_mut(),
            self.post_ffn_norm.as_mut(),
        ]
        .into_iter()
        .flatten()
    }
}

/// The tensors `config` reads, looked up and shape-checked in the validated table: the token
/// embedding, the final norm, the untied head if any, and every block's tensors.
pub(super) type Resolved = (
    TensorEntry,
    TensorEntry,
    Option<TensorEntry>,
    Vec<LayerTensors>,
);

pub(super) fn resolve(
    config: &ModelConfig,
    by_name: &HashMap<&str, TensorEntry>,
) -> Result<Resolved, ModelError> {
    let c = config;
    let (hidden, kv, ffn) = (c.hidden, c.kv_dim(), c.ffn);
    let take = |name: &str, rows: usize, cols: usize| -> Result<TensorEntry, ModelError> {
        let e = by_name
            .get(name)
            .ok_or_else(|| ModelError::Weights(format!("missing tensor {name}")))?;
        if e.rows != rows || e.cols != cols {
            return Err(ModelError::Weights(format!(
                "tensor {name} is {}x{}, expected {rows}x{cols}",
                e.rows, e.cols
            )));
        }
        Ok(e.clone())
    };
    let vector = |name: &str, n: usize| -> Result<TensorEntry, ModelError> {
        let e = take(name, 1, n)?;
        if e.dtype != GgmlType::F32 {
            return Err(ModelError::Weights(format!(
                "{name} must be F32, is {:?}",
                e.dtype
            )));
        }
        Ok(e)
    };
    let optional_vector = |name: &str, n: usize| -> Result<Option<TensorEntry>, ModelError> {
        if by_name.contains_key(name) {
            vector(name, n).map(Some)
        } else {
            Ok(None)
        }
    };
    let token_embd = take("token_embd.weight", c.vocab, hidden)?;
    let output_norm = vector("output_norm.weight", hidden)?;
    let output = if by_name.contains_key("output.weight") {
        Some(take("output.weight", c.vocab, hidden)?)
    } else {
        None
    };
    let recipe = c.recipe();
    let q_dim = c.q_dim();
    // Norms only some recipes have: required by those, not read by the others.
    let required =
        |name: &str, n: usize, needed: bool| -> Result<Option<TensorEntry>, ModelError> {
            if needed {
                vector(name, n).map(Some)
            } else {
                Ok(None)
            }
        };
    // Biases: required by a recipe with them, optional elsewhere (some Llama files).
    let bias = |name: &str, n: usize| -> Result<Option<TensorEntry>, ModelError> {
        if recipe.qkv_bias {
            vector(name, n).map(Some)
        } else {
            optional_vector(name, n)
        }
    };
    let mut layers = Vec::with_capacity(c.n_layers);
    for i in 0..c.n_layers {
        let n = |t: &str| format!("blk.{i}.{t}");
        let hd = c.head_dim();
        layers.push(LayerTensors {
            attn_norm: vector(&n("attn_norm.weight"), hidden)?,
            wq: take(&n("attn_q.weight"), q_dim, hidden)?,
            wk: take(&n("attn_k.weight"), kv, hidden)?,
            wv: take(&n("attn_v.weight"), kv, hidden)?,
            wo: take(&n("attn_output.weight"), hidden, q_dim)?,
            ffn_norm: vector(&n("ffn_norm.weight"), hidden)?,
            w_gate: take(&n("ffn_gate.weight"), ffn, hidden)?,
            w_up: take(&n("ffn_up.weight"), ffn, hidden)?,
            w_down: take(&n("ffn_down.weight"), hidden, ffn)?,
            bq: bias(&n("attn_q.bias"), q_dim)?,
            bk: bias(&n("attn_k.bias"), kv)?,
            bv: bias(&n("attn_v.bias"), kv)?,
            q_norm: required(&n("attn_q_norm.weight"), hd, recipe.qk_norm)?,
            k_norm: required(&n("attn_k_norm.weight"), hd, recipe.qk_norm)?,
            post_attn_norm: required(&n("post_attention_norm.weight"), hidden, recipe.post_norms)?,
            post_ffn_norm: required(&n("post_ffw_norm.weight"), hidden, recipe.post_norms)?,
        });
    }
    Ok((token_embd, output_norm, output, layers))
}

/// Whether the range `[lo, hi)` of an `n`-layer model owns the tensor `name`, i.e. checks its
/// bytes against the recorded digest: `blk.i.*` belongs to the range holding layer `i`,
/// `output*` to the exit, anything else (the token embedding) to the entry. Every tensor has
/// exactly one owner in a mesh whose ranges tile the model.
pub(super) fn owned_by(name: &str, lo: usize, hi: usize, n: usize) -> bool {
    let block = name
        .strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(i, _)| i.parse::<usize>().ok());
    match block {
        Some(i) if i < n => lo <= i && i < hi,
        Some(_) => hi == n,
        None if name.starts_with("output") => hi == n,
        None => lo == 0,
    }
}

/// Whether a matrix has an interleaved layout worth making (a 32-element format, one whole
/// row group or more).
pub(super) fn interleavable(e: &TensorEntry) -> bool {
    QMatrix::interleavable(e.dtype) && e.rows >= 16
}

pub(super) fn validate_entry(info: &TensorInfo, total: usize) -> Result<TensorEntry, ModelError> {
    let bad = |what: String| ModelError::Weights(format!("tensor {}: {what}", info.name));
    let dtype = GgmlType::from_id(info.ggml_type).map_err(|_| {
        ModelError::Weights(unsupported_type_message(info.ggml_type, Some(&info.name)))
    })?;
    let (cols, rows) = match info.dims.as_slice() {
        [n] => (*n as usize, 1usize),
        [c, r] => (*c as usize, *r as usize),
        other => return Err(bad(format!("unsupported rank {}", other.len()))),
    };
    if cols == 0 || rows == 0 || cols % dtype.block_size() != 0 {
        return Err(bad(format!(
            "{cols} columns do not fit {:?} blocks of {}",
            dtype,
            dtype.block_size()
        )));
    }
    let len = rows
        .checked_mul(cols / dtype.block_size())
        .and_then(|blocks| blocks.checked_mul(dtype.block_bytes()))
        .ok_or_else(|| bad("size overflows".into()))?;
    let start = usize::try_from(info.offset).map_err(|_| bad("offset overflows".into()))?;
    if start.checked_add(len).is_none_or(|end| end > total) {
        return Err(bad(format!(
            "bytes {start}..{} lie outside the {total}-byte file",
            start + len
        )));
    }
    if dtype == GgmlType::F32 && start % 4 != 0 {
        return Err(bad(format!(
            "F32 data at offset {start} is not 4-byte aligned"
        )));
    }
    Ok(TensorEntry {
        index: 0,
        dtype,
        rows,
        cols,
        start,
        len,
        interleaved: None,
        vector: None,
    })
}
