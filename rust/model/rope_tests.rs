//! Llama 3.1/3.2 RoPE frequency scaling (`rope_freqs.weight`) on the tiny model: read from
//! the file, applied to every layer, bit-exact under chunking and range splits, and refused
//! when malformed.

use std::sync::Arc;

use super::testing::{synthetic_file, tiny_config};
use super::tests::{fwd, prompt, session};
use super::*;
use crate::ring::{KvDtype, SpanType};

/// Llama-3-like divisors for the tiny model's 8 pairs: 1 for the fast pairs, the full
/// factor for the slow ones, a blend between.
const LLAMA3_LIKE: [f32; 8] = [1.0, 1.0, 1.0, 1.5, 3.0, 8.0, 8.0, 8.0];

/// The tiny model with `factors` appended as `rope_freqs.weight` (none: no such tensor).
fn weights(factors: Option<&[f32]>) -> Result<Arc<LlamaWeights>, ModelError> {
    let c = tiny_config();
    let (mut bytes, mut table) = synthetic_file(&c, 7);
    if let Some(f) = factors {
        while !bytes.len().is_multiple_of(32) {
            bytes.push(0);
        }
        table.push(TensorInfo {
            name: "rope_freqs.weight".into(),
            ggml_type: 0,
            dims: vec![f.len() as u64],
            offset: bytes.len() as u64,
        });
        for v in f {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    LlamaWeights::from_bytes(bytes, c, &table, Precision::Refined, KvDtype::default()).map(Arc::new)
}

fn logits(w: &Arc<LlamaWeights>, tokens: &[u32], max_chunk: usize) -> Vec<f32> {
    fwd(
        &mut session(w, 0, 3, max_chunk),
        tokens,
        SpanType::User,
        LogitsWanted::All,
    )
    .1
}

#[test]
fn unit_factors_change_nothing_and_real_ones_change_the_logits() {
    let tokens = prompt(60, 3);
    let plain = weights(None).unwrap();
    let ones = weights(Some(&[1.0; 8])).unwrap();
    let scaled = weights(Some(&LLAMA3_LIKE)).unwrap();
    assert_eq!(ones.rope_factors(), Some(&[1.0f32; 8][..]));
    assert_eq!(plain.rope_factors(), None);
    let reference = logits(&plain, &tokens, 256);
    assert_eq!(logits(&ones, &tokens, 256), reference);
    let moved = logits(&scaled, &tokens, 256);
    assert_ne!(moved, reference);
    assert!(moved.iter().all(|v| v.is_finite()));
    // The first position rotates by 0 whatever the factors: same logits there.
    let vocab = tiny_config().vocab;
    assert_eq!(moved[..vocab], reference[..vocab]);
    // The tensor is part of the weights' identity.
    assert_ne!(scaled.fingerprint(), plain.fingerprint());
    assert_ne!(ones.fingerprint(), plain.fingerprint());
}

#[test]
fn scaled_rope_is_chunk_and_split_invariant() {
    let w = weights(Some(&LLAMA3_LIKE)).unwrap();
    let tokens = prompt(90, 5);
    let reference = logits(&w, &tokens, 256);
    for chunk in [1, 7, 64] {
        assert_eq!(logits(&w, &tokens, chunk), reference, "chunk {chunk}");
    }
    // Two stations (layers 0..1, 1..3) give the one-process logits.
    let mut hidden = Vec::new();
    let mut out = Vec::new();
    session(&w, 0, 1, 16)
        .forward(
            ChunkInput::Tokens(&tokens),
            SpanType::User,
            LogitsWanted::None,
            &mut hidden,
            &mut out,
        )
        .unwrap();
    let mut rest = Vec::new();
    session(&w, 1, 3, 16)
        .forward(
            ChunkInput::Hidden(&hidden),
            SpanType::User,
            LogitsWanted::All,
            &mut rest,
            &mut out,
        )
        .unwrap();
    assert_eq!(out, reference);
}

#[test]
fn malformed_factors_are_refused_by_name() {
    for (factors, expected) in [
        (&[1.0f32; 4][..], "rope_freqs.weight is 1x4, expected 1x8"),
        (&[1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0][..], "holds 0"),
        (&[1.0, -2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0][..], "holds -2"),
        (&[f32::NAN; 8][..], "holds NaN"),
    ] {
        let err = weights(Some(factors)).err().expect("refused").to_string();
        assert!(err.contains(expected), "{err}");
    }
}
