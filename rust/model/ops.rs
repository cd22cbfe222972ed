//! The small per-row operations of a decoder block: RMSNorm, RoPE, the gated activations.
//!
//! Each works on one row at a time with a fixed operation order, so a row's result never
//! depends on how many rows are processed together (batch invariance, SPEC §4).

/// Lane count of the fixed-order sum of squares (a multiple of every SIMD width we target).
const LANES: usize = 8;

/// `out = x / sqrt(mean(x²) + eps) * weight`, per row of width `weight.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    debug_assert_eq!(x.len(), out.len());
    debug_assert_eq!(x.len() % width, 0);
    for (row, out_row) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let scale = 1.0 / (sum_of_squares(row) / width as f32 + eps).sqrt();
        for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// [`rms_norm`] in place: every row of width `weight.len()` (e.g. each head of a Q/K row).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let width = weight.len();
    debug_assert_eq!(x.len() % width, 0);
    for row in x.chunks_exact_mut(width) {
        let scale = 1.0 / (sum_of_squares(row) / width as f32 + eps).sqrt();
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

/// Σ v² in a fixed lane order (lanes, then a fixed pairwise tree), independent of callers.
fn sum_of_squares(row: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    // Plain multiply-add (not `mul_add`, a libm call on baseline x86-64): the order is what
    // makes it deterministic, and it vectorises.
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a += v * v;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `base^(−2i/d)` for `i < d/2`: the rotation frequencies of [`rope_angles`] (computed once
/// per pass rather than once per row and position).
pub fn rope_inv_freq(head_dim: usize, base: f64) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| base.powf(-((2 * i) as f64) / head_dim as f64))
        .collect()
}

/// RoPE angles for one position: `cos`/`sin` of `pos · inv_freq_i / f_i` for `i < d/2`, with
/// `inv_freq` from [`rope_inv_freq`] and `f_i` the per-pair frequency divisors of `factors`
/// (the GGUF `rope_freqs.weight` of Llama 3.1/3.2, as llama.cpp divides its rotation
/// frequencies by them), or 1.
///
/// Computed in f64 from the integer position, so large clocks keep full precision; the same
/// scalar operations on every CPU, one row at a time (bit-identical across ISAs and batches).
pub fn rope_angles(
    pos: u64,
    inv_freq: &[f64],
    factors: Option<&[f32]>,
    cos: &mut [f32],
    sin: &mut [f32],
) {
    debug_assert!(factors.is_none_or(|f| f.len() == inv_freq.len()));
    for (i, &inv_freq) in inv_freq.iter().enumerate() {
        let angle = match factors {
            Some(f) => pos as f64 * inv_freq / f64::from(f[i]),
            None => pos as f64 * inv_freq,
        };
        cos[i] = angle.cos() as f32;
        sin[i] = angle.sin() as f32;
    }
}

/// Rotates every head of `x` (`n_heads × head_dim`) in place by the given angles.
///
/// GGUF stores `attn_q`/`attn_k` permuted for llama.cpp's adjacent-pair RoPE, so pairs are
/// `(2i, 2i+1)` here (equivalent to rotate-half on the un-permuted HF weights).
pub fn rope_apply(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    for head in x.chunks_exact_mut(head_dim) {
        for (i, pair) in head.chunks_exact_mut(2).enumerate() {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * cos[i] - b * sin[i];
            pair[1] = a * sin[i] + b * cos[i];
        }
    }
}

/// Rotates every head of `x` like [`rope_apply`], pairing `(i, i + head_dim/2)` (llama.cpp's
/// "neox" RoPE: Qwen 2, Gemma 3, whose GGUF weights are not permuted).
pub fn rope_apply_halves(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        let (lo, hi) = head.split_at_mut(half);
        for (i, (a, b)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
            let (x0, x1) = (*a, *b);
            *a = x0 * cos[i] - x1 * sin[i];
            *b = x0 * sin[i] + x1 * cos[i];
        }
    }
}

/// GeGLU with the tanh GELU: `gate = gelu_tanh(gate) * up`, in place.
///
/// `0.5·x·(1 + tanh(v))` is computed as `x / (1 + e^(−2v))` (the same function) with
/// [`exp_f32`]: plain IEEE operations only, so the result is the same on every CPU and
/// whether the loop runs in SIMD lanes or not; large inputs are split over the rayon pool
/// (elementwise, so a row's result never depends on the others).
pub fn geglu_tanh(gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len());
    elementwise(gate, up, gated_span::<GeluTanh>);
}

/// Elements per parallel task of the elementwise activations.
const PAR_CHUNK: usize = 16 * 1024;

/// Runs `f` over `gate`/`up`, in chunks on the rayon pool when large.
fn elementwise(gate: &mut [f32], up: &[f32], f: fn(&mut [f32], &[f32])) {
    use rayon::prelude::*;
    if gate.len() >= 4 * PAR_CHUNK && rayon::current_num_threads() > 1 {
        gate.par_chunks_mut(PAR_CHUNK)
            .zip(up.par_chunks(PAR_CHUNK))
            .for_each(|(g, u)| f(g, u));
    } else {
        f(gate, up);
    }
}

/// The activation of a gated FFN, `gate = act(gate) · up`, from plain IEEE operations (so
/// the compiler may vectorise it without changing a bit).
trait GatedActivation {
    fn act(x: f32) -> f32;
}

/// Gemma's tanh GELU, `0.5·x·(1 + tanh(v))` as `x / (1 + e^(−2v))`.
struct GeluTanh;

impl GatedActivation for GeluTanh {
    #[inline(always)]
    fn act(x: f32) -> f32 {
        // √(2/π)
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        let inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
        x / (1.0 + exp_f32(-2.0 * inner))
    }
}

/// Llama's SiLU, `x / (1 + e^(−x))`.
struct Silu;

impl GatedActivation for Silu {
    #[inline(always)]
    fn act(x: f32) -> f32 {
        x / (1.0 + exp_f32(-x))
    }
}

/// A gated activation on one span, with the widest vectors this CPU has (same results).
fn gated_span<A: GatedActivation>(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (checked above).
            return unsafe { gated_avx512::<A>(gate, up) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { gated_avx2::<A>(gate, up) };
        }
    }
    gated_body::<A>(gate, up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gated_avx512<A: GatedActivation>(gate: &mut [f32], up: &[f32]) {
    gated_body::<A>(gate, up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn gated_avx2<A: GatedActivation>(gate: &mut [f32], up: &[f32]) {
    gated_body::<A>(gate, up)
}

#[inline(always)]
fn gated_body<A: GatedActivation>(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = A::act(*g) * u;
    }
}

/// `e^x` in f32 from plain IEEE operations (no FMA, no libm), within about 2 ulp: the same
/// bits on every CPU and in SIMD lanes. Inputs are clamped to `[−87, 88]` (results between
/// ~1.6e−38 and ~1.7e38); NaN stays NaN.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n·LN2_HI is exact for |n| < 2^10.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5·2^23: adding it rounds to an integer (ties to even), kept in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // e^r on |r| ≤ 0.35: Taylor to degree 7 (truncation below 2e−9).
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // 2^n from the integer in t's low mantissa bits (n ∈ [−126, 127]).
    let bits = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits((bits.wrapping_add(127) as u32) << 23);
    p * scale
}

/// `x *= factor`, elementwise (Gemma's √hidden embedding scale).
pub fn scale_in_place(x: &mut [f32], factor: f32) {
    for v in x {
        *v *= factor;
    }
}

/// SwiGLU: `gate = silu(gate) * up`, in place, `silu(x) = x / (1 + e^(−x))` with
/// [`exp_f32`] (like [`geglu_tanh`]: the same bits on every CPU, in SIMD lanes or not, and
/// large inputs split over the rayon pool).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len());
    elementwise(gate, up, gated_span::<Silu>);
}

/// `acc += x`, elementwise (the residual stream).
pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

#[cfg(test)]
mod tests;
