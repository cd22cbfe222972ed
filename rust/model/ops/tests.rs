use super::*;

#[test]
fn rms_norm_matches_definition() {
    let x: Vec<f32> = (0..24).map(|i| (i as f32 - 7.0) * 0.25).collect();
    let w: Vec<f32> = (0..12).map(|i| 1.0 + i as f32 * 0.1).collect();
    let mut out = vec![0.0; 24];
    rms_norm(&x, &w, 1e-5, &mut out);
    for r in 0..2 {
        let row = &x[r * 12..(r + 1) * 12];
        let ms: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / 12.0;
        for i in 0..12 {
            let expect = row[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
            assert!((out[r * 12 + i] as f64 - expect).abs() < 1e-5);
        }
    }
}

#[test]
fn rms_norm_rows_are_independent_of_batching() {
    let x: Vec<f32> = (0..64 * 3)
        .map(|i| ((i * 37) % 101) as f32 * 0.03 - 1.5)
        .collect();
    let w = vec![0.9f32; 64];
    let mut all = vec![0.0; x.len()];
    rms_norm(&x, &w, 1e-5, &mut all);
    for r in 0..3 {
        let mut one = vec![0.0; 64];
        rms_norm(&x[r * 64..(r + 1) * 64], &w, 1e-5, &mut one);
        assert_eq!(one, all[r * 64..(r + 1) * 64]);
    }
}

#[test]
fn rope_is_a_rotation_and_relative() {
    let hd = 8;
    let q: Vec<f32> = (0..hd).map(|i| i as f32 * 0.3 - 1.0).collect();
    let k: Vec<f32> = (0..hd).map(|i| 0.5 - i as f32 * 0.2).collect();
    let dot_at = |pq: u64, pk: u64| {
        let (mut c, mut s) = (vec![0.0; hd / 2], vec![0.0; hd / 2]);
        let (mut qr, mut kr) = (q.clone(), k.clone());
        rope_angles(pq, &rope_inv_freq(hd, 10000.0), None, &mut c, &mut s);
        rope_apply(&mut qr, hd, &c, &s);
        rope_angles(pk, &rope_inv_freq(hd, 10000.0), None, &mut c, &mut s);
        rope_apply(&mut kr, hd, &c, &s);
        qr.iter().zip(&kr).map(|(a, b)| a * b).sum::<f32>()
    };
    // Scores depend only on the distance, even far beyond the trained context.
    assert!((dot_at(10, 3) - dot_at(1_000_007, 1_000_000)).abs() < 1e-4);
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
    let (mut c, mut s) = (vec![0.0; hd / 2], vec![0.0; hd / 2]);
    let mut qr = q.clone();
    rope_angles(12345, &rope_inv_freq(hd, 10000.0), None, &mut c, &mut s);
    rope_apply(&mut qr, hd, &c, &s);
    assert!((norm(&qr) - norm(&q)).abs() < 1e-4);
}

#[test]
fn rms_norm_in_place_equals_rms_norm_per_head() {
    let x: Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin()).collect();
    let w: Vec<f32> = (0..8).map(|i| 0.5 + i as f32 * 0.2).collect();
    let mut out = vec![0.0; 32];
    rms_norm(&x, &w, 1e-6, &mut out);
    let mut y = x.clone();
    rms_norm_in_place(&mut y, &w, 1e-6);
    assert_eq!(y, out);
}

#[test]
fn rope_halves_pairs_the_two_halves() {
    // Halves RoPE on x equals adjacent RoPE on x with its halves interleaved.
    let hd = 8;
    let x: Vec<f32> = (0..2 * hd).map(|i| i as f32 * 0.1 - 0.7).collect();
    let (mut c, mut s) = (vec![0.0; hd / 2], vec![0.0; hd / 2]);
    rope_angles(37, &rope_inv_freq(hd, 10000.0), None, &mut c, &mut s);
    let interleave = |v: &[f32]| -> Vec<f32> {
        v.chunks(hd)
            .flat_map(|h| (0..hd / 2).flat_map(move |i| [h[i], h[i + hd / 2]]))
            .collect()
    };
    let mut halves = x.clone();
    rope_apply_halves(&mut halves, hd, &c, &s);
    let mut adjacent = interleave(&x);
    rope_apply(&mut adjacent, hd, &c, &s);
    assert_eq!(interleave(&halves), adjacent);
}

#[test]
fn geglu_matches_the_tanh_gelu() {
    let mut g = vec![-3.0f32, -0.5, 0.0, 0.5, 2.0];
    let up = vec![1.0f32, 2.0, 3.0, -1.0, 0.5];
    let expect: Vec<f64> = g
        .iter()
        .zip(&up)
        .map(|(&x, &u)| {
            let x = x as f64;
            let t = ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh();
            0.5 * x * (1.0 + t) * u as f64
        })
        .collect();
    geglu_tanh(&mut g, &up);
    for (a, b) in g.iter().zip(&expect) {
        assert!((*a as f64 - b).abs() < 1e-6, "{a} vs {b}");
    }
}

#[test]
fn swiglu_matches_definition() {
    let g: Vec<f32> = (0..2001).map(|i| (i as f32 - 1000.0) / 50.0).collect();
    let up: Vec<f32> = (0..2001)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let mut got = g.clone();
    swiglu(&mut got, &up);
    for ((&x, &u), &y) in g.iter().zip(&up).zip(&got) {
        let want = (x as f64) / (1.0 + (-(x as f64)).exp()) * u as f64;
        assert!(
            (y as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
            "silu({x})·{u} = {y}, want {want}"
        );
    }
    let mut zero = [0.0f32];
    swiglu(&mut zero, &[2.0]);
    assert_eq!(zero[0], 0.0);
}

/// Every vector width, the scalar tail and the pool's split give `f` the same bits: the
/// whole input at once equals each element alone. `gate` values are `(k − 10005) / spread`.
fn assert_same_in_simd_lanes_and_chunks(f: fn(&mut [f32], &[f32]), spread: f32) {
    let n: usize = 200_003;
    let g: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 % 20011) as f32 - 10005.0) / spread)
        .collect();
    let up: Vec<f32> = (0..n)
        .map(|i| ((i * 104_729 % 997) as f32 - 498.0) / 300.0)
        .collect();
    let mut whole = g.clone();
    f(&mut whole, &up);
    for (i, (&x, &u)) in g.iter().zip(&up).enumerate() {
        let mut one = [x];
        f(&mut one, &[u]);
        assert_eq!(one[0].to_bits(), whole[i].to_bits(), "element {i}");
    }
}

#[test]
fn swiglu_is_the_same_in_simd_lanes_and_chunks() {
    assert_same_in_simd_lanes_and_chunks(swiglu, 500.0);
}

#[test]
fn exp_f32_is_within_2_ulp() {
    let mut x = -87.0f32;
    while x <= 88.0 {
        let got = exp_f32(x) as f64;
        let want = (x as f64).exp();
        let ulp = (want as f32).abs() * f32::EPSILON;
        assert!(
            (got - want).abs() <= 2.0 * ulp as f64,
            "exp({x}) = {got}, want {want}"
        );
        x += 0.0137;
    }
    assert!(exp_f32(f32::NAN).is_nan());
    assert!(exp_f32(-1000.0) > 0.0 && exp_f32(1000.0).is_finite());
}

#[test]
fn geglu_is_the_same_in_simd_lanes_and_chunks() {
    assert_same_in_simd_lanes_and_chunks(geglu_tanh, 1000.0);
}

#[test]
fn rope_factors_divide_the_frequencies() {
    let hd = 16;
    let angles = |pos: u64, factors: Option<&[f32]>| {
        let (mut c, mut s) = (vec![0.0; hd / 2], vec![0.0; hd / 2]);
        rope_angles(pos, &rope_inv_freq(hd, 500000.0), factors, &mut c, &mut s);
        (c, s)
    };
    // Factors of 1 change nothing, bit for bit.
    assert_eq!(angles(1234, Some(&[1.0; 8])), angles(1234, None));
    // Dividing every frequency by 2 rotates position 2p as far as p unscaled (exactly: the
    // halving and doubling are exact in f64).
    assert_eq!(angles(2 * 777, Some(&[2.0; 8])), angles(777, None));
    // Per pair: only the pairs with a factor other than 1 move.
    let mut f = [1.0f32; 8];
    f[5] = 8.0;
    let (c1, s1) = angles(4242, Some(&f));
    let (c0, s0) = angles(4242, None);
    for i in 0..8 {
        assert_eq!((c1[i] == c0[i] && s1[i] == s0[i]), i != 5, "pair {i}");
    }
    // The scaled pair at 8p is the unscaled pair at p.
    let (c8, s8) = angles(4242 * 8, Some(&f));
    assert_eq!((c8[5], s8[5]), (c0[5], s0[5]));
}
