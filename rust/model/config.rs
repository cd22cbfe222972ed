//! The model description: one layer recipe, its variations read from GGUF metadata.
//!
//! Every supported architecture is the same pre-norm decoder block with a few switches
//! (RoPE pairing, Q/K norms, post-norms, the gated activation, sliding-window layers…), so
//! the forward pass is written once and reads them from here; no architecture gets a fork.

use std::fmt;

use super::ModelError;

/// A GGUF `general.architecture` the runtime runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// Llama 2/3, SmolLM2…: SwiGLU, RoPE on adjacent pairs (GGUF permutes `attn_q`/`attn_k`).
    Llama,
    /// Qwen 2: the Llama block with Q/K/V biases and RoPE on the two halves of a head.
    Qwen2,
    /// Gemma 3: √hidden embedding scale, Q/K RMSNorm, post-attention and post-FFN norms,
    /// GELU-tanh gated FFN, sliding-window local layers interleaved with global ones.
    Gemma3,
}

impl Architecture {
    /// Every supported architecture.
    pub const ALL: [Architecture; 3] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Gemma3,
    ];

    /// The GGUF name (`general.architecture`).
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Gemma3 => "gemma3",
        }
    }

    /// Parses a GGUF architecture name; the error names it and lists what is supported.
    pub fn from_name(name: &str) -> Result<Self, ModelError> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|a| a.name()).collect();
                ModelError::Config(format!(
                    "architecture {name:?} is not supported (supported: {})",
                    known.join(", ")
                ))
            })
    }
}

/// Which coordinates RoPE rotates together (llama.cpp's `rope_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i+1)` (llama.cpp "norm"; the Llama GGUF converter permutes Q/K for it).
    Adjacent,
    /// Pairs `(i, i + head_dim/2)` (llama.cpp "neox": Qwen 2, Gemma 3).
    Halves,
}

/// The gate's non-linearity in the gated FFN `down(act(gate(x)) * up(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// SiLU (SwiGLU).
    Silu,
    /// GELU, tanh approximation (GeGLU).
    GeluTanh,
}

/// The architecture-specific parts of the block, fixed by the architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recipe {
    /// RoPE pairing.
    pub rope_style: RopeStyle,
    /// Gate non-linearity.
    pub activation: Activation,
    /// RMSNorm of every query and key head (`attn_q_norm`, `attn_k_norm`) before RoPE.
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before the residual add
    /// (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    /// Embeddings are multiplied by √hidden.
    pub scale_embeddings: bool,
    /// `attn_q`/`attn_k`/`attn_v` carry biases.
    pub qkv_bias: bool,
}

impl Recipe {
    /// The block of `arch`.
    pub fn of(arch: Architecture) -> Recipe {
        let llama = Recipe {
            rope_style: RopeStyle::Adjacent,
            activation: Activation::Silu,
            qk_norm: false,
            post_norms: false,
            scale_embeddings: false,
            qkv_bias: false,
        };
        match arch {
            Architecture::Llama => llama,
            Architecture::Qwen2 => Recipe {
                rope_style: RopeStyle::Halves,
                qkv_bias: true,
                ..llama
            },
            Architecture::Gemma3 => Recipe {
                rope_style: RopeStyle::Halves,
                activation: Activation::GeluTanh,
                qk_norm: true,
                post_norms: true,
                scale_embeddings: true,
                qkv_bias: false,
            },
        }
    }
}

/// Sliding-window (local) attention of some layers, as llama.cpp's `LLAMA_SWA_TYPE_STANDARD`:
/// a query at position `p` sees the keys at `p − window + 1 ..= p`.
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Keys a local query sees, itself included (`{arch}.attention.sliding_window`).
    pub window: usize,
    /// RoPE base of the local layers (`{arch}.rope.freq_base_swa`, 10,000 by default).
    pub rope_base: f64,
    /// `local[i]`: layer `i` is a sliding-window layer (the others attend globally).
    pub local: Vec<bool>,
}

impl SlidingWindow {
    /// llama.cpp's layer pattern of period `n` (the last layer of each period is global;
    /// `n = 0`: every layer is local).
    pub fn pattern(n_layers: usize, period: usize) -> Vec<bool> {
        (0..n_layers)
            .map(|i| period == 0 || i % period < period - 1)
            .collect()
    }
}

/// The shape and recipe of a decoder, as read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture`.
    pub arch: Architecture,
    /// Number of transformer blocks (`{arch}.block_count`).
    pub n_layers: usize,
    /// Residual stream width (`{arch}.embedding_length`).
    pub hidden: usize,
    /// Gated-FFN inner width (`{arch}.feed_forward_length`).
    pub ffn: usize,
    /// Query heads (`{arch}.attention.head_count`).
    pub n_heads: usize,
    /// Key/value heads (`{arch}.attention.head_count_kv`); GQA when smaller than `n_heads`.
    pub n_kv_heads: usize,
    /// Width of one query/key/value head (`{arch}.attention.key_length`, else
    /// `hidden / n_heads`). Gemma 3 270M: 256 with hidden 640 and 4 heads.
    pub key_length: usize,
    /// Vocabulary size (rows of `token_embd`).
    pub vocab: usize,
    /// RoPE base frequency of the global layers (`{arch}.rope.freq_base`).
    pub rope_base: f64,
    /// RMSNorm epsilon (`{arch}.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// Trained context length (`{arch}.context_length`): positions the model has seen.
    pub context_len: usize,
    /// Attention logit scale (1/√key_length; Gemma 3 27B uses 1/√(hidden/heads)).
    pub attn_scale: f32,
    /// Sliding-window layers, if the model has any.
    pub sliding: Option<SlidingWindow>,
}

impl ModelConfig {
    /// The block recipe of this architecture.
    pub fn recipe(&self) -> Recipe {
        Recipe::of(self.arch)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.key_length
    }

    /// Width of the Q projection (and of the attention output): `n_heads × head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim()
    }

    /// Width of the K (or V) projection: `n_kv_heads × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim()
    }

    /// Whether layer `i` attends through the sliding window.
    pub fn is_local(&self, layer: usize) -> bool {
        self.sliding
            .as_ref()
            .is_some_and(|s| s.local.get(layer).copied().unwrap_or(false))
    }

    /// RoPE base of layer `i`.
    pub fn rope_base_of(&self, layer: usize) -> f64 {
        match &self.sliding {
            Some(s) if self.is_local(layer) => s.rope_base,
            _ => self.rope_base,
        }
    }

    /// Keys a query of layer `i` may see at most (`None`: every earlier position).
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        match &self.sliding {
            Some(s) if self.is_local(layer) => Some(s.window),
            _ => None,
        }
    }

    /// Multiplier of the token embeddings.
    pub fn embed_scale(&self) -> f32 {
        if self.recipe().scale_embeddings {
            (self.hidden as f32).sqrt()
        } else {
            1.0
        }
    }

    /// Checks the invariants the kernels rely on.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |what: String| Err(ModelError::Config(what));
        if self.n_layers == 0 || self.hidden == 0 || self.ffn == 0 || self.vocab == 0 {
            return bad(format!("zero-sized model dimension in {self}"));
        }
        if self.n_heads == 0 || self.n_kv_heads == 0 || self.key_length == 0 {
            return bad(format!(
                "heads and head width must be positive (heads {}, KV heads {}, head width {})",
                self.n_heads, self.n_kv_heads, self.key_length
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
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.rope_base) {
            return bad(format!(
                "rope base must be positive, got {}",
                self.rope_base
            ));
        }
        if !positive(f64::from(self.rms_eps)) {
            return bad(format!(
                "rms epsilon must be positive, got {}",
                self.rms_eps
            ));
        }
        if !positive(f64::from(self.attn_scale)) {
            return bad(format!(
                "attention scale must be positive, got {}",
                self.attn_scale
            ));
        }
        if self.context_len == 0 {
            return bad("context length is zero".into());
        }
        if let Some(s) = &self.sliding {
            if s.window == 0 || !positive(s.rope_base) || s.local.len() != self.n_layers {
                return bad(format!(
                    "sliding window {} with rope base {} over {} layer flags does not fit {} \
                     layers",
                    s.window,
                    s.rope_base,
                    s.local.len(),
                    self.n_layers
                ));
            }
        }
        Ok(())
    }

    /// A canonical text form, folded into the model fingerprint (config changes ⇒ new key).
    pub fn canonical(&self) -> String {
        let mut s = format!(
            "{};layers={};hidden={};ffn={};heads={};kv_heads={};head_dim={};vocab={};\
             rope_base={:e};rms_eps={:e};ctx={};attn_scale={:e}",
            self.arch.name(),
            self.n_layers,
            self.hidden,
            self.ffn,
            self.n_heads,
            self.n_kv_heads,
            self.key_length,
            self.vocab,
            self.rope_base,
            self.rms_eps,
            self.context_len,
            self.attn_scale,
        );
        if let Some(w) = &self.sliding {
            let flags: String = w.local.iter().map(|&l| if l { 'L' } else { 'G' }).collect();
            s.push_str(&format!(
                ";swa={};swa_rope_base={:e};layers={flags}",
                w.window, w.rope_base
            ));
        }
        s
    }
}

impl fmt::Display for ModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.canonical())
    }
}

#[cfg(test)]
pub(crate) fn smollm2_config() -> ModelConfig {
    ModelConfig {
        arch: Architecture::Llama,
        n_layers: 30,
        hidden: 576,
        ffn: 1536,
        n_heads: 9,
        n_kv_heads: 3,
        key_length: 64,
        vocab: 49152,
        rope_base: 100000.0,
        rms_eps: 1e-5,
        context_len: 8192,
        attn_scale: 0.125,
        sliding: None,
    }
}

#[cfg(test)]
mod tests;
