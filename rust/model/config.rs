//! Hyper-parameters of a Llama-architecture model, as read from GGUF metadata.

use std::fmt;

use super::ModelError;

/// The shape of a Llama-architecture decoder (SmolLM2, Llama 2/3, Qwen2-without-bias…).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Number of transformer blocks (`llama.block_count`).
    pub n_layers: usize,
    /// Residual stream width (`llama.embedding_length`).
    pub hidden: usize,
    /// SwiGLU inner width (`llama.feed_forward_length`).
    pub ffn: usize,
    /// Query heads (`llama.attention.head_count`).
    pub n_heads: usize,
    /// Key/value heads (`llama.attention.head_count_kv`); GQA when smaller than `n_heads`.
    pub n_kv_heads: usize,
    /// Vocabulary size (rows of `token_embd`).
    pub vocab: usize,
    /// RoPE base frequency (`llama.rope.freq_base`).
    pub rope_base: f64,
    /// RMSNorm epsilon (`llama.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// Trained context length (`llama.context_length`): positions the model has seen.
    pub context_len: usize,
}

impl LlamaConfig {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.n_heads
    }

    /// Width of the K (or V) projection: `n_kv_heads × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim()
    }

    /// Checks the invariants the kernels rely on.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |what: String| Err(ModelError::Config(what));
        if self.n_layers == 0 || self.hidden == 0 || self.ffn == 0 || self.vocab == 0 {
            return bad(format!("zero-sized model dimension in {self}"));
        }
        if self.n_heads == 0 || self.n_kv_heads == 0 || !self.hidden.is_multiple_of(self.n_heads) {
            return bad(format!(
                "hidden {} is not divisible by {} heads",
                self.hidden, self.n_heads
            ));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "RoPE needs an even head_dim, got {}",
                self.head_dim()
            ));
        }
        if self.n_layers > u16::MAX as usize {
            return bad(format!(
                "{} layers do not fit a u16 layer index",
                self.n_layers
            ));
        }
        if !(self.rope_base.is_finite() && self.rope_base > 0.0) {
            return bad(format!(
                "rope base must be positive, got {}",
                self.rope_base
            ));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return bad(format!(
                "rms epsilon must be positive, got {}",
                self.rms_eps
            ));
        }
        if self.context_len == 0 {
            return bad("context length is zero".into());
        }
        Ok(())
    }

    /// A canonical text form, folded into the model fingerprint (config changes ⇒ new key).
    pub fn canonical(&self) -> String {
        format!(
            "llama;layers={};hidden={};ffn={};heads={};kv_heads={};vocab={};rope_base={:e};rms_eps={:e};ctx={}",
            self.n_layers,
            self.hidden,
            self.ffn,
            self.n_heads,
            self.n_kv_heads,
            self.vocab,
            self.rope_base,
            self.rms_eps,
            self.context_len
        )
    }
}

impl fmt::Display for LlamaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.canonical())
    }
}

#[cfg(test)]
pub(crate) fn smollm2_config() -> LlamaConfig {
    LlamaConfig {
        n_layers: 30,
        hidden: 576,
        ffn: 1536,
        n_heads: 9,
        n_kv_heads: 3,
        vocab: 49152,
        rope_base: 100000.0,
        rms_eps: 1e-5,
        context_len: 8192,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_shapes() {
        let c = smollm2_config();
        c.validate().unwrap();
        assert_eq!(c.head_dim(), 64);
        assert_eq!(c.kv_dim(), 192);
    }

    #[test]
    fn rejects_heads_that_do_not_divide() {
        let mut c = smollm2_config();
        c.n_kv_heads = 4;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("not a multiple"), "{err}");
    }

    #[test]
    fn canonical_form_changes_with_any_field() {
        let a = smollm2_config();
        let mut b = a.clone();
        b.rope_base = 10000.0;
        assert_ne!(a.canonical(), b.canonical());
    }
}
