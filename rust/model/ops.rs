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

/// RoPE angles for one position: `cos`/`sin` of `pos · base^(−2i/d)` for `i < d/2`.
///
/// Computed in f64 from the integer position, so large clocks keep full precision.
pub fn rope_angles(pos: u64, head_dim: usize, base: f64, cos: &mut [f32], sin: &mut [f32]) {
    let half = head_dim / 2;
    for i in 0..half {
        let inv_freq = base.powf(-((2 * i) as f64) / head_dim as f64);
        let angle = pos as f64 * inv_freq;
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
pub fn geglu_tanh(gate: &mut [f32], up: &[f32]) {
    // √(2/π)
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        let inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
        *g = 0.5 * x * (1.0 + inner.tanh()) * u;
    }
}

/// `x *= factor`, elementwise (Gemma's √hidden embedding scale).
pub fn scale_in_place(x: &mut [f32], factor: f32) {
    for v in x {
        *v *= factor;
    }
}

/// SwiGLU: `gate = silu(gate) * up`, in place.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `acc += x`, elementwise (the residual stream).
pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

#[cfg(test)]
mod tests;
