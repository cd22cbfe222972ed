use super::*;

#[test]
fn smollm2_shapes() {
    let c = smollm2_config();
    c.validate().unwrap();
    assert_eq!(c.head_dim(), 64);
    assert_eq!(c.kv_dim(), 192);
    assert_eq!(c.q_dim(), c.hidden);
    assert_eq!(c.embed_scale(), 1.0);
    assert!(!c.is_local(0));
    assert_eq!(c.window_of(0), None);
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
    let mut c = a.clone();
    c.arch = Architecture::Qwen2;
    assert_ne!(a.canonical(), c.canonical());
}

#[test]
fn gemma3_layer_pattern_follows_llama_cpp() {
    // Period 6: layers 5, 11, 17 are global, the rest slide.
    let local = SlidingWindow::pattern(18, 6);
    let global: Vec<usize> = (0..18).filter(|&i| !local[i]).collect();
    assert_eq!(global, vec![5, 11, 17]);
    let c = ModelConfig {
        arch: Architecture::Gemma3,
        n_layers: 18,
        hidden: 640,
        ffn: 2048,
        n_heads: 4,
        n_kv_heads: 1,
        key_length: 256,
        vocab: 262144,
        rope_base: 1e6,
        rms_eps: 1e-6,
        context_len: 32768,
        attn_scale: 1.0 / 16.0,
        sliding: Some(SlidingWindow {
            window: 512,
            rope_base: 1e4,
            local,
        }),
    };
    c.validate().unwrap();
    assert_eq!((c.q_dim(), c.kv_dim()), (1024, 256));
    assert_eq!(c.rope_base_of(0), 1e4);
    assert_eq!(c.rope_base_of(5), 1e6);
    assert_eq!(c.window_of(4), Some(512));
    assert_eq!(c.window_of(11), None);
    assert_eq!(c.embed_scale(), 640f32.sqrt());
    let r = c.recipe();
    assert!(r.qk_norm && r.post_norms && r.activation == Activation::GeluTanh);
    assert_eq!(r.rope_style, RopeStyle::Halves);
}

#[test]
fn unknown_architecture_is_named() {
    let err = Architecture::from_name("mamba").unwrap_err().to_string();
    assert!(err.contains("\"mamba\"") && err.contains("gemma3"), "{err}");
    assert_eq!(
        Architecture::from_name("qwen2").unwrap(),
        Architecture::Qwen2
    );
}

#[test]
fn sliding_flags_must_cover_every_layer() {
    let mut c = smollm2_config();
    c.sliding = Some(SlidingWindow {
        window: 4,
        rope_base: 1e4,
        local: vec![true; 3],
    });
    assert!(c.validate().is_err());
}
