//! Model weights: the GGUF file memory-mapped once, tensors as typed views into it.
//!
//! Parsing GGUF metadata is left to ggml-org's own `gguf` Python package (the format's
//! reference reader, which also hands the tokenizer and chat template to Python); it gives
//! this module a tensor table (name, ggml type, dims, absolute byte offset). The file is
//! mapped read-only and every matrix is a borrowed [`QMatrix`], so the quantized weights are
//! what the kernels run on (no f32 copy of any matrix). The layers' matrices of the 32-element
//! formats are copied once, at load, into the interleaved layout (the same bytes grouped by
//! 16 rows, so the SIMD kernels skip per-call transposes; the products are bit-identical);
//! with AVX-512 so is the LM head, on first use. Copied tensors are read from the file with
//! `pread`, never through the mapping, so their bytes are resident once (in the copy).
//!
//! A station holds only its layer range ([`LoadOptions::layers`]): it validates the whole
//! table (cheap: no byte of a tensor is read), but copies or touches only its own layers'
//! tensors, plus the token embedding at the entry and the final norm and LM head at the exit,
//! so K stations together hold about one model, not K. Before anything is loaded, a range
//! that does not fit in `MemAvailable` is refused. The fingerprint still covers the whole
//! model ([`digest`]).

mod digest;
mod memory;
mod table;

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use memmap2::Mmap;
use rayon::prelude::*;

pub use digest::{tensor_digests, Digest};
pub use memory::WeightsMemory;
use table::{interleavable, owned_by, resolve, validate_entry, LayerTensors, TensorEntry};

use super::{ModelConfig, ModelError, Precision};
use crate::quant::{GgmlType, QMatrix};
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

/// What part of a model file to materialise, and what is already known about the rest.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Layers `[lo, hi)` to hold (`None`: all). The entry range (`lo = 0`) also holds the
    /// token embedding, the exit range (`hi = n_layers`) the final norm and the LM head.
    pub layers: Option<(usize, usize)>,
    /// The digest of every tensor, in table order ([`tensor_digests`], made once for the
    /// file): the weights then hash only the tensors their range owns, and refuse to load if
    /// one differs. Without them, every other tensor is read (not mapped) to be hashed.
    pub digests: Option<Vec<Digest>>,
}

/// Where the weight bytes live: a read-only file mapping, or memory (tests, synthetic models).
enum Storage {
    Mapped { map: Mmap, file: File },
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped { map, .. } => map,
            Storage::Owned(v) => v,
        }
    }

    fn slice(&self, e: &TensorEntry) -> &[u8] {
        &self.bytes()[e.start..e.start + e.len]
    }

    /// `e`'s digest without touching the mapping (read with `pread` from the file).
    fn digest_read(&self, e: &TensorEntry) -> Result<Digest, ModelError> {
        match self {
            Storage::Mapped { file, .. } => digest::digest_read(file, e.start, e.len)
                .map_err(|err| ModelError::Io(format!("cannot read the model file: {err}"))),
            Storage::Owned(_) => Ok(digest::digest_bytes(self.slice(e))),
        }
    }

    /// `e`'s bytes without touching the mapping: read with `pread` into `buf` (a tensor that
    /// is copied never enters this process's resident set through the mapping; a page
    /// touched there would stay, with up to 15 neighbours the kernel maps around it).
    fn read<'a>(&'a self, e: &TensorEntry, buf: &'a mut Vec<u8>) -> Result<&'a [u8], ModelError> {
        match self {
            Storage::Mapped { file, .. } => {
                buf.resize(e.len, 0);
                digest::read_exact_at(file, buf, e.start as u64)
                    .map_err(|err| ModelError::Io(format!("cannot read the model file: {err}")))?;
                Ok(buf)
            }
            Storage::Owned(_) => Ok(self.slice(e)),
        }
    }
}

/// How a range holds one tensor of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    /// Not at all: another range's (or unused). Never touched.
    Not,
    /// Copied into the interleaved layout (at this offset of the copy); the mapping's pages
    /// are dropped.
    Copied(usize),
    /// An F32 vector (a norm, a bias, the RoPE divisors) copied as floats (at this offset of
    /// the vectors). Read in place, each would keep whole page-cache folios of its
    /// neighbours mapped (up to MiBs each for a freshly written file), for a few KiB.
    Vector(usize),
    /// Read in place from the mapping, touched at load so it is resident before the first
    /// request (matrices without an interleaved layout, the LM head).
    InPlace,
    /// The token embedding at the entry: rows are gathered per token, so its pages fault in
    /// as tokens arrive instead of all at load.
    Gathered,
}

/// All weights of a decoder (any supported architecture) plus its content fingerprint.
pub struct LlamaWeights {
    config: ModelConfig,
    storage: Arc<Storage>,
    /// The held matrices of 32-element formats re-laid out for the SIMD kernels
    /// ([`crate::quant::interleave_rows`]): 16 rows of a block load without transposes.
    interleaved: Vec<u8>,
    /// The held F32 vectors (norms, biases, RoPE divisors), copied.
    vectors: Vec<f32>,
    token_embd: TensorEntry,
    output_norm: TensorEntry,
    /// `None` when the LM head is tied to `token_embd` (SmolLM2).
    output: Option<TensorEntry>,
    /// Llama 3.1/3.2 RoPE frequency divisors (`rope_freqs.weight`, `head_dim / 2` of them).
    rope_freqs: Option<TensorEntry>,
    layers: Vec<LayerTensors>,
    /// The layers held: `[layer_lo, layer_hi)` (all of them in one process).
    layer_lo: usize,
    layer_hi: usize,
    /// Bytes of the tensors held (what the memory check counted).
    held: usize,
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
    /// Maps `path` read-only, validates the tensor table against `config`, and materialises
    /// every layer (one process running the whole model).
    pub fn from_file(
        path: &Path,
        config: ModelConfig,
        table: &[TensorInfo],
        precision: Precision,
        kv_dtype: KvDtype,
    ) -> Result<Self, ModelError> {
        Self::from_file_with(
            path,
            config,
            table,
            precision,
            kv_dtype,
            LoadOptions::default(),
        )
    }

    /// As [`Self::from_file`], materialising only what `options` asks for (a station's
    /// layer range): the rest of the file is validated, never touched.
    pub fn from_file_with(
        path: &Path,
        config: ModelConfig,
        table: &[TensorInfo],
        precision: Precision,
        kv_dtype: KvDtype,
        options: LoadOptions,
    ) -> Result<Self, ModelError> {
        let file = File::open(path)
            .map_err(|e| ModelError::Io(format!("cannot open {}: {e}", path.display())))?;
        // SAFETY: the mapping is read-only and private to this process; a model file being
        // truncated underneath a running server is outside what any inference engine guards.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| ModelError::Io(format!("cannot map {}: {e}", path.display())))?;
        let storage = Storage::Mapped { map, file };
        Self::from_storage(storage, config, table, precision, kv_dtype, options)
    }

    /// Builds weights from bytes in memory (synthetic models in tests, or a copied file).
    pub fn from_bytes(
        bytes: Vec<u8>,
        config: ModelConfig,
        table: &[TensorInfo],
        precision: Precision,
        kv_dtype: KvDtype,
    ) -> Result<Self, ModelError> {
        Self::from_bytes_with(
            bytes,
            config,
            table,
            precision,
            kv_dtype,
            LoadOptions::default(),
        )
    }

    /// As [`Self::from_bytes`], holding only what `options` asks for.
    pub fn from_bytes_with(
        bytes: Vec<u8>,
        config: ModelConfig,
        table: &[TensorInfo],
        precision: Precision,
        kv_dtype: KvDtype,
        options: LoadOptions,
    ) -> Result<Self, ModelError> {
        let storage = Storage::Owned(bytes);
        Self::from_storage(storage, config, table, precision, kv_dtype, options)
    }

    fn from_storage(
        storage: Storage,
        config: ModelConfig,
        table: &[TensorInfo],
        precision: Precision,
        kv_dtype: KvDtype,
        options: LoadOptions,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let n_layers = config.n_layers;
        let (lo, hi) = options.layers.unwrap_or((0, n_layers));
        if lo >= hi || hi > n_layers {
            return Err(ModelError::Input(format!(
                "layer range {lo}..{hi} is not a non-empty part of 0..{n_layers}"
            )));
        }
        if let Some(d) = &options.digests {
            if d.len() != table.len() {
                return Err(ModelError::Input(format!(
                    "{} digests for a table of {} tensors",
                    d.len(),
                    table.len()
                )));
            }
        }
        let total = storage.bytes().len();
        let mut by_name: HashMap<&str, TensorEntry> = HashMap::new();
        for (index, info) in table.iter().enumerate() {
            let entry = TensorEntry {
                index,
                ..validate_entry(info, total)?
            };
            if by_name.insert(info.name.as_str(), entry).is_some() {
                return Err(ModelError::Weights(format!(
                    "tensor {} listed twice",
                    info.name
                )));
            }
        }
        let (token_embd, mut output_norm, output, mut layers) = resolve(&config, &by_name)?;
        let mut rope_freqs = match by_name.get("rope_freqs.weight") {
            None => None,
            Some(e) => {
                let n = config.head_dim() / 2;
                if e.rows != 1 || e.cols != n {
                    return Err(ModelError::Weights(format!(
                        "tensor rope_freqs.weight is {}x{}, expected 1x{n}",
                        e.rows, e.cols
                    )));
                }
                if e.dtype != GgmlType::F32 {
                    return Err(ModelError::Weights(format!(
                        "rope_freqs.weight must be F32, is {:?}",
                        e.dtype
                    )));
                }
                Some(e.clone())
            }
        };

        // What this range holds, and how (see `Hold`).
        let simd = crate::quant::Kernel::detect() != crate::quant::Kernel::Scalar;
        let mut holds = vec![Hold::Not; table.len()];
        let mut copied_bytes = 0;
        let mut vector_floats = 0;
        let mut copy_vector = |e: &mut TensorEntry| {
            e.vector = Some(vector_floats);
            vector_floats += e.len / 4;
            Hold::Vector(vector_floats - e.len / 4)
        };
        for l in &mut layers[lo..hi] {
            for e in l.entries_mut() {
                holds[e.index] = if simd && interleavable(e) {
                    e.interleaved = Some(copied_bytes);
                    copied_bytes += e.len;
                    Hold::Copied(copied_bytes - e.len)
                } else if is_vector(e) {
                    copy_vector(e)
                } else {
                    Hold::InPlace
                };
            }
        }
        if lo == 0 {
            holds[token_embd.index] = Hold::Gathered;
        }
        // Every layer rotates with the RoPE divisors: every range holds them.
        if let Some(f) = &mut rope_freqs {
            holds[f.index] = copy_vector(f);
        }
        if hi == n_layers {
            holds[output_norm.index] = copy_vector(&mut output_norm);
            let head = output.as_ref().unwrap_or(&token_embd);
            // A head that `lm_head` will copy is read then, not touched now.
            holds[head.index] = if head_is_copied(head) {
                Hold::Gathered
            } else {
                Hold::InPlace
            };
        }
        let entries: Vec<&TensorEntry> = table.iter().map(|t| &by_name[t.name.as_str()]).collect();
        let held: usize = entries
            .iter()
            .filter(|e| holds[e.index] != Hold::Not)
            .map(|e| e.len)
            .sum();
        if let Storage::Mapped { .. } = storage {
            memory::check_fits(held, lo, hi, n_layers)?;
        }

        // Digests: the tensors this range owns are hashed here (and checked against the
        // given digests); the others' come from the given digests, or are read with `pread`.
        let owns: Vec<bool> = table
            .iter()
            .map(|t| owned_by(&t.name, lo, hi, n_layers))
            .collect();
        let known = options.digests.as_deref();
        let mut digests: Vec<Option<Digest>> = (0..table.len())
            .map(|i| known.filter(|_| !owns[i]).map(|d| d[i]))
            .collect();
        let unknown: Vec<usize> = (0..table.len())
            .filter(|&i| digests[i].is_none() && !owns[i])
            .collect();
        let read: Vec<(usize, Digest)> = unknown
            .par_iter()
            .map(|&i| storage.digest_read(entries[i]).map(|d| (i, d)))
            .collect::<Result<_, _>>()?;
        for (i, d) in read {
            digests[i] = Some(d);
        }
        let mut interleaved = vec![0u8; copied_bytes];
        // Before the copy's first write: its pages are faulted in huge.
        super::advise_huge_pages(&mut interleaved);
        let mut vectors = vec![0f32; vector_floats];
        let mut scratch = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let own = owns[i];
            let digest = match holds[i] {
                Hold::Copied(at) => {
                    let bytes = storage.read(e, &mut scratch)?;
                    interleave(e, bytes, &mut interleaved[at..at + e.len]);
                    own.then(|| digest::digest_bytes(bytes))
                }
                Hold::Vector(at) => {
                    let bytes = storage.read(e, &mut scratch)?;
                    let floats = bytes.chunks_exact(4);
                    for (dst, src) in vectors[at..at + e.len / 4].iter_mut().zip(floats) {
                        *dst = f32::from_le_bytes(src.try_into().expect("4 bytes"));
                    }
                    own.then(|| digest::digest_bytes(bytes))
                }
                Hold::InPlace if own => Some(digest::digest_bytes(storage.slice(e))),
                Hold::InPlace => {
                    memory::touch(storage.slice(e));
                    None
                }
                // Gathered rows fault in as tokens arrive (and a copied head is read when
                // it is copied): hashing must not fault them all in.
                Hold::Gathered | Hold::Not if own => Some(storage.digest_read(e)?),
                Hold::Gathered | Hold::Not => None,
            };
            if let Some(d) = digest {
                if let Some(expected) = known.map(|k| k[i]) {
                    if expected != d {
                        return Err(ModelError::Weights(format!(
                            "tensor {}: its bytes do not match the digest recorded for this \
                             file (the file changed since it was indexed)",
                            table[i].name
                        )));
                    }
                }
                digests[i] = Some(d);
            }
        }
        let digests: Vec<Digest> = digests
            .into_iter()
            .map(|d| d.expect("every tensor has a digest"))
            .collect();
        let fingerprint = digest::fingerprint(&config, precision, kv_dtype, table, &digests);
        let weights = LlamaWeights {
            config,
            storage: Arc::new(storage),
            interleaved,
            vectors,
            token_embd,
            output_norm,
            output,
            rope_freqs,
            layers,
            layer_lo: lo,
            layer_hi: hi,
            held,
            head_copy: OnceLock::new(),
            precision,
            kv_dtype,
            fingerprint,
        };
        if let Some(f) = weights.rope_factors() {
            if let Some(bad) = f.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
                return Err(ModelError::Weights(format!(
                    "rope_freqs.weight holds {bad}: RoPE frequency divisors must be positive"
                )));
            }
        }
        // Construct every held matrix view once so a malformed tensor fails here, not
        // mid-forward.
        for i in lo..hi {
            weights.layer(i)?;
        }
        if weights.is_entry() {
            weights.embedding()?;
        }
        if weights.is_exit() {
            weights.matrix(weights.head_entry())?;
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

    /// Content hash of the whole model (config, precision, KV storage, every tensor's name,
    /// type, shape and bytes), the same whichever layers these weights hold: the
    /// `model_fingerprint` of every volume key, so new weights never hit old volumes.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The layers held, `[lo, hi)`.
    pub fn layers_held(&self) -> (usize, usize) {
        (self.layer_lo, self.layer_hi)
    }

    /// Whether these weights hold every layer of `[lo, hi)` (and, for the entry or exit
    /// range, the embedding or the head).
    pub fn holds(&self, lo: usize, hi: usize) -> bool {
        self.layer_lo <= lo && hi <= self.layer_hi
    }

    fn is_entry(&self) -> bool {
        self.layer_lo == 0
    }

    fn is_exit(&self) -> bool {
        self.layer_hi == self.config.n_layers
    }

    fn not_held(&self, what: &str) -> ModelError {
        ModelError::Input(format!(
            "{what} is not held by these weights (they hold layers {}:{} of {})",
            self.layer_lo, self.layer_hi, self.config.n_layers
        ))
    }

    /// What these weights hold and keep resident (the mapping's resident pages are read
    /// from `/proc/self/smaps`).
    pub fn memory(&self) -> WeightsMemory {
        let head = self
            .head_copy
            .get()
            .and_then(|c| c.as_ref())
            .map_or(0, Vec::len);
        let mapped = match &*self.storage {
            Storage::Mapped { map, .. } => memory::mapping_resident(map.as_ptr() as usize),
            Storage::Owned(_) => None,
        };
        WeightsMemory {
            held: self.held,
            copied: self.interleaved.len() + std::mem::size_of_val(&self.vectors[..]) + head,
            mapped,
        }
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
        if let Some(at) = e.vector {
            return &self.vectors[at..at + e.len / 4];
        }
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
        if !self.is_entry() {
            return Err(self.not_held("the token embedding"));
        }
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
        if !self.is_exit() {
            return Err(self.not_held("the LM head"));
        }
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

    /// The head's interleaved copy, if this kernel gains from one (see [`Self::lm_head`]),
    /// read from the file (not through the mapping). A read that fails leaves the head in
    /// row layout, read in place.
    fn interleaved_head(&self, e: &TensorEntry) -> Option<Vec<u8>> {
        if !head_is_copied(e) {
            return None;
        }
        let mut buf = Vec::new();
        let bytes = self.storage.read(e, &mut buf).ok()?;
        let mut out = vec![0u8; e.len];
        super::advise_huge_pages(&mut out);
        interleave(e, bytes, &mut out);
        Some(out)
    }

    /// The per-pair divisors of the RoPE frequencies (`rope_freqs.weight`, which llama.cpp's
    /// converter writes for Llama 3.1/3.2's `llama3` frequency scaling), if the file has them.
    pub fn rope_factors(&self) -> Option<&[f32]> {
        self.rope_freqs.as_ref().map(|e| self.f32_slice(e))
    }

    /// The final RMSNorm weight (held by the exit range: [`Self::holds`]).
    pub fn output_norm(&self) -> &[f32] {
        self.f32_slice(&self.output_norm)
    }

    /// Borrowed views of block `i`.
    pub fn layer(&self, i: usize) -> Result<LayerView<'_>, ModelError> {
        let l = self
            .layers
            .get(i)
            .ok_or_else(|| ModelError::Weights(format!("no layer {i}")))?;
        if !self.holds(i, i + 1) {
            return Err(self.not_held(&format!("layer {i}")));
        }
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

/// Writes `e`'s bytes into `out` in the interleaved layout.
fn interleave(e: &TensorEntry, bytes: &[u8], out: &mut [u8]) {
    let ok = crate::quant::interleave_rows_into(e.dtype, e.rows, e.cols, bytes, out);
    assert!(ok, "a validated matrix of an interleavable type");
}

/// Whether `e` is an F32 vector (a norm, a bias, the RoPE divisors): copied at load.
fn is_vector(e: &TensorEntry) -> bool {
    e.dtype == GgmlType::F32 && e.rows == 1
}

/// Whether the LM head `e` is copied interleaved ([`LlamaWeights::lm_head`]): with 16-lane
/// kernels, for a 32-element format.
fn head_is_copied(e: &TensorEntry) -> bool {
    crate::quant::Kernel::detect().lanes() == 16 && interleavable(e)
}

#[cfg(test)]
mod tests;
