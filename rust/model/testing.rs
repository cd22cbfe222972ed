//! Small synthetic models in the real tensor formats (Q4_1 matrices, a Q8_0 tied embedding,
//! F32 norms) — a Llama one and a Gemma 3 one (Q/K norms, post-norms, head width ≠
//! hidden / heads, sliding-window layers) — so the runtime's invariants are tested with
//! `cargo test` alone.

use std::sync::Arc;

use super::{Architecture, LlamaWeights, ModelConfig, Precision, SlidingWindow, TensorInfo};
use crate::quant::{quantize_weights, GgmlType};
use crate::ring::KvDtype;

/// Deterministic pseudo-random floats in [-1, 1).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// The tiny model's shape: GQA (4 query heads over 2 KV heads), 3 layers.
pub(crate) fn tiny_config() -> ModelConfig {
    ModelConfig {
        arch: Architecture::Llama,
        n_layers: 3,
        hidden: 64,
        ffn: 128,
        n_heads: 4,
        n_kv_heads: 2,
        key_length: 16,
        vocab: 96,
        rope_base: 10000.0,
        rms_eps: 1e-5,
        context_len: 512,
        attn_scale: 0.25,
        sliding: None,
    }
}

/// Sliding window of the tiny Gemma model: short enough that test prompts slide past it.
pub(crate) const TINY_WINDOW: usize = 12;

/// The tiny Gemma 3 model: 4 layers (0–2 slide over [`TINY_WINDOW`] keys, 3 is global),
/// 4 query heads of width 32 over one KV head (q width 128 ≠ hidden 64).
pub(crate) fn tiny_gemma_config() -> ModelConfig {
    ModelConfig {
        arch: Architecture::Gemma3,
        n_layers: 4,
        hidden: 64,
        ffn: 128,
        n_heads: 4,
        n_kv_heads: 1,
        key_length: 32,
        vocab: 96,
        rope_base: 1e6,
        rms_eps: 1e-6,
        context_len: 512,
        attn_scale: 1.0 / 32f32.sqrt(),
        sliding: Some(SlidingWindow {
            window: TINY_WINDOW,
            rope_base: 1e4,
            local: SlidingWindow::pattern(4, 4),
        }),
    }
}

/// Builds the tiny model's weights from `seed`.
pub(crate) fn tiny_weights(seed: u64) -> Arc<LlamaWeights> {
    tiny_weights_with(seed, Precision::Refined)
}

/// The tiny model at a given activation precision.
pub(crate) fn tiny_weights_with(seed: u64, precision: Precision) -> Arc<LlamaWeights> {
    synthetic_weights(tiny_config(), seed, precision)
}

/// The tiny Gemma 3 model's weights from `seed`.
pub(crate) fn tiny_gemma_weights(seed: u64) -> Arc<LlamaWeights> {
    synthetic_weights(tiny_gemma_config(), seed, Precision::Refined)
}

/// Random weights of every tensor `c`'s recipe needs, in GGUF layout.
pub(crate) fn synthetic_weights(
    c: ModelConfig,
    seed: u64,
    precision: Precision,
) -> Arc<LlamaWeights> {
    let (bytes, table) = synthetic_file(&c, seed);
    Arc::new(
        LlamaWeights::from_bytes(bytes, c, &table, precision, KvDtype::default())
            .expect("synthetic model is well formed"),
    )
}

/// The bytes and tensor table of a synthetic model file for `c`.
pub(crate) fn synthetic_file(c: &ModelConfig, seed: u64) -> (Vec<u8>, Vec<TensorInfo>) {
    let recipe = c.recipe();
    let mut rng = Lcg(seed);
    let mut bytes: Vec<u8> = Vec::new();
    let mut table = Vec::new();
    let mut push = |name: String, ggml_type: u32, cols: usize, rows: usize, scale: f32| {
        while !bytes.len().is_multiple_of(32) {
            bytes.push(0);
        }
        let offset = bytes.len() as u64;
        let values: Vec<f32> = (0..rows * cols).map(|_| rng.next() * scale).collect();
        match ggml_type {
            0 => {
                for v in &values {
                    // Norm weights around 1, like a trained model's.
                    bytes.extend_from_slice(&(1.0 + v).to_le_bytes());
                }
            }
            3 | 8 => {
                let dtype = GgmlType::from_id(ggml_type).expect("a ggml type");
                bytes.extend(quantize_weights(dtype, &values, cols).expect("whole blocks"));
            }
            _ => unreachable!(),
        }
        let dims = if rows == 1 {
            vec![cols as u64]
        } else {
            vec![cols as u64, rows as u64]
        };
        table.push(TensorInfo {
            name,
            ggml_type,
            dims,
            offset,
        });
    };
    let (h, q, kv, f, hd) = (c.hidden, c.q_dim(), c.kv_dim(), c.ffn, c.head_dim());
    push("token_embd.weight".into(), 8, h, c.vocab, 1.0);
    push("output_norm.weight".into(), 0, h, 1, 0.1);
    for i in 0..c.n_layers {
        push(format!("blk.{i}.attn_norm.weight"), 0, h, 1, 0.1);
        push(format!("blk.{i}.attn_q.weight"), 3, h, q, 0.3);
        push(format!("blk.{i}.attn_k.weight"), 3, h, kv, 0.3);
        push(format!("blk.{i}.attn_v.weight"), 3, h, kv, 0.3);
        push(format!("blk.{i}.attn_output.weight"), 3, q, h, 0.2);
        push(format!("blk.{i}.ffn_norm.weight"), 0, h, 1, 0.1);
        push(format!("blk.{i}.ffn_gate.weight"), 3, h, f, 0.3);
        push(format!("blk.{i}.ffn_up.weight"), 3, h, f, 0.3);
        push(format!("blk.{i}.ffn_down.weight"), 3, f, h, 0.2);
        if recipe.qkv_bias {
            push(format!("blk.{i}.attn_q.bias"), 0, q, 1, 0.1);
            push(format!("blk.{i}.attn_k.bias"), 0, kv, 1, 0.1);
            push(format!("blk.{i}.attn_v.bias"), 0, kv, 1, 0.1);
        }
        if recipe.qk_norm {
            push(format!("blk.{i}.attn_q_norm.weight"), 0, hd, 1, 0.1);
            push(format!("blk.{i}.attn_k_norm.weight"), 0, hd, 1, 0.1);
        }
        if recipe.post_norms {
            push(format!("blk.{i}.post_attention_norm.weight"), 0, h, 1, 0.1);
            push(format!("blk.{i}.post_ffw_norm.weight"), 0, h, 1, 0.1);
        }
    }
    (bytes, table)
}
