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

/// Offsets of the f16 scale fields (`d`, and `m`/`dmin` where the format has one) in a block.
fn scale_offsets(dtype: GgmlType) -> &'static [usize] {
    match dtype {
        GgmlType::F32 | GgmlType::F16 => &[],
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
    }
}

/// Random weights: quantized from random floats for `raw == false` (what real weights look
/// like), raw random codes and sub-block scales with random finite f16 scales otherwise
/// (every code value, including Q8_0's −128 which the quantizer never emits, and every
/// k-quant group scale and min).
fn random_weights(dtype: GgmlType, rows: usize, cols: usize, rng: &mut Rng, raw: bool) -> Vec<u8> {
    if !raw || !dtype.is_quantized() {
        let src = rng.floats(rows * cols, 0.5);
        return quantize_weights(dtype, &src, cols).unwrap();
    }
    let mut data = rng.bytes(rows * dtype.row_bytes(cols).unwrap());
    // k-quant scales multiply 6- or 8-bit group scales: keep products of the same size.
    let magnitude = if dtype.is_k_quant() { 0.002 } else { 0.05 };
    for blk in data.chunks_exact_mut(dtype.block_bytes()) {
        for (k, &o) in scale_offsets(dtype).iter().enumerate() {
            let v = rng.unit() * if k == 0 { magnitude } else { 4.0 * magnitude };
            blk[o..o + 2].copy_from_slice(&f16_le(v));
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

/// The refined product's rows as the kernels write them: `n` (16-bit codes, float weights),
/// or `2n` for a k-quant (value rows, then residual rows, unfolded).
fn run_refined(kernel: Kernel, w: &QMatrix<'_>, x: &[f32], n: usize) -> Vec<f32> {
    let mut scratch = QuantScratch::new();
    let mut stacked = Vec::new();
    let input =
        QuantizedInput::quantize_refined(x, n, w.cols(), &mut stacked, &mut scratch).unwrap();
    let tokens = input.product_tokens(w.dtype());
    assert_eq!(tokens, if w.dtype().is_k_quant() { 2 * n } else { n });
    let mut out = vec![f32::NAN; tokens * w.rows()];
    matmul_with_kernel(kernel, w, &input, &mut out).unwrap();
    out
}

/// The refined product folded to `n` rows, as the model uses it.
fn run_refined_folded(kernel: Kernel, w: &QMatrix<'_>, x: &[f32], n: usize) -> Vec<f32> {
    let full = run_refined(kernel, w, x, n);
    if full.len() == n * w.rows() {
        return full;
    }
    let mut out = vec![f32::NAN; n * w.rows()];
    fold_refined(&full, &mut out);
    out
}

#[test]
fn type_ids_and_layouts_match_ggml() {
    let expected = [
        (0, GgmlType::F32, 1, 4),
        (1, GgmlType::F16, 1, 2),
        (2, GgmlType::Q4_0, 32, 18),
        (3, GgmlType::Q4_1, 32, 20),
        (6, GgmlType::Q5_0, 32, 22),
        (7, GgmlType::Q5_1, 32, 24),
        (8, GgmlType::Q8_0, 32, 34),
        (10, GgmlType::Q2_K, 256, 84),
        (11, GgmlType::Q3_K, 256, 110),
        (12, GgmlType::Q4_K, 256, 144),
        (13, GgmlType::Q5_K, 256, 176),
        (14, GgmlType::Q6_K, 256, 210),
    ];
    assert_eq!(expected.len(), GgmlType::ALL.len());
    for (id, t, block, bytes) in expected {
        assert_eq!(GgmlType::from_id(id).unwrap(), t);
        assert_eq!(t.id(), id);
        assert_eq!((t.block_size(), t.block_bytes()), (block, bytes));
        assert_eq!(t.is_k_quant(), block == 256);
        assert_eq!(format!("{t:?}"), t.name());
    }
    for bad in [4, 5, 9, 15, 16, 17, 30, 39, 42, 43, u32::MAX] {
        assert_eq!(
            GgmlType::from_id(bad),
            Err(QuantError::UnsupportedType { id: bad })
        );
    }
    assert_eq!(GgmlType::Q4_1.row_bytes(576).unwrap(), 360);
    assert_eq!(GgmlType::Q8_0.row_bytes(576).unwrap(), 612);
    assert_eq!(GgmlType::Q4_K.row_bytes(2048).unwrap(), 8 * 144);
    // SUPPORTED_TYPES lists exactly ALL, in order.
    let listed: Vec<String> = GgmlType::ALL
        .iter()
        .map(|t| format!("{}={}", t.name(), t.id()))
        .collect();
    assert_eq!(SUPPORTED_TYPES, listed.join(", "));
}

#[test]
fn every_ggml_type_id_has_its_name_in_refusals() {
    assert_eq!(ggml_type_name(17), Some("IQ2_XS"));
    assert_eq!(ggml_type_name(30), Some("BF16"));
    assert_eq!(ggml_type_name(15), Some("Q8_K"));
    assert_eq!(ggml_type_name(42), Some("Q2_0"));
    assert_eq!(ggml_type_name(43), None);
    let names: Vec<&str> = (0..43).map(|id| ggml_type_name(id).unwrap()).collect();
    let mut unique = names.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), names.len(), "names are distinct");
    let err = QuantError::UnsupportedType { id: 17 }.to_string();
    assert!(
        err.starts_with("unsupported tensor type IQ2_XS (ggml type id 17; supported: F32=0"),
        "{err}"
    );
    assert_eq!(
        unsupported_type_message(17, Some("blk.3.ffn_down.weight"))
            .split(" (")
            .next(),
        Some("unsupported tensor type IQ2_XS in blk.3.ffn_down.weight")
    );
    assert!(QuantError::UnsupportedType { id: 99 }
        .to_string()
        .starts_with("unknown ggml type id 99 (supported: "));
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
    for dtype in GgmlType::ALL.into_iter().filter(|t| !t.is_k_quant()) {
        let data = quantize_weights(dtype, &src, cols).unwrap();
        let m = QMatrix::new(dtype, 4, cols, &data).unwrap();
        let back = m.dequantize();
        for (blk_src, blk_back) in src.chunks(32).zip(back.chunks(32)) {
            let amax = blk_src.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let (lo, hi) = blk_src
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            // Half a quantization step, plus the f16 rounding of the scale(s) times the
            // largest code (f16 has an 11-bit significand). Q4_0/Q5_0 map the extreme value to
            // the lowest code, so the opposite side clips one step short: up to a whole step.
            let f16_err = |v: f32| v * 2f32.powi(-10);
            let tol = match dtype {
                GgmlType::F32 => 0.0,
                GgmlType::F16 => amax * 2f32.powi(-11),
                GgmlType::Q4_0 => amax / 8.0 + f16_err(amax),
                GgmlType::Q5_0 => amax / 16.0 + f16_err(amax),
                GgmlType::Q4_1 => (hi - lo) / 15.0 * 0.5 + f16_err(hi - lo + lo.abs()),
                GgmlType::Q5_1 => (hi - lo) / 31.0 * 0.5 + f16_err(hi - lo + lo.abs()),
                GgmlType::Q8_0 => amax / 127.0 * 0.5 + f16_err(amax),
                _ => unreachable!(),
            };
            for (a, b) in blk_src.iter().zip(blk_back) {
                assert!((a - b).abs() <= tol, "{dtype}: {a} vs {b} (tol {tol})");
            }
        }
    }
}

#[test]
fn k_quant_round_trip_error_shrinks_with_the_bits() {
    // RMS error relative to the RMS of the weights, for Gaussian-like weights with a few
    // outliers: each extra bit should roughly halve it. Bounds: about 1.3× what the simple
    // quantizer measures (0.35, 0.18, 0.084, 0.042, 0.022), below the next-coarser format's.
    let mut rng = Rng(12);
    let cols = 1024;
    let mut src: Vec<f32> = (0..8 * cols)
        .map(|_| (rng.unit() + rng.unit() + rng.unit()) * 0.02)
        .collect();
    for i in (0..src.len()).step_by(397) {
        src[i] *= 8.0;
    }
    let rms = |v: &mut dyn Iterator<Item = f32>| {
        let (sum, n) = v.fold((0.0f64, 0usize), |(s, n), x| {
            (s + (x as f64).powi(2), n + 1)
        });
        (sum / n as f64).sqrt()
    };
    let signal = rms(&mut src.iter().copied());
    let mut previous = f64::INFINITY;
    for (dtype, bound) in [
        (GgmlType::Q2_K, 0.45),
        (GgmlType::Q3_K, 0.25),
        (GgmlType::Q4_K, 0.11),
        (GgmlType::Q5_K, 0.055),
        (GgmlType::Q6_K, 0.03),
    ] {
        let data = quantize_weights(dtype, &src, cols).unwrap();
        assert_eq!(data.len(), 8 * dtype.row_bytes(cols).unwrap());
        let back = QMatrix::new(dtype, 8, cols, &data).unwrap().dequantize();
        let err = rms(&mut src.iter().zip(&back).map(|(a, b)| a - b)) / signal;
        assert!(err < bound, "{dtype}: relative RMS error {err} >= {bound}");
        assert!(err < 0.75 * previous, "{dtype}: {err} vs {previous}");
        previous = err;
    }
}

#[test]
fn hand_built_q5_0_and_q5_1_blocks() {
    // Codes u_j = j (0..31): the 5th bit of element j is bit j of qh.
    let qh: u32 = (0..32u32).filter(|j| j & 16 != 0).map(|j| 1 << j).sum();
    let qs: Vec<u8> = (0..16u8).map(|j| j | (j << 4)).collect();
    let mut q5_0 = f16_le(0.5).to_vec();
    q5_0.extend(qh.to_le_bytes());
    q5_0.extend(&qs);
    let got = QMatrix::new(GgmlType::Q5_0, 1, 32, &q5_0)
        .unwrap()
        .dequantize();
    for (j, v) in got.iter().enumerate() {
        assert_eq!(*v, (j as f32 - 16.0) * 0.5, "element {j}");
    }
    let mut q5_1 = f16_le(0.25).to_vec();
    q5_1.extend(f16_le(-3.0));
    q5_1.extend(qh.to_le_bytes());
    q5_1.extend(&qs);
    let got = QMatrix::new(GgmlType::Q5_1, 1, 32, &q5_1)
        .unwrap()
        .dequantize();
    for (j, v) in got.iter().enumerate() {
        assert_eq!(*v, j as f32 * 0.25 - 3.0, "element {j}");
    }
}

#[test]
fn hand_built_q4_k_and_q6_k_blocks() {
    // Q4_K: d = 0.5, dmin = 0.25; group j has scale j + 1 and min 2j (6-bit packing), codes
    // u_e = e % 16.
    let scales: Vec<i32> = (1..=8).collect();
    let mins: Vec<i32> = (0..8).map(|j| 2 * j).collect();
    let mut blk = vec![0u8; 144];
    blk[..2].copy_from_slice(&f16_le(0.5));
    blk[2..4].copy_from_slice(&f16_le(0.25));
    for j in 0..8 {
        let (s, m) = (scales[j] as u8, mins[j] as u8);
        if j < 4 {
            blk[4 + j] = s;
            blk[8 + j] = m;
        } else {
            blk[12 + j - 4] = (s & 15) | ((m & 15) << 4);
            blk[4 + j - 4] |= (s >> 4) << 6;
            blk[8 + j - 4] |= (m >> 4) << 6;
        }
    }
    for c in 0..4 {
        for l in 0..32 {
            // Element 64c + l in the low nibble, 64c + 32 + l in the high one.
            blk[16 + 32 * c + l] = (l % 16) as u8 | (((l + 32) % 16) << 4) as u8;
        }
    }
    let got = QMatrix::new(GgmlType::Q4_K, 1, 256, &blk)
        .unwrap()
        .dequantize();
    for (e, v) in got.iter().enumerate() {
        let j = e / 32;
        let expected = (0.5 * scales[j] as f32) * (e % 16) as f32 - 0.25 * mins[j] as f32;
        assert_eq!(*v, expected, "element {e}");
    }
    // Q6_K: d = 0.125, group g (16 elements) has scale g − 8; code u_e = e % 64, value
    // (d·s)·(u − 32).
    let mut blk = vec![0u8; 210];
    for e in 0..256 {
        let u = (e % 64) as u8;
        let (h, q, l) = (e / 128, (e % 128) / 32, e % 32);
        blk[64 * h + 32 * (q % 2) + l] |= (u & 15) << (4 * (q / 2));
        blk[128 + 32 * h + l] |= (u >> 4) << (2 * q);
    }
    for g in 0..16 {
        blk[192 + g] = (g as i8 - 8) as u8;
    }
    blk[208..].copy_from_slice(&f16_le(0.125));
    let got = QMatrix::new(GgmlType::Q6_K, 1, 256, &blk)
        .unwrap()
        .dequantize();
    for (e, v) in got.iter().enumerate() {
        let expected = (0.125 * ((e / 16) as f32 - 8.0)) * ((e % 64) as f32 - 32.0);
        assert_eq!(*v, expected, "element {e}");
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
    let blocks = 296; // 37 super-blocks
    let mut x = rng.floats(blocks * 32, 50.0);
    // Edge cases: an all-zero block, a tiny-scale block, non-finite blocks, exact ties; the
    // non-finite ones poison super-blocks 0 and 1, the others leave super-blocks clean.
    x[32..64].fill(0.0);
    x[64..96].iter_mut().for_each(|v| *v *= 1e-30);
    x[96] = f32::NAN;
    x[300] = f32::NEG_INFINITY;
    x[512..768].fill(0.0);
    x[800..832].fill(f32::NAN);
    for (i, v) in x[1024..1056].iter_mut().enumerate() {
        *v = i as f32 - 15.5;
    }
    x[1280..1536].iter_mut().for_each(|v| *v *= 1e-35);
    let run = |kernel: Kernel| {
        let (mut qs, mut d, mut s, mut sum) = (
            vec![0i8; x.len()],
            vec![0.0f32; blocks],
            vec![0.0f32; blocks],
            vec![0i32; blocks],
        );
        activation::quantize_blocks(kernel, &x, &mut qs, &mut d, &mut s, &mut sum);
        let supers = blocks / 8;
        let (mut k_qs, mut k_d, mut s16, mut s32) = (
            vec![0i8; x.len()],
            vec![0.0f32; supers],
            vec![0i16; supers * 16],
            vec![0i16; supers * 8],
        );
        activation::quantize_super_blocks(kernel, &x, &mut k_qs, &mut k_d, &mut s16, &mut s32);
        (qs, bits(&d), bits(&s), sum, k_qs, bits(&k_d), s16, s32)
    };
    let reference = run(Kernel::Scalar);
    assert!(f32::from_bits(reference.5[1]).is_nan() && f32::from_bits(reference.5[2]) == 0.0);
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

/// Elements per activation block for weights of `dtype` (`None`: f32 activations).
fn act_block(dtype: GgmlType) -> Option<usize> {
    dtype.is_quantized().then_some(dtype.block_size())
}

/// Max |out − reference| allowed for one output element: the activation quantization error
/// `Σ_b (d_b / 2)·Σ_{i∈b} |w_i|` (each element is off by at most half a step `d_b` of its
/// activation block of 32 or 256), plus f32 rounding of `nb + 8` dependent operations on
/// terms bounded by `Σ |w_i|·(|x_i| + d_b)`.
fn error_bound(w_row: &[f32], x: &[f32], act_block: Option<usize>) -> f64 {
    let block = act_block.unwrap_or(32);
    let mut act = 0.0f64;
    let mut magnitude = 0.0f64;
    for (wb, xb) in w_row.chunks(block).zip(x.chunks(block)) {
        let d = if act_block.is_some() {
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
    let (rows, cols, n) = (37, 768, 5);
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
                        let bound = error_bound(wr, xt, act_block(dtype));
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
    let (rows, cols, n) = (16, 512, 3);
    for dtype in GgmlType::ALL.into_iter().filter(|t| t.is_quantized()) {
        let data = random_weights(dtype, rows, cols, &mut rng, true);
        let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
        let wf = w.dequantize();
        let x = rng.floats(n * cols, 1.0);
        let mut scratch = QuantScratch::new();
        let input = QuantizedInput::quantize(&x, n, cols, &mut scratch).unwrap();
        let xq = if dtype.is_k_quant() {
            input.dequantized_super()
        } else {
            input.dequantized()
        }
        .unwrap();
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

/// Shapes `(rows, cols)` for kernel comparisons: rows below, at and past the 8- and 16-lane
/// groups with tails, columns of one to many blocks.
fn kernel_shapes(dtype: GgmlType) -> &'static [(usize, usize)] {
    if dtype.is_k_quant() {
        &[
            (1, 256),
            (7, 512),
            (16, 256),
            (37, 1536),
            (67, 768),
            (19, 2048),
        ]
    } else {
        &[
            (1, 32),
            (7, 64),
            (16, 96),
            (37, 576),
            (67, 1536),
            (24, 40),
            (19, 17),
        ]
    }
}

#[test]
fn every_simd_kernel_is_bit_identical_to_scalar() {
    let mut rng = Rng(5);
    for dtype in GgmlType::ALL {
        for &(rows, cols) in kernel_shapes(dtype) {
            if cols % dtype.block_size() != 0 {
                continue;
            }
            for raw in [false, true] {
                let data = random_weights(dtype, rows, cols, &mut rng, raw);
                let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
                // The interleaved layout of the same matrix, where the format has one: every
                // kernel on it must equal the scalar kernel on the row layout.
                let il_data = interleave_rows(dtype, rows, cols, &data);
                let il = il_data
                    .as_ref()
                    .map(|d| QMatrix::new_interleaved(dtype, rows, cols, d).unwrap());
                for n in [1, 2, 3, 5, 6, 7, 8, 13, 17, 31] {
                    let x = rng.floats(n * cols, 4.0);
                    let reference = bits(&run(Kernel::Scalar, &w, &x, n));
                    let refined_reference = bits(&run_refined(Kernel::Scalar, &w, &x, n));
                    for kernel in Kernel::available() {
                        assert_eq!(
                            bits(&run(kernel, &w, &x, n)),
                            reference,
                            "{dtype} {kernel} rows={rows} cols={cols} n={n} raw={raw}"
                        );
                        assert_eq!(
                            bits(&run_refined(kernel, &w, &x, n)),
                            refined_reference,
                            "refined {dtype} {kernel} rows={rows} cols={cols} n={n} raw={raw}"
                        );
                        if let Some(il) = &il {
                            assert_eq!(
                                bits(&run(kernel, il, &x, n)),
                                reference,
                                "interleaved {dtype} {kernel} rows={rows} cols={cols} n={n}"
                            );
                            assert_eq!(
                                bits(&run_refined(kernel, il, &x, n)),
                                refined_reference,
                                "interleaved refined {dtype} {kernel} rows={rows} n={n}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The kernels without VNNI sum several `vpmaddubsw` products in i16 (the nibble formats'
/// blocks in `lanes::small_terms`, the k-quants' groups in `Isa::dot_codes_scaled`): at
/// the bound, every code at its largest value (bytes of all ones: `0xff` codes, Q8_0's −1,
/// or `0x80`, its −128) times a block of activations all at ±127, the sums must still equal
/// the scalar kernel's exact ones, for every format, layout and precision.
#[test]
fn extreme_codes_and_activations_stay_exact_in_every_kernel() {
    let mut rng = Rng(11);
    for dtype in GgmlType::ALL.into_iter().filter(|d| d.is_quantized()) {
        let (rows, cols) = (16, if dtype.is_k_quant() { 512 } else { 64 });
        for fill in [0xffu8, 0x80, 0x77] {
            let mut data = vec![fill; rows * dtype.row_bytes(cols).unwrap()];
            for blk in data.chunks_exact_mut(dtype.block_bytes()) {
                for &o in scale_offsets(dtype) {
                    blk[o..o + 2].copy_from_slice(&f16_le(0.01));
                }
            }
            let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
            let il_data = interleave_rows(dtype, rows, cols, &data);
            let il = il_data
                .as_ref()
                .map(|d| QMatrix::new_interleaved(dtype, rows, cols, d).unwrap());
            // 3 tokens take the direct passes, 20 the unpacked-block buffer's tiles.
            for (sign, n) in [(1.0f32, 3), (-1.0, 3), (1.0, 20), (-1.0, 20)] {
                // Constant blocks quantize to ±127 everywhere; the second token mixes in a
                // tiny residual so the refined pass is at its bound too.
                let mut x = vec![sign; n * cols];
                for v in &mut x[cols..2 * cols] {
                    *v *= 1.0 + 0.003 * rng.unit();
                }
                let reference = bits(&run(Kernel::Scalar, &w, &x, n));
                let refined_reference = bits(&run_refined(Kernel::Scalar, &w, &x, n));
                for kernel in Kernel::available() {
                    let what = format!("{dtype} {kernel} fill={fill:#x} sign={sign} n={n}");
                    assert_eq!(bits(&run(kernel, &w, &x, n)), reference, "{what}");
                    assert_eq!(
                        bits(&run_refined(kernel, &w, &x, n)),
                        refined_reference,
                        "refined {what}"
                    );
                    if let Some(il) = &il {
                        assert_eq!(bits(&run(kernel, il, &x, n)), reference, "il {what}");
                        assert_eq!(
                            bits(&run_refined(kernel, il, &x, n)),
                            refined_reference,
                            "il refined {what}"
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
        assert!(available.contains(&Kernel::Avx512Vnni));
        // AMX-INT8 in CPUID (leaf 7, EDX bit 25) and tile state enabled by the OS (XCR0 bits
        // 17, 18) on Linux: the process must be granted the tiles and the kernel run.
        // SAFETY: CPUID leaf 7 exists on every CPU with AVX-512, which implies XSAVE.
        #[allow(unused_unsafe)]
        let (leaf7, xcr0) = unsafe {
            (
                std::arch::x86_64::__cpuid_count(7, 0),
                std::arch::x86_64::_xgetbv(0),
            )
        };
        let amx = leaf7.edx & (1 << 25) != 0 && xcr0 & (0b11 << 17) == 0b11 << 17;
        if amx && cfg!(target_os = "linux") {
            assert_eq!(available, Kernel::ALL.to_vec());
        }
    }
}

/// Output rows of one token computed alone (for a refined k-quant product: its value row,
/// then its residual row).
fn single(kernel: Kernel, w: &QMatrix<'_>, x: &[f32], t: usize, refined: bool) -> Vec<u32> {
    let cols = w.cols();
    let xt = &x[t * cols..(t + 1) * cols];
    bits(&if refined {
        run_refined(kernel, w, xt, 1)
    } else {
        run(kernel, w, xt, 1)
    })
}

/// Rows of token `t` in the output of an `n`-token matmul (value and residual rows when the
/// output has `2n` rows: a refined k-quant product).
fn token_rows(out: &[f32], t: usize, n: usize, rows: usize) -> Vec<u32> {
    let mut v = bits(&out[t * rows..(t + 1) * rows]);
    if out.len() == 2 * n * rows {
        v.extend(bits(&out[(n + t) * rows..(n + t + 1) * rows]));
    }
    v
}

#[test]
fn batch_invariance_any_size_position_and_thread_count() {
    let mut rng = Rng(6);
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
        // 53 rows: 3 SIMD groups of 16 plus a tail; 3 blocks of 32, or 2 super-blocks.
        let (rows, cols) = (53, if dtype.is_k_quant() { 512 } else { 96 });
        let data = random_weights(dtype, rows, cols, &mut rng, true);
        let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
        let x = rng.floats(256 * cols, 3.0);
        for kernel in Kernel::available() {
            for refined in [false, true] {
                let alone: Vec<Vec<u32>> = (0..256)
                    .map(|t| single(kernel, &w, &x, t, refined))
                    .collect();
                let product = |n: usize, x: &[f32]| {
                    if refined {
                        run_refined(kernel, &w, x, n)
                    } else {
                        run(kernel, &w, x, n)
                    }
                };
                for n in [1, 2, 3, 5, 6, 7, 16, 64, 256] {
                    for pool in &pools {
                        let out = pool.install(|| product(n, &x[..n * cols]));
                        for (t, expected) in alone.iter().enumerate().take(n) {
                            assert_eq!(
                                &token_rows(&out, t, n, rows),
                                expected,
                                "{dtype} {kernel} refined={refined} n={n} t={t}"
                            );
                        }
                    }
                }
                // Same tokens in another order (every token at another position and tile
                // slot).
                let n = 64;
                let order: Vec<usize> = (0..n).map(|i| (i * 37 + 11) % n).collect();
                let shuffled: Vec<f32> = order
                    .iter()
                    .flat_map(|&t| x[t * cols..(t + 1) * cols].to_vec())
                    .collect();
                let out = pools[1].install(|| product(n, &shuffled));
                for (pos, &t) in order.iter().enumerate() {
                    assert_eq!(
                        token_rows(&out, pos, n, rows),
                        alone[t],
                        "{dtype} {kernel} refined={refined} shuffled"
                    );
                }
            }
        }
    }
}

/// The refined product of a 32-element format is the canonical product with the 16-bit
/// codes `256·hi + lo` on the step `d/256` (recomputed here from the dequantized wide codes
/// and the weights, in f64); `hi` is the fast codes; a k-quant's has the value rows (the
/// fast product) and the residual's rows; float weights ignore the refinement. Folded, the
/// error shrinks more than 30-fold against the fast product.
#[test]
fn refined_product_is_the_wide_codes_product() {
    let mut rng = Rng(13);
    let (rows, cols, n) = (21, 512, 3);
    for dtype in GgmlType::ALL {
        let data = random_weights(dtype, rows, cols, &mut rng, false);
        let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
        let x = rng.floats(n * cols, 2.0);
        let kernel = Kernel::detect();
        let fast = run(kernel, &w, &x, n);
        let refined = run_refined_folded(kernel, &w, &x, n);
        if !dtype.is_quantized() {
            assert_eq!(bits(&refined), bits(&fast), "{dtype}");
            continue;
        }
        let (mut scratch, mut stacked) = (QuantScratch::new(), Vec::new());
        let input =
            QuantizedInput::quantize_refined(&x, n, cols, &mut stacked, &mut scratch).unwrap();
        let mut fast_scratch = QuantScratch::new();
        let fast_input = QuantizedInput::quantize(&x, n, cols, &mut fast_scratch).unwrap();
        let wf = w.dequantize();
        if dtype.is_k_quant() {
            // Value rows: the fast product, bit for bit; residual rows: the product of the
            // residual x − dq(q(x)).
            let full = run_refined(kernel, &w, &x, n);
            assert_eq!(bits(&full[..n * rows]), bits(&fast), "{dtype}");
            let deq = fast_input.dequantized_super().unwrap();
            let residual: Vec<f32> = x.iter().zip(&deq).map(|(a, b)| a - b).collect();
            assert_eq!(
                bits(&full[n * rows..]),
                bits(&run(kernel, &w, &residual, n)),
                "{dtype}"
            );
        } else {
            // The wide codes' high bytes are the fast codes, and the product is the weights
            // times the dequantized wide codes up to f32 rounding of the block terms.
            let blocks = input.blocks().unwrap();
            assert_eq!(blocks.qs, fast_input.blocks().unwrap().qs, "{dtype}");
            assert!(blocks.lo.iter().all(|&l| (-127..=127).contains(&l)));
            let deq = input.dequantized().unwrap();
            for t in 0..n {
                for r in 0..rows {
                    let (mut exact, mut scale) = (0.0f64, 0.0f64);
                    for c in 0..cols {
                        let p = wf[r * cols + c] as f64 * deq[t * cols + c] as f64;
                        exact += p;
                        scale += p.abs();
                    }
                    let got = refined[t * rows + r] as f64;
                    assert!(
                        (got - exact).abs() <= 1e-5 * scale + 1e-6,
                        "{dtype} t={t} r={r}: {got} vs {exact}"
                    );
                }
            }
        }
        let (mut fast_err, mut refined_err) = (0.0f64, 0.0f64);
        for t in 0..n {
            for r in 0..rows {
                let exact: f64 = wf[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(&x[t * cols..(t + 1) * cols])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                fast_err = fast_err.max((fast[t * rows + r] as f64 - exact).abs());
                refined_err = refined_err.max((refined[t * rows + r] as f64 - exact).abs());
            }
        }
        assert!(
            refined_err * 30.0 < fast_err,
            "{dtype}: refined {refined_err} vs fast {fast_err}"
        );
    }
}

/// Wide codes at their extremes: a block whose residuals all sit at half a step (codes
/// exactly between two 8-bit values) gets low bytes of ±127 or ±128 before the clamp, and the
/// kernels (including the i16 sums and the signed path without VNNI) still equal the scalar
/// kernel; a non-finite block makes every output it touches NaN.
#[test]
fn wide_codes_at_their_bounds_stay_exact_and_nan_propagates() {
    let mut rng = Rng(17);
    for dtype in GgmlType::ALL
        .into_iter()
        .filter(|d| d.is_quantized() && !d.is_k_quant())
    {
        let (rows, cols, n) = (32, 64, 5);
        let data = random_weights(dtype, rows, cols, &mut rng, true);
        let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
        // Block max 127: the step is 1, so x = k + 0.5 has residual ±0.5 (low byte ±128 →
        // clamped), and x = k + 0.49 gives ±125.
        let mut x: Vec<f32> = (0..n * cols)
            .map(|i| {
                let k = (i * 37 % 200) as f32 - 100.0;
                k + [0.5, -0.5, 0.49, -0.49, 0.0][i % 5]
            })
            .collect();
        for b in x.chunks_exact_mut(32) {
            b[0] = 127.0;
        }
        let reference = bits(&run_refined(Kernel::Scalar, &w, &x, n));
        for kernel in Kernel::available() {
            assert_eq!(
                bits(&run_refined(kernel, &w, &x, n)),
                reference,
                "{dtype} {kernel}"
            );
        }
        let mut scratch = QuantScratch::new();
        let mut stacked = Vec::new();
        let input =
            QuantizedInput::quantize_refined(&x, n, cols, &mut stacked, &mut scratch).unwrap();
        let lo = input.blocks().unwrap().lo;
        assert!(
            lo.contains(&127) && lo.contains(&-127),
            "{dtype}: the clamp is reached"
        );
        // A NaN in token 1's second block.
        let mut bad = x.clone();
        bad[cols + 40] = f32::NAN;
        for kernel in Kernel::available() {
            let out = run_refined(kernel, &w, &bad, n);
            for t in 0..n {
                let row = &out[t * rows..(t + 1) * rows];
                if t == 1 {
                    assert!(row.iter().all(|v| v.is_nan()), "{dtype} {kernel}");
                } else {
                    assert_eq!(bits(row), reference[t * rows..(t + 1) * rows], "{dtype}");
                }
            }
        }
    }
}

#[test]
fn big_matrices_split_over_threads_stay_bit_identical() {
    // Large enough to take the parallel split (rows and tokens), compared with one thread.
    let mut rng = Rng(7);
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let three = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for (dtype, rows, cols) in [
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q5_0, 1536, 640),
        (GgmlType::Q4_K, 640, 2048),
        (GgmlType::Q6_K, 1024, 1536),
    ] {
        let data = random_weights(dtype, rows, cols, &mut rng, false);
        let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
        let x = rng.floats(40 * cols, 1.0);
        for n in [1, 5, 40] {
            let a = one.install(|| run(Kernel::detect(), &w, &x[..n * cols], n));
            let b = three.install(|| run(Kernel::detect(), &w, &x[..n * cols], n));
            assert_eq!(bits(&a), bits(&b), "{dtype} n={n}");
            let a = one.install(|| run_refined(Kernel::detect(), &w, &x[..n * cols], n));
            let b = three.install(|| run_refined(Kernel::detect(), &w, &x[..n * cols], n));
            assert_eq!(bits(&a), bits(&b), "refined {dtype} n={n}");
        }
    }
}

#[test]
fn one_input_serves_several_matrices() {
    let mut rng = Rng(8);
    let cols = 512;
    let x = rng.floats(2 * cols, 1.0);
    let mut scratch = QuantScratch::with_capacity(2, cols);
    let input = QuantizedInput::quantize(&x, 2, cols, &mut scratch).unwrap();
    for (dtype, rows) in [
        (GgmlType::Q4_1, 24),
        (GgmlType::Q8_0, 8),
        (GgmlType::Q4_K, 17),
        (GgmlType::Q5_0, 16),
        (GgmlType::Q6_K, 3),
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

/// Several matrices in one parallel region (q/k/v, gate/up): each output equals its own
/// matmul, bit for bit, for mixed formats, plain and refined inputs, 1 to 40 tokens and 1 to
/// 3 threads; a bad shape anywhere is refused before any output is written.
#[test]
fn many_matrices_in_one_region_equal_their_own_matmuls() {
    let mut rng = Rng(21);
    let cols = 512;
    let shapes = [
        (GgmlType::Q4_1, 576),
        (GgmlType::Q5_0, 64),
        (GgmlType::Q8_0, 33),
        (GgmlType::Q4_K, 200),
        (GgmlType::Q6_K, 16),
        (GgmlType::F16, 7),
    ];
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .map(|&(dtype, rows)| random_weights(dtype, rows, cols, &mut rng, false))
        .collect();
    let ws: Vec<QMatrix<'_>> = shapes
        .iter()
        .zip(&data)
        .map(|(&(dtype, rows), d)| QMatrix::new(dtype, rows, cols, d).unwrap())
        .collect();
    for n in [1, 3, 40] {
        let x = rng.floats(n * cols, 1.0);
        for refined in [false, true] {
            let (mut scratch, mut stacked) = (QuantScratch::new(), Vec::new());
            let input = if refined {
                QuantizedInput::quantize_refined(&x, n, cols, &mut stacked, &mut scratch)
            } else {
                QuantizedInput::quantize(&x, n, cols, &mut scratch)
            }
            .unwrap();
            let rows_out = |w: &QMatrix<'_>| input.product_tokens(w.dtype());
            let alone: Vec<Vec<u32>> = ws
                .iter()
                .map(|w| {
                    let mut out = vec![f32::NAN; rows_out(w) * w.rows()];
                    matmul(w, &input, &mut out).unwrap();
                    bits(&out)
                })
                .collect();
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut outs: Vec<Vec<f32>> = ws
                    .iter()
                    .map(|w| vec![f32::NAN; rows_out(w) * w.rows()])
                    .collect();
                let mut products: Vec<(&QMatrix<'_>, &mut [f32])> = ws
                    .iter()
                    .zip(outs.iter_mut())
                    .map(|(w, o)| (w, o.as_mut_slice()))
                    .collect();
                pool.install(|| matmul_many(&mut products, &input)).unwrap();
                for (i, out) in outs.iter().enumerate() {
                    assert_eq!(bits(out), alone[i], "matrix {i}, n {n}, refined {refined}");
                }
            }
            // One output of the wrong length: an error, and nothing written anywhere.
            let mut good = vec![f32::NAN; rows_out(&ws[0]) * ws[0].rows()];
            let mut bad = vec![f32::NAN; rows_out(&ws[1]) * ws[1].rows() - 1];
            let err = matmul_many(&mut [(&ws[0], &mut good), (&ws[1], &mut bad)], &input);
            assert!(matches!(err, Err(QuantError::OutputLength { .. })));
            assert!(good.iter().chain(&bad).all(|v| v.is_nan()));
        }
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
    let k = vec![0u8; 3 * 2 * 210];
    let m = QMatrix::from_gguf(14, &[512, 3], &k).unwrap();
    assert_eq!((m.dtype(), m.rows(), m.cols()), (GgmlType::Q6_K, 3, 512));
    assert_eq!(
        QMatrix::from_gguf(12, &[640, 3], &k).unwrap_err(),
        QuantError::ColsNotBlockMultiple {
            dtype: GgmlType::Q4_K,
            cols: 640,
            block_size: 256
        }
    );
    let norm = vec![0u8; 4 * 576];
    let m = QMatrix::from_gguf(0, &[576], &norm).unwrap();
    assert_eq!((m.dtype(), m.rows(), m.cols()), (GgmlType::F32, 1, 576));
    assert_eq!(
        QMatrix::from_gguf(17, &[256, 6], &data).unwrap_err(),
        QuantError::UnsupportedType { id: 17 }
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
    let cols = 1536;
    let mut scratch = QuantScratch::with_capacity(8, cols);
    let x = vec![0.5f32; 4 * cols];
    let ptr = {
        let input = QuantizedInput::quantize(&x, 4, cols, &mut scratch).unwrap();
        input.f32_rows().as_ptr()
    };
    let before = (scratch.qs.as_ptr(), scratch.k_qs.as_ptr());
    let mut stacked = Vec::with_capacity(4 * cols);
    for n in [1, 4, 2] {
        QuantizedInput::quantize(&x[..n * cols], n, cols, &mut scratch).unwrap();
        assert_eq!((scratch.qs.as_ptr(), scratch.k_qs.as_ptr()), before);
        QuantizedInput::quantize_refined(&x[..n * cols], n, cols, &mut stacked, &mut scratch)
            .unwrap();
        assert_eq!((scratch.qs.as_ptr(), scratch.k_qs.as_ptr()), before);
    }
    assert_eq!(ptr, x.as_ptr());
}

/// Without VNNI a refined input's codes meet `Q8_0` weights as i16 pairs (`wide_pairs`, one
/// `vpmaddwd` per 2 products) when the input was built for `Q8_0`, and as two byte planes
/// otherwise: the pairs hold `256·hi + lo` in the order `[a0, a2, a1, a3]`, and both paths
/// give the scalar kernel's bits in every kernel, layout and tile size.
#[test]
fn q8_0_refined_products_are_the_same_bits_with_or_without_the_i16_pairs() {
    let mut rng = Rng(78);
    let (rows, cols) = (40, 96);
    let data = random_weights(GgmlType::Q8_0, rows, cols, &mut rng, true);
    let w = QMatrix::new(GgmlType::Q8_0, rows, cols, &data).unwrap();
    let il_data = interleave_rows(GgmlType::Q8_0, rows, cols, &data).unwrap();
    let il = QMatrix::new_interleaved(GgmlType::Q8_0, rows, cols, &il_data).unwrap();
    for n in [1, 3, 8, 20] {
        let x = rng.floats(n * cols, 3.0);
        let reference = bits(&run_refined(Kernel::Scalar, &w, &x, n));
        // Built for Q8_0 (with the pairs) and for Q4_1 only (without them).
        let mut scratch = [QuantScratch::new(), QuantScratch::new()];
        let mut stacked = [Vec::new(), Vec::new()];
        let inputs: Vec<QuantizedInput<'_>> = [GgmlType::Q8_0, GgmlType::Q4_1]
            .into_iter()
            .zip(scratch.iter_mut().zip(stacked.iter_mut()))
            .map(|(dtype, (sc, st))| {
                QuantizedInput::quantize_for(&x, n, cols, &[dtype], Some(st), sc).unwrap()
            })
            .collect();
        let (paired, plain) = (&inputs[0], &inputs[1]);
        let blocks = paired.blocks().unwrap();
        assert!(plain.blocks().unwrap().pairs.is_empty());
        let wide = |e: usize| 256 * blocks.qs[e] as i16 + blocks.lo[e] as i16;
        let expected: Vec<i16> = (0..n * cols)
            .map(|e| wide(e / 4 * 4 + [0, 2, 1, 3][e % 4]))
            .collect();
        assert_eq!(blocks.pairs, &expected[..], "n={n}");
        for kernel in Kernel::available() {
            for (m, layout) in [(&w, "rows"), (&il, "interleaved")] {
                for input in &inputs {
                    let mut out = vec![f32::NAN; n * rows];
                    matmul_with_kernel(kernel, m, input, &mut out).unwrap();
                    let what = format!(
                        "{kernel} {layout} n={n} pairs={}",
                        input.blocks().unwrap().has_pairs()
                    );
                    assert_eq!(bits(&out), reference, "{what}");
                }
            }
        }
    }
}

#[test]
fn quantizing_for_some_types_gives_the_same_products_and_refuses_the_others() {
    // A 512-column input reused from a wider one (the scratch shrinks without refilling):
    // the products of an input built for one kind of weights equal those of the full input,
    // bit for bit, and the other kind is refused, not computed from stale blocks.
    let mut rng = Rng(77);
    let (rows, cols, n) = (32, 512, 5);
    let wide = rng.floats(3 * 1024, 2.0);
    let x = rng.floats(n * cols, 2.0);
    for (dtype, other) in [
        (GgmlType::Q4_1, GgmlType::Q4_K),
        (GgmlType::Q6_K, GgmlType::Q8_0),
    ] {
        let data = random_weights(dtype, rows, cols, &mut rng, false);
        let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
        let other_data = random_weights(other, rows, cols, &mut rng, false);
        let wo = QMatrix::new(other, rows, cols, &other_data).unwrap();
        for refined in [false, true] {
            let m = if refined && dtype.is_k_quant() { 2 } else { 1 };
            let want = if refined {
                run_refined(Kernel::detect(), &w, &x, n)
            } else {
                run(Kernel::detect(), &w, &x, n)
            };
            let mut scratch = QuantScratch::new();
            let mut stacked = Vec::new();
            QuantizedInput::quantize_refined(&wide, 3, 1024, &mut stacked, &mut scratch).unwrap();
            let residual = refined.then_some(&mut stacked);
            let input = QuantizedInput::quantize_for(&x, n, cols, &[dtype], residual, &mut scratch)
                .unwrap();
            let mut out = vec![f32::NAN; m * n * rows];
            matmul(&w, &input, &mut out).unwrap();
            assert_eq!(bits(&out), bits(&want), "{dtype} refined={refined}");
            assert_eq!(
                matmul(&wo, &input, &mut out),
                Err(QuantError::MissingBlocks { dtype: other })
            );
        }
    }
}

#[test]
fn the_interleaved_q5_bit_order_puts_element_4v_plus_k_at_bit_8k_plus_v() {
    use super::interleave::{gather_qh, spread_qh};
    for e in 0..32 {
        assert_eq!(spread_qh(1 << e), 1 << (8 * (e % 4) + e / 4), "element {e}");
    }
    let mut rng = Rng(17);
    for _ in 0..1000 {
        let qh = rng.next_u64() as u32;
        assert_eq!(gather_qh(spread_qh(qh)), qh);
        assert_eq!(spread_qh(qh).count_ones(), qh.count_ones());
    }
}

#[test]
fn the_interleaved_layout_keeps_every_row_and_size() {
    let mut rng = Rng(91);
    for dtype in GgmlType::ALL {
        let Some(_) = interleave_rows(dtype, 1, 256, &vec![0; dtype.row_bytes(256).unwrap()])
        else {
            assert!(!dtype.is_quantized() || dtype.is_k_quant(), "{dtype}");
            assert!(QMatrix::new_interleaved(
                dtype,
                16,
                256,
                &vec![0; 16 * dtype.row_bytes(256).unwrap()]
            )
            .is_err());
            continue;
        };
        for (rows, cols) in [(16, 64), (37, 96), (5, 32), (48, 576)] {
            let data = random_weights(dtype, rows, cols, &mut rng, false);
            let w = QMatrix::new(dtype, rows, cols, &data).unwrap();
            let il_data = interleave_rows(dtype, rows, cols, &data).unwrap();
            assert_eq!(il_data.len(), data.len());
            if rows >= 16 {
                assert_ne!(il_data, data, "{dtype}: a whole group moves bytes");
            }
            let il = QMatrix::new_interleaved(dtype, rows, cols, &il_data).unwrap();
            assert!(il.is_interleaved() && !w.is_interleaved());
            assert_eq!(bits(&il.dequantize()), bits(&w.dequantize()), "{dtype}");
            let ids: Vec<u32> = (0..rows as u32).rev().collect();
            let (mut a, mut b) = (vec![0.0; rows * cols], vec![0.0; rows * cols]);
            il.embed(&ids, &mut a).unwrap();
            w.embed(&ids, &mut b).unwrap();
            assert_eq!(bits(&a), bits(&b), "{dtype}");
        }
        assert!(interleave_rows(dtype, 16, 64, &[0; 3]).is_none());
    }
}

#[test]
fn large_refined_inputs_split_over_the_pool_give_the_same_bits() {
    // Above the parallel threshold the residual and the fold run in chunks on the pool:
    // every token's blocks and sums equal those of the token quantized alone.
    let mut rng = Rng(123);
    let (n, cols) = (300, 512);
    let x = rng.floats(n * cols, 3.0);
    let (mut scratch, mut stacked) = (QuantScratch::new(), Vec::new());
    let whole = QuantizedInput::quantize_refined(&x, n, cols, &mut stacked, &mut scratch).unwrap();
    let (blocks, supers) = (
        whole.dequantized().unwrap(),
        whole.dequantized_super().unwrap(),
    );
    for t in [0, 1, 150, 299] {
        let (mut s1, mut st1) = (QuantScratch::new(), Vec::new());
        let xt = &x[t * cols..(t + 1) * cols];
        let one = QuantizedInput::quantize_refined(xt, 1, cols, &mut st1, &mut s1).unwrap();
        let (b1, k1) = (one.dequantized().unwrap(), one.dequantized_super().unwrap());
        // The wide 32-element codes: one row per token.
        let r = t * cols..(t + 1) * cols;
        assert_eq!(bits(&blocks[r]), bits(&b1), "token {t}");
        // The super-blocks: the value row, then the residual row.
        for (pass, row) in [(0, t), (1, n + t)] {
            let r = row * cols..(row + 1) * cols;
            let r1 = pass * cols..(pass + 1) * cols;
            assert_eq!(bits(&supers[r]), bits(&k1[r1]), "token {t}");
        }
    }
    let full: Vec<f32> = rng.floats(2 * 100_000, 5.0);
    let mut out = vec![0.0; 100_000];
    fold_refined(&full, &mut out);
    for (i, &o) in out.iter().enumerate() {
        assert_eq!(o.to_bits(), (full[i] + full[100_000 + i]).to_bits());
    }
}
