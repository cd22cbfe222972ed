//! Model weights: the GGUF file memory-mapped once, tensors as typed views into it.
//!
//! Parsing GGUF metadata is left to ggml-org's own `gguf` Python package (the format's
//! reference reader, which also hands the tokenizer and chat template to Python); it gives
//! this module a tensor table (name, ggml type, dims, absolute byte offset). The file is
//! mapped read-only and every matrix is a borrowed [`QMatrix`], so the quantized weights are
//! what the kernels run on (no f32 copy of any matrix). The layers' matrices of the 32-element
//! formats are copied once, at load, into the interleaved layout (the same bytes grouped by
//! 16 rows, so the SIMD kernels skip per-call transposes; the products are bit-identical);
//! with AVX-512 so is the LM head, on first use. The mapping's pages of copied bytes are
//! dropped.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use memmap2::Mmap;

use super::{ModelConfig, ModelError, Precision};
use crate::quant::{unsupported_type_message, GgmlType, QMatrix};
use crate::ring::KvDtype;

/// One entry of the tensor table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// GGUF tensor name, e.g. `blk.3.attn_q.weight`.
    pub name: String,
    /// ggml type id (see `quant::SUPPORTED_TYPES`).
    pub ggml_type: u32,
    /// GGUF dims, fastest-varying first: `[cols, rows]` for a matrix, `[n]` for a vector.
    pub dims: Vec<u64>,
    /// Absolute byte offset of the tensor data in the storage.
    pub offset: u64,
}

/// Where the weight bytes live: a read-only file mapping, or memory (tests, synthetic models).
enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A validated tensor: its type, shape and byte range in the storage.
#[derive(Clone, Debug)]
struct TensorEntry {
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    start: usize,
    len: usize,
    /// Start of the interleaved copy in `LlamaWeights::interleaved`, if the matrix has one.
    interleaved: Option<usize>,
}

/// Byte ranges of the tensors of one transformer block.
#[derive(Clone, Debug)]
pub struct LayerTensors {
    attn_norm: TensorEntry,
    wq: TensorEntry,
    wk: TensorEntry,
    wv: TensorEntry,
    wo: TensorEntry,
    ffn_norm: TensorEntry,
    w_gate: TensorEntry,
    w_up: TensorEntry,
    w_down: TensorEntry,
    bq: Option<TensorEntry>,
    bk: Option<TensorEntry>,
    bv: Option<TensorEntry>,
    q_norm: Option<TensorEntry>,
    k_norm: Option<TensorEntry>,
    post_attn_norm: Option<TensorEntry>,
    post_ffn_norm: Option<TensorEntry>,
}

/// All weights of a decoder (any supported architecture) plus its content fingerprint.
pub struct LlamaWeights {
    config: ModelConfig,
    storage: Arc<Storage>,
    /// The matrices of 32-element formats re-laid out for the SIMD kernels
    /// ([`crate::quant::interleave_rows`]): 16 rows of a block load without transposes.
    interleaved: Vec<u8>,
    token_embd: TensorEntry,
    output_norm: TensorEntry,
    /// `None` when the LM head is tied to `token_embd` (SmolLM2).
    output: Option<TensorEntry>,
    /// Llama 3.1/3.2 RoPE frequency divisors (`rope_freqs.weight`, `head_dim / 2` of them).
    rope_freqs: Option<TensorEntry>,
    layers: Vec<LayerTensors>,
    /// The LM head's interleaved copy, made on first use ([`LlamaWeights::lm_head`]): a
    /// station whose range ends before the last layer never pays for it. `None` inside when
    /// the head stays in row layout.
    head_copy: OnceLock<Option<Vec<u8>>>,
    precision: Precision,
    kv_dtype: KvDtype,
    fingerprint: u64,
}

/// Borrowed views of one block's tensors, ready for the kernels.
pub struct LayerView<'a> {
    pub attn_norm: &'a [f32],
    pub wq: QMatrix<'a>,
    pub wk: QMatrix<'a>,
    pub wv: QMatrix<'a>,
    pub wo: QMatrix<'a>,
    pub ffn_norm: &'a [f32],
    pub w_gate: QMatrix<'a>,
    pub w_up: QMatrix<'a>,
    pub w_down: QMatrix<'a>,
    pub bq: Option<&'a [f32]>,
    pub bk: Option<&'a [f32]>,
    pub bv: Option<&'a [f32]>,
    /// Per-head RMSNorm of queries and keys (`head_dim` each), when the recipe has them.
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    /// RMSNorm of the attention / FFN output before the residual add, when the recipe has them.
    pub post_attn_norm: Option<&'a [f32]>,
    pub post_ffn_norm: Option<&'a [f32]>,
}

impl LlamaWeights {
    /// Maps `path` read-only and validates the tensor table against `config`.
    pub fn from_file(
        path: &Path,
        config: ModelConfig,
        table: &[TensorInfo],
        precision: Precision,
        kv_dtype: KvDtype,
    ) -> Result<Self, ModelError> {
        let file = File::open(path)
            .map_err(|e| ModelError::Io(format!("cannot open {}: {e}", path.display())))?;
        // SAFETY: the mapping is read-only and private to this process; a model file being
        // truncated underneath a running server is outside what any inference engine guards.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| ModelError::Io(format!("cannot map {}: {e}", path.display())))?;
        Self::from_storage(Storage::Mapped(map), config, table, precision, kv_dtype)
    }

    /// Builds weights from bytes in memory (synthetic models in tests, or a copied file).
    pub fn from_bytes(
        bytes: Vec<u8>,
        config: ModelConfig,
        table: &[TensorInfo],
        precision: Precision,
        kv_dtype: KvDtype,
    ) -> Result<Self, ModelError> {
        Self::from_storage(Storage::Owned(bytes), config, table, precision, kv_dtype)
    }

    fn from_storage(
        storage: Storage,
        config: ModelConfig,
        table: &[TensorInfo],
        precision: Precision,
        kv_dtype: KvDtype,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let total = storage.bytes().len();
        let mut by_name: HashMap<&str, TensorEntry> = HashMap::new();
        for info in table {
            let entry = validate_entry(info, total)?;
            if by_name.insert(info.name.as_str(), entry).is_some() {
                return Err(ModelError::Weights(format!(
                    "tensor {} listed twice",
                    info.name
                )));
            }
        }
        let c = &config;
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
        let rope_freqs = optional_vector("rope_freqs.weight", c.head_dim() / 2)?;
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
                post_attn_norm: required(
                    &n("post_attention_norm.weight"),
                    hidden,
                    recipe.post_norms,
                )?,
                post_ffn_norm: required(&n("post_ffw_norm.weight"), hidden, recipe.post_norms)?,
            });
        }
        let fingerprint = fingerprint(&config, precision, kv_dtype, table, storage.bytes());
        let interleaved = interleave_matrices(
            &storage,
            layers.iter_mut().flat_map(|l| {
                [
                    &mut l.wq,
                    &mut l.wk,
                    &mut l.wv,
                    &mut l.wo,
                    &mut l.w_gate,
                    &mut l.w_up,
                    &mut l.w_down,
                ]
            }),
        );
        let weights = LlamaWeights {
            config,
            storage: Arc::new(storage),
            interleaved,
            token_embd,
            output_norm,
            output,
            rope_freqs,
            layers,
            head_copy: OnceLock::new(),
            precision,
            kv_dtype,
            fingerprint,
        };
        // Construct every matrix view once so a malformed tensor fails here, not mid-forward.
        for i in 0..weights.config.n_layers {
            weights.layer(i)?;
        }
        weights.embedding()?;
        weights.matrix(weights.head_entry())?;
        if let Some(f) = weights.rope_factors() {
            if let Some(bad) = f.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
                return Err(ModelError::Weights(format!(
                    "rope_freqs.weight holds {bad}: RoPE frequency divisors must be positive"
                )));
            }
        }
        Ok(weights)
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// How activations are quantized for the integer kernels.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// How every session's rings store K and V.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// Content hash of the model (config, precision, KV storage, every tensor's name, type,
    /// shape and
    /// bytes):
    /// the `model_fingerprint` of every volume key, so new weights never hit old volumes.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    fn matrix(&self, e: &TensorEntry) -> Result<QMatrix<'_>, ModelError> {
        match e.interleaved {
            Some(at) => {
                let bytes = &self.interleaved[at..at + e.len];
                QMatrix::new_interleaved(e.dtype, e.rows, e.cols, bytes)
            }
            None => {
                let bytes = &self.storage.bytes()[e.start..e.start + e.len];
                QMatrix::new(e.dtype, e.rows, e.cols, bytes)
            }
        }
        .map_err(|err| ModelError::Weights(err.to_string()))
    }

    fn f32_slice(&self, e: &TensorEntry) -> &[f32] {
        let bytes = &self.storage.bytes()[e.start..e.start + e.len];
        // GGUF aligns tensor data (32 bytes by default), so F32 data is 4-byte aligned.
        // SAFETY: `validate_entry` checked the range, the F32 type and 4-byte alignment of
        // the offset relative to an allocation that is page aligned (mmap) or from a Vec<u8>
        // checked below; every bit pattern is a valid f32.
        let (head, floats, tail) = unsafe { bytes.align_to::<f32>() };
        assert!(
            head.is_empty() && tail.is_empty(),
            "F32 tensor data is not 4-byte aligned"
        );
        floats
    }

    /// The token embedding table (`vocab × hidden`).
    pub fn embedding(&self) -> Result<QMatrix<'_>, ModelError> {
        self.matrix(&self.token_embd)
    }

    /// The LM head: `output.weight`, or the tied `token_embd`.
    ///
    /// It only ever multiplies a few rows (the last of a prompt, a decode row, a verify
    /// step's k + 1), but it is the largest matrix (Gemma 3: 262,144×640, 178 MB). Whether it
    /// streams faster interleaved depends on the row group: with 8-lane AVX2 it ran ~10 %
    /// slower interleaved (Gemma 3 decode, a Zen 3 host), while with 16-lane AVX-512 the row
    /// layout costs a 16-row gather per block (`vinserti32x4`, with spills) and interleaved
    /// ran ~10 % faster (a Zen 5 host). So with AVX-512 the first call copies it interleaved
    /// (the exit range calls it when it is built); a tied embedding keeps gathering its rows
    /// from the file.
    pub fn lm_head(&self) -> Result<QMatrix<'_>, ModelError> {
        let e = self.head_entry();
        match self.head_copy.get_or_init(|| self.interleaved_head(e)) {
            Some(bytes) => QMatrix::new_interleaved(e.dtype, e.rows, e.cols, bytes)
                .map_err(|err| ModelError::Weights(err.to_string())),
            None => self.matrix(e),
        }
    }

    /// Whether the head's interleaved copy exists.
    #[cfg(test)]
    pub(crate) fn head_is_copied(&self) -> bool {
        matches!(self.head_copy.get(), Some(Some(_)))
    }

    fn head_entry(&self) -> &TensorEntry {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// The head's interleaved copy, if this kernel gains from one (see [`Self::lm_head`]).
    fn interleaved_head(&self, e: &TensorEntry) -> Option<Vec<u8>> {
        let sixteen_lanes = crate::quant::Kernel::detect().lanes() == 16;
        if !sixteen_lanes || !interleavable(e) {
            return None;
        }
        let mut out = vec![0u8; e.len];
        interleave_entry(&self.storage, e, &mut out);
        Some(out)
    }

    /// The per-pair divisors of the RoPE frequencies (`rope_freqs.weight`, which llama.cpp's
    /// converter writes for Llama 3.1/3.2's `llama3` frequency scaling), if the file has them.
    pub fn rope_factors(&self) -> Option<&[f32]> {
        self.rope_freqs.as_ref().map(|e| self.f32_slice(e))
    }

    /// The final RMSNorm weight.
    pub fn output_norm(&self) -> &[f32] {
        self.f32_slice(&self.output_norm)
    }

    /// Borrowed views of block `i`.
    pub fn layer(&self, i: usize) -> Result<LayerView<'_>, ModelError> {
        let l = self
            .layers
            .get(i)
            .ok_or_else(|| ModelError::Weights(format!("no layer {i}")))?;
        let opt = |e: &Option<TensorEntry>| e.as_ref().map(|e| self.f32_slice(e));
        Ok(LayerView {
            attn_norm: self.f32_slice(&l.attn_norm),
            wq: self.matrix(&l.wq)?,
            wk: self.matrix(&l.wk)?,
            wv: self.matrix(&l.wv)?,
            wo: self.matrix(&l.wo)?,
            ffn_norm: self.f32_slice(&l.ffn_norm),
            w_gate: self.matrix(&l.w_gate)?,
            w_up: self.matrix(&l.w_up)?,
            w_down: self.matrix(&l.w_down)?,
            bq: opt(&l.bq),
            bk: opt(&l.bk),
            bv: opt(&l.bv),
            q_norm: opt(&l.q_norm),
            k_norm: opt(&l.k_norm),
            post_attn_norm: opt(&l.post_attn_norm),
            post_ffn_norm: opt(&l.post_ffn_norm),
        })
    }
}

/// Whether a matrix has an interleaved layout worth making (a 32-element format, one whole
/// row group or more).
fn interleavable(e: &TensorEntry) -> bool {
    QMatrix::interleavable(e.dtype) && e.rows >= 16
}

/// Writes `e`'s bytes from `storage` into `out` in the interleaved layout, then drops the
/// mapping's pages under them ([`release_pages`]).
fn interleave_entry(storage: &Storage, e: &TensorEntry, out: &mut [u8]) {
    let bytes = &storage.bytes()[e.start..e.start + e.len];
    let ok = crate::quant::interleave_rows_into(e.dtype, e.rows, e.cols, bytes, out);
    assert!(ok, "a validated matrix of an interleavable type");
    release_pages(storage, e);
}

/// Copies every matrix of a 32-element format (16 rows or more) into one buffer in the
/// interleaved layout, recording where in `TensorEntry::interleaved`. Only where a SIMD kernel
/// runs: the scalar kernel would have to undo the layout row by row.
fn interleave_matrices<'e>(
    storage: &Storage,
    entries: impl Iterator<Item = &'e mut TensorEntry>,
) -> Vec<u8> {
    let mut chosen: Vec<&mut TensorEntry> = entries.filter(|e| interleavable(e)).collect();
    if chosen.is_empty() || crate::quant::Kernel::detect() == crate::quant::Kernel::Scalar {
        return Vec::new();
    }
    let mut total = 0;
    for e in &mut chosen {
        e.interleaved = Some(total);
        total += e.len;
    }
    let mut out = vec![0u8; total];
    for e in chosen {
        let to = e.interleaved.expect("set above");
        interleave_entry(storage, e, &mut out[to..to + e.len]);
    }
    out
}

/// Drops this process's pages of the file mapping under `e`, a matrix the kernels now read
/// from an interleaved copy: keeping them mapped would count its bytes twice in the resident
/// set. The pages stay in the page cache; a later read (an embedding row of a tied head, a
/// norm sharing a page) faults its page back in from the file.
fn release_pages(storage: &Storage, e: &TensorEntry) {
    let Storage::Mapped(map) = storage else {
        return;
    };
    // SAFETY: the mapping is private and read-only, so `MADV_DONTNEED` only drops our view of
    // clean file pages; nothing borrowed from it changes (a later read faults the same bytes
    // back in).
    #[cfg(unix)]
    let _ =
        unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, e.start, e.len) };
    #[cfg(not(unix))]
    let _ = (map, e);
}

fn validate_entry(info: &TensorInfo, total: usize) -> Result<TensorEntry, ModelError> {
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
        dtype,
        rows,
        cols,
        start,
        len,
        interleaved: None,
    })
}

/// BLAKE3 over the canonical config and every tensor (sorted by name), truncated to u64.
fn fingerprint(
    config: &ModelConfig,
    precision: Precision,
    kv_dtype: KvDtype,
    table: &[TensorInfo],
    bytes: &[u8],
) -> u64 {
    let mut sorted: Vec<&TensorInfo> = table.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut h = blake3::Hasher::new();
    h.update(b"amplituhedron-rs model fingerprint v1\0");
    h.update(config.canonical().as_bytes());
    // The precision changes every KV value, so volumes of one must never serve the other.
    h.update(precision.name().as_bytes());
    // And so does any change of a precision's canonical arithmetic: volumes a build with
    // other kernels saved to a cache directory must miss. (2: refined 32-element blocks use
    // 16-bit activation codes.)
    h.update(b"\0arithmetic=2");
    // So does the KV storage type (through every later position's attention).
    h.update(b"\0kv=");
    h.update(kv_dtype.name().as_bytes());
    for t in sorted {
        h.update(t.name.as_bytes());
        h.update(&[0]);
        h.update(&t.ggml_type.to_le_bytes());
        for d in &t.dims {
            h.update(&d.to_le_bytes());
        }
        // Validated in `validate_entry` before the fingerprint is taken.
        let e = validate_entry(t, bytes.len()).expect("validated tensor");
        h.update_rayon(&bytes[e.start..e.start + e.len]);
    }
    crate::keys::digest_prefix_u64(h.finalize().as_bytes())
}

#[cfg(test)]
mod tests;
