use super::*;
use crate::model::testing::{synthetic_file, tiny_config};
use crate::model::LayerRange;

#[test]
fn an_unsupported_tensor_type_is_refused_by_name() {
    // A Q4_1-sized tensor declared as IQ2_XS (17), and one with an id ggml lacks.
    let bytes = vec![0u8; 4096];
    for (id, expected) in [
        (
            17,
            "unsupported tensor type IQ2_XS in blk.3.ffn_down.weight",
        ),
        (99, "unknown ggml type id 99 in blk.3.ffn_down.weight"),
    ] {
        let table = [TensorInfo {
            name: "blk.3.ffn_down.weight".into(),
            ggml_type: id,
            dims: vec![256, 4],
            offset: 0,
        }];
        let err = LlamaWeights::from_bytes(
            bytes.clone(),
            tiny_config(),
            &table,
            Precision::Refined,
            KvDtype::default(),
        )
        .err()
        .expect("refused")
        .to_string();
        assert!(err.contains(expected), "{err}");
    }
}

/// The tiny model's file bytes and table, and its weights over `layers` (digests given or not).
fn range_weights(
    layers: Option<(usize, usize)>,
    digests: Option<Vec<Digest>>,
) -> Result<LlamaWeights, ModelError> {
    let c = tiny_config();
    let (bytes, table) = synthetic_file(&c, 4);
    let options = LoadOptions { layers, digests };
    LlamaWeights::from_bytes_with(
        bytes,
        c,
        &table,
        Precision::Refined,
        KvDtype::default(),
        options,
    )
}

fn file_digests() -> Vec<Digest> {
    let (bytes, table) = synthetic_file(&tiny_config(), 4);
    table
        .iter()
        .map(|t| {
            let e = validate_entry(t, bytes.len()).unwrap();
            digest::digest_bytes(&bytes[e.start..e.start + e.len])
        })
        .collect()
}

#[test]
fn every_range_has_the_whole_models_fingerprint_with_or_without_digests() {
    let whole = range_weights(None, None).unwrap().fingerprint();
    for (lo, hi) in [(0, 1), (1, 2), (2, 3), (0, 3), (1, 3)] {
        for digests in [None, Some(file_digests())] {
            let w = range_weights(Some((lo, hi)), digests).unwrap();
            assert_eq!(w.fingerprint(), whole, "{lo}:{hi}");
            assert_eq!(w.layers_held(), (lo, hi));
        }
    }
}

#[test]
fn a_range_holds_its_layers_only_and_computes_what_the_whole_model_does() {
    let whole = Arc::new(range_weights(None, None).unwrap());
    let middle = range_weights(Some((1, 2)), None).unwrap();
    for refused in [middle.layer(0).err(), middle.layer(2).err()] {
        assert!(refused.unwrap().to_string().contains("not held"));
    }
    assert!(middle.embedding().is_err() && middle.lm_head().is_err());
    let middle = Arc::new(middle);
    let err = LayerRange::new(Arc::clone(&middle), 0, 2).err().unwrap();
    assert!(err.to_string().contains("hold layers 1..2"), "{err}");
    // What each range holds is its share: the layers' bytes add up to the whole model's.
    let shares = [(0, 1), (1, 2), (2, 3)].map(|r| range_weights(Some(r), None).unwrap().memory());
    let sum: usize = shares.iter().map(|m| m.held).sum();
    let embd = whole.token_embd.len;
    // The tied head is held by the entry (embedding) and by the exit (head).
    assert_eq!(sum, whole.memory().held + embd);
    assert!(shares.iter().all(|m| m.mapped.is_none()));
    // A chain of range weights computes the whole model's logits, bit for bit.
    let tokens: Vec<u32> = (0..20).map(|i| (i * 11 + 3) % 96).collect();
    let reference = run_chain(&[(Arc::clone(&whole), 0, 3)], &tokens);
    let chain = [(0, 1), (1, 2), (2, 3)].map(|(lo, hi)| {
        (
            Arc::new(range_weights(Some((lo, hi)), None).unwrap()),
            lo,
            hi,
        )
    });
    assert_eq!(run_chain(&chain, &tokens), reference);
}

/// Logits of every position, through a chain of ranges (each on its own weights).
fn run_chain(chain: &[(Arc<LlamaWeights>, usize, usize)], tokens: &[u32]) -> Vec<u32> {
    let cfg = crate::model::SessionConfig {
        slots: 64,
        recall: 8,
        n_sys: 0,
        max_chunk: 32,
    };
    let (mut hidden, mut logits) = (Vec::new(), Vec::new());
    for (w, lo, hi) in chain {
        let mut s = crate::model::RangeSession::new(Arc::clone(w), *lo, *hi, &cfg).unwrap();
        let input = if *lo == 0 {
            crate::model::ChunkInput::Tokens(tokens)
        } else {
            crate::model::ChunkInput::Hidden(&hidden)
        };
        let wanted = if s.is_exit() {
            crate::model::LogitsWanted::All
        } else {
            crate::model::LogitsWanted::None
        };
        let mut out = Vec::new();
        s.forward(
            input,
            crate::ring::SpanType::User,
            wanted,
            &mut out,
            &mut logits,
        )
        .unwrap();
        hidden = out;
    }
    logits.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn a_tensor_that_differs_from_its_recorded_digest_is_refused_by_its_owner_only() {
    let table = synthetic_file(&tiny_config(), 4).1;
    let victim = table
        .iter()
        .position(|t| t.name == "blk.1.ffn_up.weight")
        .unwrap();
    let mut wrong = file_digests();
    wrong[victim][0] ^= 1;
    let err = range_weights(Some((1, 2)), Some(wrong.clone()))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("blk.1.ffn_up.weight"), "{err}");
    // Another range trusts the recorded digest, and so reports another fingerprint: the
    // mesh's fingerprint check catches the disagreement.
    let other = range_weights(Some((0, 1)), Some(wrong)).unwrap();
    assert_ne!(
        other.fingerprint(),
        range_weights(None, None).unwrap().fingerprint()
    );
    assert!(range_weights(Some((0, 1)), Some(vec![[0; 32]])).is_err());
    assert!(range_weights(Some((2, 2)), None).is_err());
    assert!(range_weights(Some((0, 4)), None).is_err());
}

#[test]
fn ownership_tiles_the_table() {
    let names = [
        "token_embd.weight",
        "rope_freqs.weight",
        "output_norm.weight",
        "output.weight",
        "blk.0.attn_q.weight",
        "blk.2.ffn_down.weight",
        "blk.9.extra",
    ];
    for name in names {
        let owners = [(0, 1), (1, 2), (2, 3)]
            .iter()
            .filter(|(lo, hi)| owned_by(name, *lo, *hi, 3))
            .count();
        assert_eq!(owners, 1, "{name}");
    }
}

#[test]
fn a_mapped_range_leaves_the_rest_of_the_file_untouched() {
    // A model large enough that a layer spans many pages and many page-cache folios: 6 layers
    // of ~10 MB.
    let c = crate::model::ModelConfig {
        hidden: 1024,
        ffn: 4096,
        n_heads: 16,
        n_kv_heads: 4,
        key_length: 64,
        n_layers: 6,
        vocab: 256,
        ..tiny_config()
    };
    let (bytes, table) = synthetic_file(&c, 5);
    let path = std::env::temp_dir().join(format!("amplituhedron-range-{}.bin", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let load = |layers| {
        let options = LoadOptions {
            layers,
            digests: Some(tensor_digests(&path, &table).unwrap()),
        };
        LlamaWeights::from_file_with(
            &path,
            c.clone(),
            &table,
            Precision::Refined,
            KvDtype::default(),
            options,
        )
        .unwrap()
    };
    let whole = load(None);
    let middle = load(Some((2, 4)));
    std::fs::remove_file(&path).unwrap();
    assert_eq!(middle.fingerprint(), whole.fingerprint());
    let m = middle.memory();
    let Some(mapped) = m.mapped else {
        return; // no /proc/self/smaps here
    };
    let own: Vec<_> = table
        .iter()
        .filter(|t| t.name.starts_with("blk.2.") || t.name.starts_with("blk.3."))
        .collect();
    let layer_bytes: usize = own
        .iter()
        .map(|t| validate_entry(t, bytes.len()).unwrap().len)
        .sum();
    assert_eq!(m.held, layer_bytes);
    let in_place = if m.copied == 0 {
        own.len()
    } else {
        own.iter()
            .filter(|t| t.name.ends_with("norm.weight"))
            .count()
    };
    // Its in-place tensors (the norms, or everything without SIMD), and what the kernel maps
    // with each fault: the fault-around window (64 KiB) and, with large page-cache folios
    // (ext4 since Linux 6.16), the whole folio holding the page, up to 2 MiB, and its
    // neighbour's: nothing else.
    let per_fault = 2 * (2 << 20);
    assert!(mapped <= m.held - m.copied + in_place * per_fault, "{m:?}");
    // So never the other layers: what it maps is less than half of what it does not hold.
    let others = whole.memory().held - m.held;
    assert!(mapped * 2 < others, "{m:?}, the others hold {others}");
}
