//! Quantized matmul kernels on SmolLM2-135M shapes (hidden 576, FFN 1536, KV 192, vocab
//! 49152, 30 layers; layer matrices Q4_1, tied LM head Q8_0).
//!
//! - `decode_matvec`: one token × one matrix, per shape (weights stay cache-warm: kernel
//!   throughput), GB/s of weights;
//! - `decode_token`: every matmul of one decoded token — 30 layers' 210 distinct matrices plus
//!   the LM head, 96.6 MB streamed from memory — with input quantization as the model does it;
//! - `prefill_gemm`: 256 tokens × each layer shape (GMAC/s), and one whole layer;
//! - `baseline`: naive dequantize-a-row-then-dot, our kernel on one thread, and memcpy / a
//!   parallel read of the 96.6 MB as the bandwidth reference;
//! - `formats`: every quantized format at decode shapes (1 token), weights streamed from
//!   memory (a ring of copies twice the size of L3), GB/s of weight bytes against a memcpy
//!   of as many bytes in the same run;
//! - `small_batch`: the 210 layer matmuls of all 30 layers for n = 1, 2, 4, 8, 16 tokens
//!   (continuous batching, speculative decoding), all-Q4_1 and all-Q8_0 layers, with inputs
//!   quantized fast (one 8-bit pass) or refined (16-bit codes; k-quants: value + residual, folded) as the model does;
//! - `small_batch_formats`: one 640×2048 matmul per format (SmolLM2's and Gemma 3 Q4_K_M's)
//!   for n = 1, 2, 3, 4, 6, 8, 16 tokens, weights streamed from memory, both precisions.
//!
//! - `large`: the same kernels at the seeds' 7B shape, where nothing fits in the caches
//!   (`quant/large.rs`): row costs for n = 1…16 and 64, both precisions, against the read
//!   bandwidth and the VNNI peak measured in the same run.
//!
//! Timings are noisy on a shared 2-core machine, so the summary printed at the end compares
//! numbers measured in this same run (ratios), from criterion's own samples.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use amplituhedron::quant::{
    fold_refined, interleave_rows, matmul, GgmlType, QMatrix, QuantScratch, QuantizedInput,
};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rayon::prelude::*;

#[path = "quant/large.rs"]
mod large;

const HIDDEN: usize = 576;
const FFN: usize = 1536;
const KV: usize = 192;
const VOCAB: usize = 49152;
const LAYERS: usize = 30;
const PREFILL_TOKENS: usize = 256;
const SAMPLES: usize = 10;

/// One layer's matrices as (name, rows, cols), in execution order.
const LAYER: [(&str, usize, usize); 7] = [
    ("attn_q", HIDDEN, HIDDEN),
    ("attn_k", KV, HIDDEN),
    ("attn_v", KV, HIDDEN),
    ("attn_output", HIDDEN, HIDDEN),
    ("ffn_gate", FFN, HIDDEN),
    ("ffn_up", FFN, HIDDEN),
    ("ffn_down", HIDDEN, FFN),
];

/// Distinct decode shapes: (label, dtype, rows, cols).
const SHAPES: [(&str, GgmlType, usize, usize); 5] = [
    ("q4_1_576x576", GgmlType::Q4_1, HIDDEN, HIDDEN),
    ("q4_1_576to192", GgmlType::Q4_1, KV, HIDDEN),
    ("q4_1_576to1536", GgmlType::Q4_1, FFN, HIDDEN),
    ("q4_1_1536to576", GgmlType::Q4_1, HIDDEN, FFN),
    ("q8_0_lm_head_576to49152", GgmlType::Q8_0, VOCAB, HIDDEN),
];

struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn floats(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect()
    }
}

/// Random codes with small finite f16 scales (what matters for speed is the byte layout).
/// (For k-quants the f16 `d`/`dmin` sit elsewhere in the block, and random bytes there may
/// be non-finite; the kernels' speed does not depend on the values.)
fn random_weights(dtype: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut data = vec![0u8; rows * dtype.row_bytes(cols).unwrap()];
    for chunk in data.chunks_mut(8) {
        let v = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    if dtype.block_size() > 32 {
        return data; // k-quant
    }
    let scale = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    let min = half::f16::from_f32(-0.07).to_bits().to_le_bytes();
    for blk in data.chunks_exact_mut(dtype.block_bytes()) {
        blk[..2].copy_from_slice(&scale);
        if dtype == GgmlType::Q4_1 {
            blk[2..4].copy_from_slice(&min);
        }
    }
    data
}

/// Per-iteration times of every criterion call, by benchmark id, for the summary.
static TIMES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

/// Criterion timing loop run inside `pool` (as a model runtime runs its forward pass, so the
/// calling thread takes part in every matmul), recording per-iteration times under `key`.
fn timed(
    b: &mut criterion::Bencher<'_>,
    pool: &rayon::ThreadPool,
    key: &str,
    mut f: impl FnMut() + Send,
) {
    b.iter_custom(|iters| {
        let elapsed = pool.install(|| {
            let start = Instant::now();
            for _ in 0..iters {
                f();
            }
            start.elapsed()
        });
        TIMES
            .lock()
            .unwrap()
            .entry(key.to_string())
            .or_default()
            .push(elapsed.as_secs_f64() / iters as f64);
        elapsed
    });
}

/// Per-iteration seconds of the measured samples (criterion's warm-up calls come first, so
/// the last `SAMPLES` calls are the samples), sorted; empty if the benchmark was filtered out.
fn samples(key: &str) -> Vec<f64> {
    let times = TIMES.lock().unwrap();
    let all = times.get(key).map(Vec::as_slice).unwrap_or_default();
    let mut last = all[all.len().saturating_sub(SAMPLES)..].to_vec();
    last.sort_by(f64::total_cmp);
    last
}

/// Median per-iteration seconds (NaN if not measured in this run).
fn median(key: &str) -> f64 {
    let s = samples(key);
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Fastest sample's per-iteration seconds: the least disturbed by other processes.
fn fastest(key: &str) -> f64 {
    samples(key).first().copied().unwrap_or(f64::NAN)
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

fn decode_matvec(c: &mut Criterion) {
    let mut rng = Rng(1);
    let mut g = c.benchmark_group("decode_matvec");
    for threads in [2, 1] {
        let pool = pool(threads);
        for (label, dtype, rows, cols) in SHAPES {
            let data = random_weights(dtype, rows, cols, &mut rng);
            let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
            let x = rng.floats(cols);
            let mut scratch = QuantScratch::new();
            let input = QuantizedInput::quantize(&x, 1, cols, &mut scratch).unwrap();
            let mut out = vec![0.0f32; rows];
            g.throughput(Throughput::Bytes(data.len() as u64));
            let id = format!("{label}/{threads}t");
            g.bench_function(&id, |b| {
                timed(b, &pool, &format!("decode/{id}"), || {
                    matmul(&w, &input, &mut out).unwrap();
                    black_box(&out);
                })
            });
        }
    }
    g.finish();
}

/// Every matrix of the model, distinct allocations (so a token streams them from memory).
struct Model {
    dtype: GgmlType,
    layers: Vec<Vec<Vec<u8>>>,
    lm_head: Vec<u8>,
}

impl Model {
    /// SmolLM2's layout: Q4_1 layers, Q8_0 LM head.
    fn new(rng: &mut Rng) -> Self {
        let mut model = Self::layers_of(GgmlType::Q4_1, LAYERS, rng);
        model.lm_head = random_weights(GgmlType::Q8_0, VOCAB, HIDDEN, rng);
        model
    }

    /// `layers` layers of `dtype` matrices and no LM head.
    fn layers_of(dtype: GgmlType, layers: usize, rng: &mut Rng) -> Self {
        let layers = (0..layers)
            .map(|_| {
                LAYER
                    .iter()
                    .map(|&(_, rows, cols)| random_weights(dtype, rows, cols, rng))
                    .collect()
            })
            .collect();
        Self {
            dtype,
            layers,
            lm_head: Vec::new(),
        }
    }

    fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(Vec::len).sum::<usize>() + self.lm_head.len()
    }

    fn matrix(&self, layer: usize, i: usize) -> QMatrix<'_> {
        let (_, rows, cols) = LAYER[i];
        QMatrix::new(self.dtype, rows, cols, &self.layers[layer][i]).unwrap()
    }
}

/// Scratch and buffers of a forward pass over `n` tokens (allocated once).
struct Buffers {
    scratch: QuantScratch,
    x: Vec<f32>,
    ffn_x: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    logits: Vec<f32>,
}

impl Buffers {
    fn new(n: usize, rng: &mut Rng) -> Self {
        Self {
            scratch: QuantScratch::with_capacity(n, FFN),
            x: rng.floats(n * HIDDEN),
            ffn_x: rng.floats(n * FFN),
            q: vec![0.0; n * HIDDEN],
            k: vec![0.0; n * KV],
            v: vec![0.0; n * KV],
            o: vec![0.0; n * HIDDEN],
            gate: vec![0.0; n * FFN],
            up: vec![0.0; n * FFN],
            down: vec![0.0; n * HIDDEN],
            logits: vec![0.0; VOCAB],
        }
    }
}

/// The seven matmuls of one layer over `n` tokens, each input quantized once (attention,
/// norms and activations are not this module's and are left out).
fn layer_matmuls(model: &Model, layer: usize, n: usize, b: &mut Buffers) {
    let input = QuantizedInput::quantize(&b.x, n, HIDDEN, &mut b.scratch).unwrap();
    matmul(&model.matrix(layer, 0), &input, &mut b.q).unwrap();
    matmul(&model.matrix(layer, 1), &input, &mut b.k).unwrap();
    matmul(&model.matrix(layer, 2), &input, &mut b.v).unwrap();
    let input = QuantizedInput::quantize(&b.q, n, HIDDEN, &mut b.scratch).unwrap();
    matmul(&model.matrix(layer, 3), &input, &mut b.o).unwrap();
    let input = QuantizedInput::quantize(&b.x, n, HIDDEN, &mut b.scratch).unwrap();
    matmul(&model.matrix(layer, 4), &input, &mut b.gate).unwrap();
    matmul(&model.matrix(layer, 5), &input, &mut b.up).unwrap();
    let input = QuantizedInput::quantize(&b.ffn_x, n, FFN, &mut b.scratch).unwrap();
    matmul(&model.matrix(layer, 6), &input, &mut b.down).unwrap();
}

fn decode_token(model: &Model, b: &mut Buffers) {
    for layer in 0..LAYERS {
        layer_matmuls(model, layer, 1, b);
    }
    let head = QMatrix::new(GgmlType::Q8_0, VOCAB, HIDDEN, &model.lm_head).unwrap();
    let input = QuantizedInput::quantize(&b.x[..HIDDEN], 1, HIDDEN, &mut b.scratch).unwrap();
    matmul(&head, &input, &mut b.logits).unwrap();
    black_box(&b.logits);
}

fn decode_tokens(c: &mut Criterion) {
    let mut rng = Rng(2);
    let model = Model::new(&mut rng);
    let mut bufs = Buffers::new(1, &mut rng);
    let mut g = c.benchmark_group("decode_token");
    g.throughput(Throughput::Bytes(model.bytes() as u64));
    for threads in [2, 1] {
        let pool = pool(threads);
        g.bench_function(format!("all_layers_and_lm_head/{threads}t"), |b| {
            timed(b, &pool, &format!("token/{threads}t"), || {
                decode_token(&model, &mut bufs)
            })
        });
    }
    g.finish();
}

/// Naive reference: dequantize each row to f32, then a plain dot product per token.
fn naive_matmul(w: &QMatrix<'_>, x: &[f32], n: usize, row: &mut [f32], out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    for r in 0..rows {
        w.dequantize_row(r, row).unwrap();
        for t in 0..n {
            out[t * rows + r] = row
                .iter()
                .zip(&x[t * cols..(t + 1) * cols])
                .map(|(a, b)| a * b)
                .sum();
        }
    }
}

fn prefill_gemm(c: &mut Criterion) {
    let mut rng = Rng(3);
    let n = PREFILL_TOKENS;
    let pool = pool(2);
    let mut g = c.benchmark_group("prefill_gemm");
    let mut done = Vec::new();
    for &(_, rows, cols) in &LAYER {
        if done.contains(&(rows, cols)) {
            continue;
        }
        done.push((rows, cols));
        let data = random_weights(GgmlType::Q4_1, rows, cols, &mut rng);
        let w = QMatrix::new(GgmlType::Q4_1, rows, cols, &data).unwrap();
        let x = rng.floats(n * cols);
        let mut scratch = QuantScratch::new();
        let mut out = vec![0.0f32; n * rows];
        g.throughput(Throughput::Elements((rows * cols * n) as u64));
        let label = format!("q4_1_{cols}to{rows}_x{n}/2t");
        g.bench_function(BenchmarkId::from_parameter(&label), |b| {
            timed(b, &pool, &format!("prefill/{rows}x{cols}"), || {
                let input = QuantizedInput::quantize(&x, n, cols, &mut scratch).unwrap();
                matmul(&w, &input, &mut out).unwrap();
                black_box(&out);
            })
        });
    }
    // Activation quantization alone (once per matmul input; shared by q/k/v and gate/up).
    for cols in [HIDDEN, FFN] {
        let x = rng.floats(n * cols);
        let mut scratch = QuantScratch::new();
        g.throughput(Throughput::Elements((n * cols) as u64));
        g.bench_function(
            BenchmarkId::from_parameter(format!("quantize_{n}x{cols}/2t")),
            |b| {
                timed(b, &pool, &format!("quantize/{cols}"), || {
                    black_box(QuantizedInput::quantize(&x, n, cols, &mut scratch).unwrap());
                })
            },
        );
    }
    // One whole layer (7 distinct matrices, inputs quantized as the model does).
    let model = Model::layers_of(GgmlType::Q4_1, 1, &mut rng);
    let mut bufs = Buffers::new(n, &mut rng);
    let layer_macs: usize = LAYER.iter().map(|&(_, r, c)| r * c).sum();
    g.throughput(Throughput::Elements((layer_macs * n) as u64));
    g.bench_function(
        BenchmarkId::from_parameter(format!("one_layer_x{n}/2t")),
        |b| {
            timed(b, &pool, "prefill/layer", || {
                layer_matmuls(&model, 0, n, &mut bufs)
            })
        },
    );
    g.finish();
}

fn baselines(c: &mut Criterion) {
    let mut rng = Rng(4);
    let (p1, p2) = (pool(1), pool(2));
    let mut g = c.benchmark_group("baseline");
    let (rows, cols, n) = (FFN, HIDDEN, PREFILL_TOKENS);
    let data = random_weights(GgmlType::Q4_1, rows, cols, &mut rng);
    let w = QMatrix::new(GgmlType::Q4_1, rows, cols, &data).unwrap();
    let x = rng.floats(n * cols);
    let mut row = vec![0.0f32; cols];
    let mut out = vec![0.0f32; n * rows];
    let mut scratch = QuantScratch::new();
    g.throughput(Throughput::Bytes(data.len() as u64));
    g.bench_function("naive_dequant_dot_matvec_576to1536/1t", |b| {
        timed(b, &p1, "naive/decode", || {
            naive_matmul(&w, &x[..cols], 1, &mut row, &mut out[..rows]);
            black_box(&out);
        })
    });
    g.throughput(Throughput::Elements((rows * cols * n) as u64));
    g.bench_function("naive_dequant_dot_gemm_576to1536_x256/1t", |b| {
        timed(b, &p1, "naive/prefill", || {
            naive_matmul(&w, &x, n, &mut row, &mut out);
            black_box(&out);
        })
    });
    g.bench_function("kernel_gemm_576to1536_x256/1t", |b| {
        timed(b, &p1, "kernel1t/prefill", || {
            let input = QuantizedInput::quantize(&x, n, cols, &mut scratch).unwrap();
            matmul(&w, &input, &mut out).unwrap();
            black_box(&out);
        })
    });

    // Bandwidth reference over as many bytes as the model's weights (96.6 MB).
    let total = Model::new(&mut rng).bytes();
    let src: Vec<u8> = (0..total).map(|i| i as u8).collect();
    let mut dst = vec![0u8; total];
    g.throughput(Throughput::Bytes(total as u64));
    for (threads, pool) in [(1, &p1), (2, &p2)] {
        g.bench_function(format!("memcpy_model_weights/{threads}t"), |b| {
            timed(b, pool, &format!("memcpy/{threads}t"), || {
                dst.par_chunks_mut(1 << 20)
                    .zip(src.par_chunks(1 << 20))
                    .for_each(|(d, s)| d.copy_from_slice(s));
                black_box(&dst);
            })
        });
        g.bench_function(format!("read_model_weights/{threads}t"), |b| {
            timed(b, pool, &format!("read/{threads}t"), || {
                black_box(read_all(&src));
            })
        });
    }
    g.finish();
}

/// Decode shapes `(rows, cols)` of the format bench: SmolLM2's FFN (576×1536, 1536×576),
/// Gemma 3 270M's (640×2048, 2048×640) and an LM head. k-quants need cols % 256 == 0, so
/// they skip 1536×576 and 2048×640 (real files store such matrices in 32-element formats).
const FORMAT_SHAPES: [(usize, usize); 5] = [
    (576, 1536),
    (1536, 576),
    (640, 2048),
    (2048, 640),
    (49152, 1536),
];
/// Bytes of weights a format bench cycles through: twice a 32 MB L3, so they stream.
const RING_BYTES: usize = 64 << 20;

fn quantized_formats() -> impl Iterator<Item = GgmlType> {
    GgmlType::ALL.into_iter().filter(|t| t.is_quantized())
}

fn memcpy_all(dst: &mut [u8], src: &[u8]) {
    dst.par_chunks_mut(1 << 20)
        .zip(src.par_chunks(1 << 20))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// Sums the bytes as u64 words over the pool: the plain read bandwidth.
fn read_all(src: &[u8]) -> u64 {
    src.par_chunks(1 << 20)
        .map(|c| {
            c.chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
                .fold(0u64, u64::wrapping_add)
        })
        .reduce(|| 0, u64::wrapping_add)
}

fn formats(c: &mut Criterion) {
    let mut rng = Rng(7);
    let pool = pool(2);
    let mut g = c.benchmark_group("formats");
    let src: Vec<u8> = (0..RING_BYTES).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0u8; RING_BYTES];
    g.throughput(Throughput::Bytes(RING_BYTES as u64));
    g.bench_function("memcpy/2t", |b| {
        timed(b, &pool, "formats/memcpy", || {
            memcpy_all(&mut dst, &src);
            black_box(&dst);
        })
    });
    g.bench_function("read/2t", |b| {
        timed(b, &pool, "formats/read", || {
            black_box(read_all(&src));
        })
    });
    drop((src, dst));
    for dtype in quantized_formats() {
        for (rows, cols) in FORMAT_SHAPES {
            if cols % dtype.block_size() != 0 {
                continue;
            }
            let bytes = rows * dtype.row_bytes(cols).unwrap();
            let copies = if std::env::var("KQ_WARM").is_ok() {
                1
            } else {
                RING_BYTES.div_ceil(bytes)
            };
            let ring: Vec<Vec<u8>> = (0..copies)
                .map(|_| random_weights(dtype, rows, cols, &mut rng))
                .collect();
            let x = rng.floats(cols);
            let mut scratch = QuantScratch::new();
            let input = QuantizedInput::quantize(&x, 1, cols, &mut scratch).unwrap();
            let mut out = vec![0.0f32; rows];
            let mut next = 0;
            g.throughput(Throughput::Bytes(bytes as u64));
            let id = format!("{dtype}/{rows}x{cols}");
            g.bench_function(&id, |b| {
                timed(b, &pool, &format!("formats/{id}"), || {
                    let w = QMatrix::new(dtype, rows, cols, &ring[next]).unwrap();
                    next = (next + 1) % ring.len();
                    matmul(&w, &input, &mut out).unwrap();
                    black_box(&out);
                })
            });
        }
    }
    g.finish();
}

/// Token counts of the small-batch bench.
const SMALL_BATCHES: [usize; 5] = [1, 2, 4, 8, 16];

/// Buffers of the model's projections: quantization scratch, the refined residual and a
/// refined k-quant product's `2n` rows before folding.
#[derive(Default)]
struct Projection {
    scratch: QuantScratch,
    stacked: Vec<f32>,
    full: Vec<f32>,
}

impl Projection {
    /// Quantizes `x` (`n` rows) once at the chosen precision and applies it to every
    /// `(matrix, output)` pair, folding a refined product as the model does.
    fn apply(
        &mut self,
        refined: bool,
        x: &[f32],
        n: usize,
        targets: &mut [(QMatrix<'_>, &mut [f32])],
    ) {
        let Projection {
            scratch,
            stacked,
            full,
        } = self;
        let cols = x.len() / n;
        let input = if refined {
            QuantizedInput::quantize_refined(x, n, cols, stacked, scratch)
        } else {
            QuantizedInput::quantize(x, n, cols, scratch)
        }
        .unwrap();
        for (w, out) in targets.iter_mut() {
            if input.product_tokens(w.dtype()) > n {
                full.resize(2 * out.len(), 0.0);
                matmul(w, &input, full).unwrap();
                fold_refined(full, out);
            } else {
                matmul(w, &input, out).unwrap();
            }
        }
    }
}

/// The seven matmuls of one layer over `n` tokens at a precision.
fn layer_matmuls_at(
    model: &Model,
    layer: usize,
    n: usize,
    refined: bool,
    b: &mut Buffers,
    p: &mut Projection,
) {
    let m = |i: usize| model.matrix(layer, i);
    let (x, q) = (&b.x[..n * HIDDEN], &mut b.q[..n * HIDDEN]);
    p.apply(
        refined,
        x,
        n,
        &mut [
            (m(0), q),
            (m(1), &mut b.k[..n * KV]),
            (m(2), &mut b.v[..n * KV]),
        ],
    );
    p.apply(
        refined,
        &b.q[..n * HIDDEN],
        n,
        &mut [(m(3), &mut b.o[..n * HIDDEN])],
    );
    p.apply(
        refined,
        &b.x[..n * HIDDEN],
        n,
        &mut [(m(4), &mut b.gate[..n * FFN]), (m(5), &mut b.up[..n * FFN])],
    );
    p.apply(
        refined,
        &b.ffn_x[..n * FFN],
        n,
        &mut [(m(6), &mut b.down[..n * HIDDEN])],
    );
}

fn precision_name(refined: bool) -> &'static str {
    if refined {
        "refined"
    } else {
        "fast"
    }
}

/// One cache-warm 1536×576 matrix per format (SmolLM2's Q4_1 and Q8_0, Gemma 3's Q5_0), n
/// tokens, one thread: kernel throughput without memory effects (GMAC/s), both precisions.
fn small_batch_kernel(c: &mut Criterion) {
    let mut rng = Rng(6);
    let pool = pool(1);
    let mut g = c.benchmark_group("small_batch_kernel");
    for (dtype, il) in [
        (GgmlType::Q4_1, false),
        (GgmlType::Q4_1, true),
        (GgmlType::Q8_0, false),
        (GgmlType::Q8_0, true),
        (GgmlType::Q5_0, false),
        (GgmlType::Q5_0, true),
    ] {
        let data = random_weights(dtype, FFN, HIDDEN, &mut rng);
        let il_data = interleave_rows(dtype, FFN, HIDDEN, &data).unwrap();
        let w = if il {
            QMatrix::new_interleaved(dtype, FFN, HIDDEN, &il_data).unwrap()
        } else {
            QMatrix::new(dtype, FFN, HIDDEN, &data).unwrap()
        };
        let layout = if il { "/interleaved" } else { "" };
        let x = rng.floats(16 * HIDDEN);
        let mut out = vec![0.0f32; 16 * FFN];
        let mut proj = Projection::default();
        for refined in [false, true] {
            for n in SMALL_BATCHES {
                g.throughput(Throughput::Elements((FFN * HIDDEN * n) as u64));
                let id = format!("{dtype}{layout}/{}/n{n}", precision_name(refined));
                g.bench_function(&id, |b| {
                    timed(b, &pool, &format!("kernel/{id}"), || {
                        proj.apply(
                            refined,
                            &x[..n * HIDDEN],
                            n,
                            &mut [(w, &mut out[..n * FFN])],
                        );
                        black_box(&out);
                    })
                });
            }
        }
    }
    g.finish();
}

/// Formats of the per-format small-batch bench: SmolLM2's (Q4_0, Q4_1, Q8_0) and Gemma 3
/// Q4_K_M's (Q5_0, Q4_K, Q6_K).
const BATCH_FORMATS: [GgmlType; 6] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];
/// Token counts of that bench: the powers of two, and 3 and 6 (counts that are not a tile
/// size).
const FORMAT_BATCHES: [usize; 7] = [1, 2, 3, 4, 6, 8, 16];
/// Decode shape of that bench (Gemma 3 270M's FFN down: cols a multiple of 256 for k-quants).
const BATCH_SHAPE: (usize, usize) = (640, 2048);

/// One matmul per format at a decode shape for n = 1…16 tokens, weights streamed from memory
/// (a ring of copies as in `formats`), 2 threads, both precisions: what a continuous-batching
/// decode step pays per matrix.
fn small_batch_formats(c: &mut Criterion) {
    let mut rng = Rng(8);
    let pool = pool(2);
    let (rows, cols) = BATCH_SHAPE;
    let mut g = c.benchmark_group("small_batch_formats");
    let x = rng.floats(16 * cols);
    let mut out = vec![0.0f32; 16 * rows];
    let mut proj = Projection::default();
    for dtype in BATCH_FORMATS {
        let bytes = rows * dtype.row_bytes(cols).unwrap();
        let ring: Vec<Vec<u8>> = (0..RING_BYTES.div_ceil(bytes))
            .map(|_| random_weights(dtype, rows, cols, &mut rng))
            .collect();
        let mut next = 0;
        for refined in [false, true] {
            for n in FORMAT_BATCHES {
                g.throughput(Throughput::Elements(n as u64));
                let id = format!("{dtype}/{}/n{n}", precision_name(refined));
                g.bench_function(&id, |b| {
                    timed(b, &pool, &format!("batchfmt/{id}"), || {
                        let w = QMatrix::new(dtype, rows, cols, &ring[next]).unwrap();
                        next = (next + 1) % ring.len();
                        proj.apply(refined, &x[..n * cols], n, &mut [(w, &mut out[..n * rows])]);
                        black_box(&out);
                    })
                });
            }
        }
    }
    g.finish();
}

/// One cache-warm 640×2048 matmul per format over 256 tokens on one thread, both precisions:
/// the many-row (prefill) kernel throughput in GMAC/s, without memory effects.
fn prefill_formats(c: &mut Criterion) {
    let mut rng = Rng(9);
    let pool = pool(1);
    let (rows, cols) = BATCH_SHAPE;
    let n = PREFILL_TOKENS;
    let mut g = c.benchmark_group("prefill_formats");
    let x = rng.floats(n * cols);
    let mut out = vec![0.0f32; n * rows];
    let mut proj = Projection::default();
    for dtype in BATCH_FORMATS {
        let data = random_weights(dtype, rows, cols, &mut rng);
        let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
        for refined in [false, true] {
            g.throughput(Throughput::Elements((rows * cols * n) as u64));
            let id = format!("{dtype}/{}/n{n}", precision_name(refined));
            g.bench_function(&id, |b| {
                timed(b, &pool, &format!("prefillfmt/{id}"), || {
                    proj.apply(refined, &x, n, &mut [(w, &mut out[..])]);
                    black_box(&out);
                })
            });
        }
    }
    g.finish();
}

fn small_batch(c: &mut Criterion) {
    let mut rng = Rng(5);
    let pool = pool(2);
    let mut g = c.benchmark_group("small_batch");
    for dtype in [GgmlType::Q4_1, GgmlType::Q8_0] {
        let model = Model::layers_of(dtype, LAYERS, &mut rng);
        let max_n = SMALL_BATCHES[SMALL_BATCHES.len() - 1];
        let mut bufs = Buffers::new(max_n, &mut rng);
        let mut proj = Projection::default();
        for refined in [false, true] {
            for n in SMALL_BATCHES {
                g.throughput(Throughput::Elements(n as u64));
                let id = format!("{dtype}/{}/n{n}", precision_name(refined));
                g.bench_function(&id, |b| {
                    timed(b, &pool, &format!("small/{id}"), || {
                        for layer in 0..LAYERS {
                            layer_matmuls_at(&model, layer, n, refined, &mut bufs, &mut proj);
                        }
                        black_box(&bufs.down);
                    })
                });
            }
        }
    }
    g.finish();
}

fn summary(_c: &mut Criterion) {
    let gbs = |bytes: usize, secs: f64| bytes as f64 / secs / 1e9;
    let both = |key: &str| (median(key), fastest(key));
    println!("\n==== quant summary: median (fastest sample) of this run ====");
    println!("decode matvec, 1 token, weights cache-warm (GB/s of weights):");
    for (label, dtype, rows, cols) in SHAPES {
        let bytes = rows * dtype.row_bytes(cols).unwrap();
        let mut line = format!("  {label:<24}");
        for threads in [2, 1] {
            let (m, f) = both(&format!("decode/{label}/{threads}t"));
            line += &format!(
                "  {threads}t {:>7.1} us {:>5.1} ({:>5.1}) GB/s",
                m * 1e6,
                gbs(bytes, m),
                gbs(bytes, f)
            );
        }
        println!("{line}");
    }
    let model_bytes: usize = LAYER
        .iter()
        .map(|&(_, r, c)| r * GgmlType::Q4_1.row_bytes(c).unwrap())
        .sum::<usize>()
        * LAYERS
        + VOCAB * GgmlType::Q8_0.row_bytes(HIDDEN).unwrap();
    println!(
        "decode token: all 211 matmuls, {:.1} MB of weights streamed from memory:",
        model_bytes as f64 / 1e6
    );
    let (read1, read2) = (median("read/1t"), median("read/2t"));
    for (threads, read) in [(2, read2), (1, read1)] {
        let (m, f) = both(&format!("token/{threads}t"));
        println!(
            "  {threads} thread(s): {:>6.2} ({:.2}) ms/token = {:>5.1} GB/s; read-bandwidth floor {:.2} ms -> {:.2}x the floor",
            m * 1e3,
            f * 1e3,
            gbs(model_bytes, m),
            read * 1e3,
            m / read
        );
    }
    let warm: f64 = LAYER
        .iter()
        .map(|&(_, r, c)| {
            let label = SHAPES.iter().find(|s| s.2 == r && s.3 == c).unwrap().0;
            median(&format!("decode/{label}/2t"))
        })
        .sum::<f64>()
        * LAYERS as f64
        + median("decode/q8_0_lm_head_576to49152/2t");
    println!(
        "  (sum of the cache-warm per-shape medians, 2 threads: {:.2} ms/token)",
        warm * 1e3
    );
    println!(
        "bandwidth reference over {:.1} MB:",
        model_bytes as f64 / 1e6
    );
    for threads in [1, 2] {
        println!(
            "  {threads} thread(s): memcpy {:>5.1} GB/s, read {:>5.1} GB/s",
            gbs(model_bytes, median(&format!("memcpy/{threads}t"))),
            gbs(model_bytes, median(&format!("read/{threads}t")))
        );
    }

    let n = PREFILL_TOKENS;
    println!("prefill GEMM, {n} tokens, Q4_1, 2 threads:");
    for &(name, rows, cols) in &LAYER {
        let (m, f) = both(&format!("prefill/{rows}x{cols}"));
        let macs = (rows * cols * n) as f64;
        println!(
            "  {name:<12} {cols:>4}->{rows:<4} {:>7.2} ms  {:>5.1} ({:>5.1}) GMAC/s",
            m * 1e3,
            macs / m / 1e9,
            macs / f / 1e9
        );
    }
    println!(
        "  (each includes quantizing its input: {n}x{HIDDEN} takes {:.3} ms, {n}x{FFN} {:.3} ms)",
        median(&format!("quantize/{HIDDEN}")) * 1e3,
        median(&format!("quantize/{FFN}")) * 1e3
    );
    let layer_macs: usize = LAYER.iter().map(|&(_, r, c)| r * c).sum();
    let (m, f) = both("prefill/layer");
    println!(
        "  one layer: {:.2} ({:.2}) ms = {:.1} GMAC/s; all {LAYERS} layers projected {:.3} ({:.3}) s  [target <= 0.4 s; llama.cpp's whole prefill ~0.85 s]",
        m * 1e3,
        f * 1e3,
        (layer_macs * n) as f64 / m / 1e9,
        m * LAYERS as f64,
        f * LAYERS as f64
    );

    let memcpy = RING_BYTES as f64 / median("formats/memcpy") / 1e9;
    let read = RING_BYTES as f64 / median("formats/read") / 1e9;
    println!(
        "formats: 1 token, weights streamed from memory, 2 threads (over {} MB: memcpy {memcpy:.2} GB/s, read {read:.2} GB/s):",
        RING_BYTES >> 20
    );
    println!(
        "  {:<6} {:>12} {:>8} {:>8} {:>7} {:>8}",
        "format", "shape", "GB/s", "memcpy", "ratio", "/read"
    );
    for dtype in quantized_formats() {
        for (rows, cols) in FORMAT_SHAPES {
            if cols % dtype.block_size() != 0 {
                continue;
            }
            let bytes = rows * dtype.row_bytes(cols).unwrap();
            let gbs = bytes as f64 / median(&format!("formats/{dtype}/{rows}x{cols}")) / 1e9;
            println!(
                "  {dtype:<6} {:>12} {gbs:>8.2} {memcpy:>8.2} {:>7.2} {:>8.2}",
                format!("{rows}x{cols}"),
                gbs / memcpy,
                gbs / read
            );
        }
    }

    println!("small batch: the 210 layer matmuls of 30 layers, n tokens, 2 threads (tokens/s, and speed-up of the batch over n = 1):");
    for dtype in [GgmlType::Q4_1, GgmlType::Q8_0] {
        for refined in [false, true] {
            let one = median(&format!("small/{dtype}/{}/n1", precision_name(refined)));
            let mut line = format!("  {dtype} {:<8}", precision_name(refined));
            for n in SMALL_BATCHES {
                let m = median(&format!("small/{dtype}/{}/n{n}", precision_name(refined)));
                line += &format!(
                    " n={n}: {:>6.1} ms {:>6.0}/s ({:.2}x)",
                    m * 1e3,
                    n as f64 / m,
                    n as f64 * one / m
                );
            }
            println!("{line}");
        }
    }

    let (rows, cols) = BATCH_SHAPE;
    for (stat, pick) in [
        ("median", median as fn(&str) -> f64),
        ("fastest sample", fastest),
    ] {
        println!("small batch per format, {stat}: one {rows}x{cols} matmul, weights streamed from memory, 2 threads (us per call, rows/s ratio over n = 1):");
        for dtype in BATCH_FORMATS {
            for refined in [false, true] {
                let key = |n: usize| format!("batchfmt/{dtype}/{}/n{n}", precision_name(refined));
                let one = pick(&key(1));
                let mut line = format!("  {dtype:<5} {:<8}", precision_name(refined));
                for n in FORMAT_BATCHES {
                    let m = pick(&key(n));
                    line += &format!(" n={n}:{:>6.1} ({:.2}x)", m * 1e6, n as f64 * one / m);
                }
                println!("{line}");
            }
        }
    }

    println!("small batch kernel: one cache-warm 1536x576 matrix, 1 thread (GMAC/s; activation passes count once):");
    for dtype in [GgmlType::Q4_1, GgmlType::Q8_0] {
        for refined in [false, true] {
            let mut line = format!("  {dtype} {:<8}", precision_name(refined));
            for n in SMALL_BATCHES {
                let m = median(&format!("kernel/{dtype}/{}/n{n}", precision_name(refined)));
                line += &format!(
                    " n={n}: {:>6.1} us {:>5.1}",
                    m * 1e6,
                    (FFN * HIDDEN * n) as f64 / m / 1e9
                );
            }
            println!("{line}");
        }
    }

    let naive_d = median("naive/decode");
    let naive_p = median("naive/prefill");
    println!("speed-up over naive dequantize-a-row-then-dot (576->1536, naive on 1 thread):");
    println!(
        "  matvec:   naive {:>8.1} us; kernel 1 thread {:.1}x, 2 threads {:.1}x",
        naive_d * 1e6,
        naive_d / median("decode/q4_1_576to1536/1t"),
        naive_d / median("decode/q4_1_576to1536/2t")
    );
    println!(
        "  gemm x{n}: naive {:>8.1} ms; kernel 1 thread {:.1}x, 2 threads {:.1}x",
        naive_p * 1e3,
        naive_p / median("kernel1t/prefill"),
        naive_p / median("prefill/1536x576")
    );
    large::summary();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(SAMPLES)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(800));
    targets = decode_matvec, decode_tokens, prefill_gemm, baselines, formats, small_batch_kernel, small_batch, small_batch_formats, prefill_formats, large::large, summary
}
criterion_main!(benches);
