//! Unit tests of the formats and kernels: dequantization of hand-built blocks, round trips,
//! accuracy against an f64 reference within the derived activation-quantization bound,
//! bit-exactness of every SIMD kernel against the scalar one, batch and thread-count
//! invariance, and error handling.

use super::*;

/// SplitMix64: a small deterministic generator, so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn floats(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

fn f16_le(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Random weights: quantized from random floats for even seeds (what real weights look
/// like), raw random codes with random finite scales for odd ones (every code value,
/// including Q8_0's −128 which the quantizer never emits).
fn random_weights(dtype: GgmlType, rows: usize, cols: usize, rng: &mut Rng, raw: bool) -> Vec<u8> {
    if !raw || !dtype.is_quantized() {
        let src = rng.floats(rows * cols, 0.5);
        return quantize_weights(dtype, &src, cols).unwrap();
    }
    let mut data = rng.bytes(rows * dtype.row_bytes(cols).unwrap());
    for blk in data.chunks_exact_mut(dtype.block_bytes()) {
        blk[..2].copy_from_slice(&f16_le(rng.unit() * 0.05));
        if dtype == GgmlType::Q4_1 {
            blk[2..4].copy_from_slice(&f16_le(rng.unit() * 0.2));
        }
    }
    data
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn run(kernel: Kernel, w: &QMatrix<'_>, x: &[f32], n: usize) -> Vec<f32> {
    let mut scratch = QuantScratch::new();
    let input = QuantizedInput::quantize(x, n, w.cols(), &mut scratch).unwrap();
    let mut out = vec![f32::NAN; n * w.rows()];
    matmul_with_kernel(kernel, w, &input, &mut out).unwrap();
    out
}

#[test]
fn type_ids_and_layouts_match_ggml() {
    let expected = [
        (0, GgmlType::F32, 1, 4),
        (1, GgmlType::F16, 1, 2),
        (2, GgmlType::Q4_0, 32, 18),
        (3, GgmlType::Q4_1, 32, 20),
        (8, GgmlType::Q8_0, 32, 34),
    ];
    for (id, t, block, bytes) in expected {
        assert_eq!(GgmlType::from_id(id).unwrap(), t);
        assert_eq!(t.id(), id);
        assert_eq!((t.block_size(), t.block_bytes()), (block, bytes));
    }
    for bad in [4, 5, 6, 7, 9, 10, 30, u32::MAX] {
        assert_eq!(
            GgmlType::from_id(bad),
            Err(QuantError::UnsupportedType { id: bad })
        );
    }
    assert_eq!(GgmlType::Q4_1.row_bytes(576).unwrap(), 360);
    assert_eq!(GgmlType::Q8_0.row_bytes(576).unwrap(), 612);
}

#[test]
fn hand_built_q4_0_block() {
    // d = 0.5; code j in the low nibble (element j), 15 − j in the high nibble (j + 16).
    let mut blk = f16_le(0.5).to_vec();
    blk.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let m = QMatrix::new(GgmlType::Q4_0, 1, 32, &blk).unwrap();
    let got = m.dequantize();
    for j in 0..16 {
        assert_eq!(got[j], (j as f32 - 8.0) * 0.5);
        assert_eq!(got[j + 16], ((15 - j) as f32 - 8.0) * 0.5);
    }
}

#[test]
fn hand_built_q4_1_block() {
    // d = 0.25, m = −1.5: value q·d + m.
    let mut blk = f16_le(0.25).to_vec();
    blk.extend(f16_le(-1.5));
    blk.extend((0..16u8).map(|j| (15 - j) | (j << 4)));
    let m = QMatrix::new(GgmlType::Q4_1, 1, 32, &blk).unwrap();
    let got = m.dequantize();
    for j in 0..16 {
        assert_eq!(got[j], (15 - j) as f32 * 0.25 - 1.5);
        assert_eq!(got[j + 16], j as f32 * 0.25 - 1.5);
    }
}

#[test]
fn hand_built_q8_0_block() {
    let mut blk = f16_le(0.125).to_vec();
    let codes: Vec<i8> = (0..32).map(|j| (j as i8 - 16) * 8).collect(); // −128 ..= 120
    blk.extend(codes.iter().map(|&q| q as u8));
    let m = QMatrix::new(GgmlType::Q8_0, 1, 32, &blk).unwrap();
    let got = m.dequantize();
    for (g, &q) in got.iter().zip(&codes) {
        assert_eq!(*g, q as f32 * 0.125);
    }
    assert_eq!(got[0], -16.0);
}

#[test]
fn hand_built_float_rows() {
    let vals = [1.5f32, -2.25, 0.0, 65504.0, -1e-3];
    let f32_bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let m = QMatrix::new(GgmlType::F32, 1, 5, &f32_bytes).unwrap();
    assert_eq!(m.dequantize(), vals);
    let f16_bytes: Vec<u8> = vals.iter().flat_map(|&v| f16_le(v)).collect();
    let m = QMatrix::new(GgmlType::F16, 1, 5, &f16_bytes).unwrap();
    let expected: Vec<f32> = vals
        .iter()
        .map(|&v| half::f16::from_f32(v).to_f32())
        .collect();
    assert_eq!(m.dequantize(), expected);
}

#[test]
fn quantize_dequantize_round_trip_within_format_error() {
    let mut rng = Rng(1);
    let cols = 96;
    let src = rng.floats(4 * cols, 2.0);
    for dtype in GgmlType::ALL {
        let data = quantize_weights(dtype, &src, cols).unwrap();
        let m = QMatrix::new(dtype, 4, cols, &data).unwrap();
        let back = m.dequantize();
        for (blk_src, blk_back) in src.chunks(32).zip(back.chunks(32)) {
            let amax = blk_src.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let (lo, hi) = blk_src
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            // Half a quantization step, plus the f16 rounding of the scale(s) times the
            // largest code (f16 has an 11-bit significand). Q4_0 maps the extreme value to
            // −8, so the opposite side clips at +7 steps: up to a whole step d = amax/8.
            let tol = match dtype {
                GgmlType::F32 => 0.0,
                GgmlType::F16 => amax * 2f32.powi(-11),
                GgmlType::Q4_0 => amax / 8.0 + amax * 2f32.powi(-10),
                GgmlType::Q4_1 => (hi - lo) / 15.0 * 0.5 + (hi - lo + lo.abs()) * 2f32.powi(-10),
                GgmlType::Q8_0 => amax / 127.0 * 0.5 + amax * 2f32.powi(-10),
            };
            for (a, b) in blk_src.iter().zip(blk_back) {
                assert!((a - b).abs() <= tol, "{dtype}: {a} vs {b} (tol {tol})");
            }
        }
    }
}

#[test]
fn activation_quantization_is_within_half_a_step() {
    let mut rng = Rng(2);
    let x = rng.floats(3 * 64, 3.0);
    let mut scratch = QuantScratch::new();
    let input = QuantizedInput::quantize(&x, 3, 64, &mut scratch).unwrap();
    let deq = input.dequantized().unwrap();
    for (xb, qb) in x.chunks(32).zip(deq.chunks(32)) {
        let d = xb.iter().fold(0.0f32, |a, v| a.max(v.abs())) / 127.0;
        for (a, b) in xb.iter().zip(qb) {
            assert!((a - b).abs() <= d * 0.5001, "{a} vs {b}");
        }
        // The largest magnitude is represented exactly up to rounding of d.
        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let qmax = qb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        assert!((amax - qmax).abs() <= amax * 1e-6);
    }
    // All-zero blocks quantize to zero without dividing by zero.
    let zeros = vec![0.0f32; 32];
    let input = QuantizedInput::quantize(&zeros, 1, 32, &mut scratch).unwrap();
    assert_eq!(input.dequantized().unwrap(), zeros);
}

#[test]
fn activation_quantization_is_identical_under_every_isa() {
    let mut rng = Rng(11);
    let blocks = 300;
    let mut x = rng.floats(blocks * 32, 50.0);
    // Edge cases: an all-zero block, a tiny-scale block, non-finite blocks, exact ties.
    x[32..64].fill(0.0);
    x[64..96].iter_mut().for_each(|v| *v *= 1e-30);
    x[96] = f32::NAN;
    x[130] = f32::NEG_INFINITY;
    x[192..224].fill(f32::NAN);
    for (i, v) in x[160..192].iter_mut().enumerate() {
        *v = i as f32 - 15.5;
    }
    let run = |kernel: Kernel| {
        let (mut qs, mut d, mut s, mut sum) = (
            vec![0i8; x.len()],
            vec![0.0f32; blocks],
            vec![0.0f32; blocks],
            vec![0i32; blocks],
        );
        activation::quantize_blocks(kernel, &x, &mut qs, &mut d, &mut s, &mut sum);
        (qs, bits(&d), bits(&s), sum)
    };
    let reference = run(Kernel::Scalar);
    for kernel in Kernel::available() {
        assert!(run(kernel) == reference, "{kernel}");
    }
}

#[test]
fn activation_rounding_is_ties_to_even() {
    // max |x| = 127 makes d = 1 and 1/d = 1, so q is x rounded.
    let mut x = vec![0.0f32; 32];
    let cases = [
        (127.0, 127),
        (-127.0, -127),
        (0.5, 0),
        (1.5, 2),
        (2.5, 2),
        (-0.5, 0),
        (-1.5, -2),
        (-2.5, -2),
        (3.499_999_8, 3),
        (-126.5, -126),
        (0.0, 0),
    ];
    for (i, &(v, _)) in cases.iter().enumerate() {
        x[i] = v;
    }
    let mut scratch = QuantScratch::new();
    let input = QuantizedInput::quantize(&x, 1, 32, &mut scratch).unwrap();
    let blocks = input.blocks().unwrap();
    assert_eq!(blocks.scale[0], 1.0);
    for (i, &(v, q)) in cases.iter().enumerate() {
        assert_eq!(blocks.qs[i], q, "round({v})");
    }
    let sum: i32 = cases.iter().map(|&(_, q)| q as i32).sum();
    assert_eq!(blocks.qsum[0], sum);
    assert_eq!(blocks.scaled_sum[0], sum as f32);
}

/// Max |out − reference| allowed for one output element: the activation quantization error
/// `Σ_b (d_b / 2)·Σ_{i∈b} |w_i|` (each element is off by at most half a step `d_b`), plus
/// f32 rounding of `nb + 4` dependent operations on terms bounded by `Σ |w_i|·(|x_i| + d_b)`.
fn error_bound(w_row: &[f32], x: &[f32], quantized: bool) -> f64 {
    let mut act = 0.0f64;
    let mut magnitude = 0.0f64;
    for (wb, xb) in w_row.chunks(32).zip(x.chunks(32)) {
        let d = if quantized {
            xb.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64 / 127.0
        } else {
            0.0
        };
        let wsum: f64 = wb.iter().map(|v| v.abs() as f64).sum();
        act += d / 2.0 * wsum;
        magnitude += wb
            .iter()
            .zip(xb)
            .map(|(w, v)| w.abs() as f64 * (v.abs() as f64 + d))
            .sum::<f64>();
    }
    let steps = (w_row.len() / 16 + 8) as f64;
    act + steps * f32::EPSILON as f64 * magnitude
}

#[test]
fn matmul_matches_f64_reference_within_the_derived_bound() {
    let mut rng = Rng(3);
    let (rows, cols, n) = (37, 576, 5);
    for dtype in GgmlType::ALL {
        for raw in [false, true] {
            let data = random_weights(dtype, rows, cols, &mut rng, raw);
            let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
            let wf = w.dequantize();
            let x = rng.floats(n * cols, 2.0);
            for kernel in Kernel::available() {
                let out = run(kernel, &w, &x, n);
                let mut worst = 0.0f64;
                for t in 0..n {
                    let xt = &x[t * cols..(t + 1) * cols];
                    for r in 0..rows {
                        let wr = &wf[r * cols..(r + 1) * cols];
                        let exact: f64 =
                            wr.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let bound = error_bound(wr, xt, dtype.is_quantized());
                        let err = (out[t * rows + r] as f64 - exact).abs();
                        assert!(
                            err <= bound,
                            "{dtype} {kernel}: t={t} r={r} err {err} > {bound}"
                        );
                        worst = worst.max(err / bound.max(f64::MIN_POSITIVE));
                    }
                }
                // The bound is not vacuous: real errors reach a visible fraction of it.
                if dtype.is_quantized() {
                    assert!(worst > 0.01, "{dtype} {kernel}: worst/bound = {worst}");
                }
            }
        }
    }
}

#[test]
fn quantized_matmul_equals_dequantized_times_dequantized_activations() {
    // With the activations replaced by their own quantization, only f32 rounding remains.
    let mut rng = Rng(4);
    let (rows, cols, n) = (16, 128, 3);
    for dtype in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let data = random_weights(dtype, rows, cols, &mut rng, true);
        let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
        let wf = w.dequantize();
        let x = rng.floats(n * cols, 1.0);
        let mut scratch = QuantScratch::new();
        let input = QuantizedInput::quantize(&x, n, cols, &mut scratch).unwrap();
        let xq = input.dequantized().unwrap();
        let mut out = vec![0.0; n * rows];
        matmul(&w, &input, &mut out).unwrap();
        for t in 0..n {
            for r in 0..rows {
                let wr = &wf[r * cols..(r + 1) * cols];
                let xt = &xq[t * cols..(t + 1) * cols];
                let exact: f64 = wr.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = wr
                    .iter()
                    .zip(xt)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                let err = (out[t * rows + r] as f64 - exact).abs();
                assert!(
                    err <= 16.0 * f32::EPSILON as f64 * mag + 1e-30,
                    "{dtype}: {err} vs {mag}"
                );
            }
        }
    }
}

#[test]
fn every_simd_kernel_is_bit_identical_to_scalar() {
    let mut rng = Rng(5);
    let shapes = [
        (1, 32),
        (7, 64),
        (16, 96),
        (37, 576),
        (67, 1536),
        (24, 40),
        (19, 17),
    ];
    for dtype in GgmlType::ALL {
        for &(rows, cols) in &shapes {
            if cols % dtype.block_size() != 0 {
                continue;
            }
            for raw in [false, true] {
                let data = random_weights(dtype, rows, cols, &mut rng, raw);
                let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
                for n in [1, 2, 3, 5, 8, 13] {
                    let x = rng.floats(n * cols, 4.0);
                    let reference = bits(&run(Kernel::Scalar, &w, &x, n));
                    for kernel in Kernel::available() {
                        assert_eq!(
                            bits(&run(kernel, &w, &x, n)),
                            reference,
                            "{dtype} {kernel} rows={rows} cols={cols} n={n} raw={raw}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn this_cpu_tests_every_kernel_it_has() {
    let available = Kernel::available();
    assert_eq!(available[0], Kernel::Scalar);
    assert_eq!(Kernel::detect(), *available.last().unwrap());
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512bw") {
        assert_eq!(available, Kernel::ALL.to_vec());
    }
}

/// Output rows of one token computed alone.
fn single(kernel: Kernel, w: &QMatrix<'_>, x: &[f32], t: usize) -> Vec<u32> {
    let cols = w.cols();
    bits(&run(kernel, w, &x[t * cols..(t + 1) * cols], 1))
}

#[test]
fn batch_invariance_any_size_position_and_thread_count() {
    let mut rng = Rng(6);
    // 53 rows: 3 SIMD groups of 16 plus a tail; 96 columns: 3 blocks.
    let (rows, cols) = (53, 96);
    let pools: Vec<rayon::ThreadPool> = [1, 2]
        .iter()
        .map(|&n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap()
        })
        .collect();
    for dtype in GgmlType::ALL {
        let data = random_weights(dtype, rows, cols, &mut rng, true);
        let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
        let x = rng.floats(256 * cols, 3.0);
        for kernel in Kernel::available() {
            let alone: Vec<Vec<u32>> = (0..256).map(|t| single(kernel, &w, &x, t)).collect();
            for n in [1, 3, 7, 64, 256] {
                for pool in &pools {
                    let out = pool.install(|| run(kernel, &w, &x[..n * cols], n));
                    for t in 0..n {
                        assert_eq!(
                            bits(&out[t * rows..(t + 1) * rows]),
                            alone[t],
                            "{dtype} {kernel} n={n} t={t}"
                        );
                    }
                }
            }
            // Same tokens in another order (every token at another position and tile slot).
            let n = 64;
            let order: Vec<usize> = (0..n).map(|i| (i * 37 + 11) % n).collect();
            let shuffled: Vec<f32> = order
                .iter()
                .flat_map(|&t| x[t * cols..(t + 1) * cols].to_vec())
                .collect();
            let out = pools[1].install(|| run(kernel, &w, &shuffled, n));
            for (pos, &t) in order.iter().enumerate() {
                assert_eq!(
                    bits(&out[pos * rows..(pos + 1) * rows]),
                    alone[t],
                    "{dtype} {kernel} shuffled"
                );
            }
        }
    }
}

#[test]
fn big_matrices_split_over_threads_stay_bit_identical() {
    // Large enough to take the parallel split (rows and tokens), compared with one thread.
    let mut rng = Rng(7);
    let (rows, cols) = (1536, 576);
    let data = random_weights(GgmlType::Q4_1, rows, cols, &mut rng, false);
    let w = QMatrix::new(GgmlType::Q4_1, rows, cols, &data).unwrap();
    let x = rng.floats(40 * cols, 1.0);
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let three = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for n in [1, 40] {
        let a = one.install(|| run(Kernel::detect(), &w, &x[..n * cols], n));
        let b = three.install(|| run(Kernel::detect(), &w, &x[..n * cols], n));
        assert_eq!(bits(&a), bits(&b), "n={n}");
    }
}

#[test]
fn one_input_serves_several_matrices() {
    let mut rng = Rng(8);
    let cols = 64;
    let x = rng.floats(2 * cols, 1.0);
    let mut scratch = QuantScratch::with_capacity(2, cols);
    let input = QuantizedInput::quantize(&x, 2, cols, &mut scratch).unwrap();
    for (dtype, rows) in [
        (GgmlType::Q4_1, 24),
        (GgmlType::Q8_0, 8),
        (GgmlType::F16, 5),
    ] {
        let data = random_weights(dtype, rows, cols, &mut rng, false);
        let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
        let mut shared = vec![0.0; 2 * rows];
        matmul(&w, &input, &mut shared).unwrap();
        let mut s2 = QuantScratch::new();
        let mut fresh = vec![0.0; 2 * rows];
        matmul_f32(&w, &x, 2, &mut fresh, &mut s2).unwrap();
        assert_eq!(bits(&shared), bits(&fresh));
    }
}

#[test]
fn non_finite_activations_poison_their_outputs() {
    let mut rng = Rng(9);
    let (rows, cols) = (16, 64);
    let data = random_weights(GgmlType::Q4_1, rows, cols, &mut rng, false);
    let w = QMatrix::new(GgmlType::Q4_1, rows, cols, &data).unwrap();
    let mut x = rng.floats(2 * cols, 1.0);
    x[cols + 40] = f32::INFINITY;
    for kernel in Kernel::available() {
        let out = run(kernel, &w, &x, 2);
        assert!(out[..rows].iter().all(|v| v.is_finite()));
        assert!(out[rows..].iter().all(|v| v.is_nan()), "{kernel}");
    }
}

#[test]
fn embed_gathers_dequantized_rows() {
    let mut rng = Rng(10);
    let (rows, cols) = (50, 64);
    let data = random_weights(GgmlType::Q8_0, rows, cols, &mut rng, true);
    let w = QMatrix::new(GgmlType::Q8_0, rows, cols, &data).unwrap();
    let all = w.dequantize();
    let ids = [3u32, 0, 49, 3];
    let mut out = vec![0.0; ids.len() * cols];
    w.embed(&ids, &mut out).unwrap();
    for (i, &id) in ids.iter().enumerate() {
        let id = id as usize;
        assert_eq!(
            out[i * cols..(i + 1) * cols],
            all[id * cols..(id + 1) * cols]
        );
        let mut row = vec![0.0; cols];
        w.dequantize_row(id, &mut row).unwrap();
        assert_eq!(row, all[id * cols..(id + 1) * cols]);
    }
    let before = out.clone();
    assert_eq!(
        w.embed(&[1, 50], &mut out[..2 * cols]),
        Err(QuantError::RowOutOfRange { row: 50, rows: 50 })
    );
    assert_eq!(out, before, "a failed embed writes nothing");
    assert_eq!(
        w.embed(&[1], &mut out[..cols + 1]),
        Err(QuantError::OutputLength {
            expected: cols,
            actual: cols + 1
        })
    );
    assert!(w.dequantize_row(50, &mut out[..cols]).is_err());
}

#[test]
fn from_gguf_reads_ggml_dims() {
    let data = vec![0u8; 6 * 20];
    let m = QMatrix::from_gguf(3, &[32, 6], &data).unwrap();
    assert_eq!((m.dtype(), m.rows(), m.cols()), (GgmlType::Q4_1, 6, 32));
    let m = QMatrix::from_gguf(3, &[32, 2, 3], &data).unwrap();
    assert_eq!((m.rows(), m.cols()), (6, 32));
    let norm = vec![0u8; 4 * 576];
    let m = QMatrix::from_gguf(0, &[576], &norm).unwrap();
    assert_eq!((m.dtype(), m.rows(), m.cols()), (GgmlType::F32, 1, 576));
    assert_eq!(
        QMatrix::from_gguf(12, &[256, 6], &data).unwrap_err(),
        QuantError::UnsupportedType { id: 12 }
    );
    assert!(matches!(
        QMatrix::from_gguf(3, &[], &data),
        Err(QuantError::EmptyShape { .. })
    ));
    assert_eq!(
        QMatrix::from_gguf(3, &[32, u64::MAX, 2], &data).unwrap_err(),
        QuantError::ShapeOverflow
    );
}

#[test]
fn bad_shapes_are_clear_errors() {
    let data = vec![0u8; 2 * 20];
    assert_eq!(
        QMatrix::new(GgmlType::Q4_1, 2, 33, &data).unwrap_err(),
        QuantError::ColsNotBlockMultiple {
            dtype: GgmlType::Q4_1,
            cols: 33,
            block_size: 32
        }
    );
    let err = QMatrix::new(GgmlType::Q4_1, 3, 32, &data).unwrap_err();
    assert_eq!(
        err,
        QuantError::DataLength {
            dtype: GgmlType::Q4_1,
            rows: 3,
            cols: 32,
            expected: 60,
            actual: 40
        }
    );
    assert_eq!(
        err.to_string(),
        "a (3, 32) Q4_1 matrix has 60 bytes, got 40"
    );
    assert!(matches!(
        QMatrix::new(GgmlType::Q4_1, 0, 32, &[]),
        Err(QuantError::EmptyShape { .. })
    ));
    assert_eq!(
        QMatrix::new(GgmlType::Q8_0, usize::MAX / 2, 64, &data).unwrap_err(),
        QuantError::ShapeOverflow
    );
    assert!(quantize_weights(GgmlType::Q8_0, &[0.0; 40], 32).is_err());

    let w = QMatrix::new(GgmlType::Q4_1, 2, 32, &data).unwrap();
    let mut scratch = QuantScratch::new();
    assert!(matches!(
        QuantizedInput::quantize(&[0.0; 63], 2, 32, &mut scratch),
        Err(QuantError::InputLength {
            expected: 64,
            actual: 63,
            ..
        })
    ));
    assert!(matches!(
        QuantizedInput::quantize(&[], 0, 32, &mut scratch),
        Err(QuantError::EmptyShape { .. })
    ));
    let x64 = [1.0f32; 64];
    let input = QuantizedInput::quantize(&x64, 1, 64, &mut scratch).unwrap();
    let mut out = vec![7.0f32; 2];
    assert_eq!(
        matmul(&w, &input, &mut out),
        Err(QuantError::ColsMismatch {
            weight_cols: 32,
            input_cols: 64
        })
    );
    let input = QuantizedInput::quantize(&x64, 2, 32, &mut scratch).unwrap();
    let mut short = vec![7.0f32; 3];
    assert_eq!(
        matmul(&w, &input, &mut short),
        Err(QuantError::OutputLength {
            expected: 4,
            actual: 3
        })
    );
    assert_eq!(short, [7.0; 3], "a failed matmul writes nothing");
    // An input whose cols is not a multiple of 32 works with float weights only.
    let wf32 = vec![0u8; 3 * 4 * 20];
    let m = QMatrix::new(GgmlType::F32, 3, 20, &wf32).unwrap();
    let input = QuantizedInput::quantize(&[1.0; 40], 2, 20, &mut scratch).unwrap();
    assert!(input.dequantized().is_none());
    let mut out = vec![1.0; 6];
    matmul(&m, &input, &mut out).unwrap();
    assert_eq!(out, [0.0; 6]);
}

#[test]
fn scratch_is_reused_without_reallocation() {
    let mut scratch = QuantScratch::with_capacity(4, 576);
    let x = vec![0.5f32; 4 * 576];
    let ptr = {
        let input = QuantizedInput::quantize(&x, 4, 576, &mut scratch).unwrap();
        input.f32_rows().as_ptr()
    };
    let before = scratch.qs.as_ptr();
    for n in [1, 4, 2] {
        QuantizedInput::quantize(&x[..n * 576], n, 576, &mut scratch).unwrap();
        assert_eq!(scratch.qs.as_ptr(), before);
    }
    assert_eq!(ptr, x.as_ptr());
}
