//! The quantized matmuls at the seeds' 7B shape (Qwen2 7B: hidden 3584, FFN 18944, 4 KV
//! heads of 128, vocabulary 152064, 28 layers; Q4_0 layers and a Q8_0 head, both in the
//! interleaved layout the model uses), where no matrix set fits in the caches:
//!
//! - `large/read`: the plain read bandwidth over every resident weight byte (the floor a
//!   decode step can reach: bytes streamed per token ÷ this);
//! - `large/vnni_peak`: one core's `vpdpbusd` rate (independent chains), the peak the
//!   kernels' efficiency is quoted against;
//! - `large/vnni_term`: the same with the canonical term's two `vmulps` per 8 `vpdpbusd`
//!   (a `fast` Q4_0 token-block's arithmetic): the share of the peak such tiles can reach;
//! - `large/layer/{precision}/n{n}`: one layer's seven matmuls over `n` rows, inputs
//!   quantized as the model does (q/k/v and gate/up share one input and one parallel
//!   region), cycling over a few distinct layers so the weights stream from DRAM;
//! - `large/head/{precision}/n{n}`: the LM head over `n` rows.
//!
//! The summary projects a forward of `n` fresh rows as 28 layers plus the head (the
//! attention and the norms are left out: at fresh rows they are a few percent), its ratio to
//! one row, a 64-token prefill, and decode against the bandwidth floor — all from this run.
//! `AMPLITUHEDRON_LARGE_ROWS=1,8` narrows the row counts (the whole group takes minutes).

use std::hint::black_box;

use amplituhedron::quant::{
    interleave_rows, matmul_many, GgmlType, QMatrix, QuantScratch, QuantizedInput,
};
use criterion::{Criterion, Throughput};

use super::{fastest, median, pool, random_weights, read_all, timed, Rng};

const HIDDEN: usize = 3584;
const FFN: usize = 18944;
const KV: usize = 512;
const VOCAB: usize = 152_064;
const LAYERS: usize = 28;
/// Distinct layers held in memory and cycled (131 MB each: together 12× the 32 MB L3).
const RESIDENT: usize = 3;
/// Row counts: decode and small batches, verify steps, and a 64-token prefill chunk.
const ROWS: [usize; 6] = [1, 2, 4, 8, 16, 64];
/// Rows of the prefill projection (its head runs on the last row only).
const PREFILL: usize = 64;
const LAYER_DTYPE: GgmlType = GgmlType::Q4_0;
const HEAD_DTYPE: GgmlType = GgmlType::Q8_0;

/// One layer's matrices as (rows, cols) in execution order: q, k, v, o, gate, up, down.
const LAYER: [(usize, usize); 7] = [
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (FFN, HIDDEN),
    (FFN, HIDDEN),
    (HIDDEN, FFN),
];

fn rows_measured() -> Vec<usize> {
    match std::env::var("AMPLITUHEDRON_LARGE_ROWS") {
        Ok(list) => list
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .filter(|n| ROWS.contains(n))
            .collect(),
        Err(_) => ROWS.to_vec(),
    }
}

/// Random blocks of `dtype` in the interleaved layout.
fn interleaved(dtype: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let plain = random_weights(dtype, rows, cols, rng);
    interleave_rows(dtype, rows, cols, &plain).expect("an interleavable format")
}

struct Weights {
    layers: Vec<Vec<Vec<u8>>>,
    head: Vec<u8>,
}

impl Weights {
    fn new(rng: &mut Rng) -> Self {
        let layers = (0..RESIDENT)
            .map(|_| {
                LAYER
                    .iter()
                    .map(|&(r, c)| interleaved(LAYER_DTYPE, r, c, rng))
                    .collect()
            })
            .collect();
        let head = interleaved(HEAD_DTYPE, VOCAB, HIDDEN, rng);
        Self { layers, head }
    }

    fn matrix(&self, layer: usize, i: usize) -> QMatrix<'_> {
        let (rows, cols) = LAYER[i];
        QMatrix::new_interleaved(LAYER_DTYPE, rows, cols, &self.layers[layer][i]).unwrap()
    }

    fn head(&self) -> QMatrix<'_> {
        QMatrix::new_interleaved(HEAD_DTYPE, VOCAB, HIDDEN, &self.head).unwrap()
    }
}

/// Bytes one decoded token streams: 28 layers and the head.
fn model_bytes() -> usize {
    let layer: usize = LAYER
        .iter()
        .map(|&(r, c)| r * LAYER_DTYPE.row_bytes(c).unwrap())
        .sum();
    LAYERS * layer + VOCAB * HEAD_DTYPE.row_bytes(HIDDEN).unwrap()
}

/// Multiply-accumulates of one row through 28 layers (and the head).
fn layer_macs() -> usize {
    LAYER.iter().map(|&(r, c)| r * c).sum()
}

/// Work buffers of a layer over up to `PREFILL` rows.
struct Buffers {
    scratch: QuantScratch,
    stacked: Vec<f32>,
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
    fn new(rng: &mut Rng) -> Self {
        let n = PREFILL;
        Self {
            scratch: QuantScratch::with_capacity(n, FFN),
            stacked: Vec::new(),
            x: rng.floats(n * HIDDEN),
            ffn_x: rng.floats(n * FFN),
            q: vec![0.0; n * HIDDEN],
            k: vec![0.0; n * KV],
            v: vec![0.0; n * KV],
            o: vec![0.0; n * HIDDEN],
            gate: vec![0.0; n * FFN],
            up: vec![0.0; n * FFN],
            down: vec![0.0; n * HIDDEN],
            logits: vec![0.0; 16 * VOCAB],
        }
    }
}

/// `x` (n rows) quantized at a precision, as the model's projections quantize it.
fn quantize<'a>(
    refined: bool,
    x: &'a [f32],
    n: usize,
    dtype: GgmlType,
    scratch: &'a mut QuantScratch,
    stacked: &'a mut Vec<f32>,
) -> QuantizedInput<'a> {
    let cols = x.len() / n;
    let residual = refined.then_some(stacked);
    QuantizedInput::quantize_for(x, n, cols, &[dtype], residual, scratch).unwrap()
}

/// The seven matmuls of layer `layer` over `n` rows (q/k/v and gate/up as one region each).
fn layer(w: &Weights, layer: usize, n: usize, refined: bool, b: &mut Buffers) {
    let m = |i: usize| w.matrix(layer, i);
    let (wq, wk, wv, wo, wg, wu, wd) = (m(0), m(1), m(2), m(3), m(4), m(5), m(6));
    let input = quantize(
        refined,
        &b.x[..n * HIDDEN],
        n,
        LAYER_DTYPE,
        &mut b.scratch,
        &mut b.stacked,
    );
    matmul_many(
        &mut [
            (&wq, &mut b.q[..n * HIDDEN]),
            (&wk, &mut b.k[..n * KV]),
            (&wv, &mut b.v[..n * KV]),
        ],
        &input,
    )
    .unwrap();
    let input = quantize(
        refined,
        &b.q[..n * HIDDEN],
        n,
        LAYER_DTYPE,
        &mut b.scratch,
        &mut b.stacked,
    );
    matmul_many(&mut [(&wo, &mut b.o[..n * HIDDEN])], &input).unwrap();
    let input = quantize(
        refined,
        &b.x[..n * HIDDEN],
        n,
        LAYER_DTYPE,
        &mut b.scratch,
        &mut b.stacked,
    );
    matmul_many(
        &mut [(&wg, &mut b.gate[..n * FFN]), (&wu, &mut b.up[..n * FFN])],
        &input,
    )
    .unwrap();
    let input = quantize(
        refined,
        &b.ffn_x[..n * FFN],
        n,
        LAYER_DTYPE,
        &mut b.scratch,
        &mut b.stacked,
    );
    matmul_many(&mut [(&wd, &mut b.down[..n * HIDDEN])], &input).unwrap();
    black_box(&b.down);
}

fn head(w: &Weights, n: usize, refined: bool, b: &mut Buffers) {
    let input = quantize(
        refined,
        &b.x[..n * HIDDEN],
        n,
        HEAD_DTYPE,
        &mut b.scratch,
        &mut b.stacked,
    );
    matmul_many(&mut [(&w.head(), &mut b.logits[..n * VOCAB])], &input).unwrap();
    black_box(&b.logits);
}

fn precision(refined: bool) -> &'static str {
    if refined {
        "refined"
    } else {
        "fast"
    }
}

/// `vpdpbusd` operations per second on one core: 12 independent accumulator chains, each
/// operation 16 lanes × 4 byte products.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn vnni_ops(iters: usize) -> u64 {
    use core::arch::x86_64::*;
    // Opaque inputs, and the sums kept in registers: a `black_box` of the sums inside the
    // loop stored and reloaded them every round, which made the chains latency-bound (half
    // the rate of a core with two 256-bit VNNI pipes: kernels measured "above the peak").
    let a = black_box(_mm512_set1_epi32(0x0102_0304));
    let b = black_box(_mm512_set1_epi32(0x0101_0101));
    let mut acc = [_mm512_setzero_si512(); 12];
    for _ in 0..black_box(iters) {
        for s in acc.iter_mut() {
            *s = _mm512_dpbusd_epi32(*s, a, b);
        }
    }
    let acc = black_box(acc);
    let mut sum = _mm512_setzero_si512();
    for s in acc {
        sum = _mm512_add_epi32(sum, s);
    }
    _mm512_reduce_add_epi32(sum) as u64
}

/// A `fast` token-block's arithmetic without its loads: 8 `vpdpbusd` and the canonical
/// term's two `vmulps` per round (`(dw·da)·isum`; the `vcvtdq2ps` and `vaddps` run on other
/// pipes). Against [`vnni_ops`] it shows what the multiplies take from the VNNI pipes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn vnni_term_ops(iters: usize) -> u64 {
    use core::arch::x86_64::*;
    let a = black_box(_mm512_set1_epi32(0x0102_0304));
    let b = black_box(_mm512_set1_epi32(0x0101_0101));
    let one = black_box(_mm512_set1_ps(1.0));
    let mut acc = [_mm512_setzero_si512(); 8];
    let mut f = [black_box(_mm512_set1_ps(1.0)); 2];
    for _ in 0..black_box(iters) {
        for s in acc.iter_mut() {
            *s = _mm512_dpbusd_epi32(*s, a, b);
        }
        for x in f.iter_mut() {
            *x = _mm512_mul_ps(*x, one);
        }
    }
    let (acc, f) = black_box((acc, f));
    let mut sum = _mm512_cvtps_epi32(_mm512_add_ps(f[0], f[1]));
    for s in acc {
        sum = _mm512_add_epi32(sum, s);
    }
    _mm512_reduce_add_epi32(sum) as u64
}

#[cfg(target_arch = "x86_64")]
fn has_vnni() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

/// Iterations of [`vnni_ops`] per call (12 operations each).
const VNNI_ITERS: usize = 1 << 16;

pub(super) fn large(c: &mut Criterion) {
    let mut rng = Rng(11);
    let pool2 = pool(2);
    let weights = Weights::new(&mut rng);
    let mut bufs = Buffers::new(&mut rng);
    let mut g = c.benchmark_group("large");
    let resident: usize =
        weights.layers.iter().flatten().map(Vec::len).sum::<usize>() + weights.head.len();
    g.throughput(Throughput::Bytes(resident as u64));
    g.bench_function("read/2t", |b| {
        timed(b, &pool2, "large/read", || {
            for l in &weights.layers {
                for m in l {
                    black_box(read_all(m));
                }
            }
            black_box(read_all(&weights.head));
        })
    });
    #[cfg(target_arch = "x86_64")]
    if has_vnni() {
        let pool1 = pool(1);
        g.throughput(Throughput::Elements((12 * VNNI_ITERS) as u64));
        g.bench_function("vnni_peak/1t", |b| {
            // SAFETY: the CPU has AVX-512 VNNI (checked above).
            timed(b, &pool1, "large/vnni", || {
                black_box(unsafe { vnni_ops(VNNI_ITERS) });
            })
        });
        g.throughput(Throughput::Elements((8 * VNNI_ITERS) as u64));
        g.bench_function("vnni_term/1t", |b| {
            // SAFETY: as above.
            timed(b, &pool1, "large/vnni_term", || {
                black_box(unsafe { vnni_term_ops(VNNI_ITERS) });
            })
        });
    }
    let mut next = 0;
    for refined in [false, true] {
        for n in rows_measured() {
            g.throughput(Throughput::Elements((layer_macs() * n) as u64));
            let id = format!("{}/n{n}", precision(refined));
            g.bench_function(format!("layer/{id}"), |b| {
                timed(b, &pool2, &format!("large/layer/{id}"), || {
                    layer(&weights, next, n, refined, &mut bufs);
                    next = (next + 1) % RESIDENT;
                })
            });
            if n <= 16 {
                g.throughput(Throughput::Elements((VOCAB * HIDDEN * n) as u64));
                g.bench_function(format!("head/{id}"), |b| {
                    timed(b, &pool2, &format!("large/head/{id}"), || {
                        head(&weights, n, refined, &mut bufs)
                    })
                });
            }
        }
    }
    g.finish();
}

/// The projections of this run (see the module docs).
pub(super) fn summary() {
    if median("large/read").is_nan() {
        return;
    }
    let bytes = model_bytes();
    let read = median("large/read");
    let resident: usize = RESIDENT
        * LAYER
            .iter()
            .map(|&(r, c)| r * LAYER_DTYPE.row_bytes(c).unwrap())
            .sum::<usize>()
        + VOCAB * HEAD_DTYPE.row_bytes(HIDDEN).unwrap();
    let read_gbs = resident as f64 / read / 1e9;
    let floor = bytes as f64 / (resident as f64 / read);
    println!(
        "\n==== large (7B shapes: Q4_0 layers, Q8_0 head, interleaved; {:.2} GB per token) ====",
        bytes as f64 / 1e9
    );
    let vnni = median("large/vnni");
    let peak_macs = if vnni.is_nan() {
        f64::NAN
    } else {
        // Two cores, 64 byte products per operation.
        2.0 * (12 * VNNI_ITERS) as f64 * 64.0 / vnni
    };
    println!(
        "read bandwidth (2 threads) {read_gbs:.1} GB/s -> decode floor {:.1} ms/token; VNNI peak (2 cores) {:.0} GMAC/s",
        floor * 1e3,
        peak_macs / 1e9
    );
    // The fraction of the peak left when every 8 `vpdpbusd` carry the term's 2 multiplies
    // (one token-block of a Q4_0 `fast` tile): the kernels' ceiling on this core.
    let term = median("large/vnni_term");
    if !term.is_nan() && !vnni.is_nan() {
        let per_op = |t: f64, ops: usize| t / (ops * VNNI_ITERS) as f64;
        println!(
            "8 vpdpbusd + the term's 2 vmulps per token-block: {:.0} % of the peak (the `fast` Q4_0 ceiling; `refined` runs 16 vpdpbusd per 2 vmulps)",
            100.0 * per_op(vnni, 12) / per_op(term, 8)
        );
    }
    let macs = layer_macs() as f64;
    for refined in [false, true] {
        let p = precision(refined);
        let forward = |n: usize, pick: fn(&str) -> f64| {
            let l = pick(&format!("large/layer/{p}/n{n}"));
            // A prefill chunk's head runs on its last row only.
            let head_rows = if n == PREFILL { 1 } else { n };
            let h = pick(&format!("large/head/{p}/n{head_rows}"));
            LAYERS as f64 * l + h
        };
        let one = forward(1, median);
        println!("{p}: forward of n fresh rows = 28 layers + head, median (fastest) ms, × one row, layer GMAC/s (% of VNNI peak, one plane):");
        for n in rows_measured() {
            let (m, f) = (forward(n, median), forward(n, fastest));
            let l = median(&format!("large/layer/{p}/n{n}"));
            let rate = macs * n as f64 / l;
            println!(
                "  n={n:<3} {:>8.1} ({:>8.1}) ms  {:>5.2}x  layer {:>6.2} ms {:>6.1} GMAC/s ({:>4.1} %)",
                m * 1e3,
                f * 1e3,
                m / one,
                l * 1e3,
                rate / 1e9,
                100.0 * rate / peak_macs
            );
        }
        if !one.is_nan() {
            println!(
                "  decode: {:.1} ms/token against the {:.1} ms floor ({:.1} % of the floor's speed)",
                one * 1e3,
                floor * 1e3,
                100.0 * floor / one
            );
        }
    }
}
