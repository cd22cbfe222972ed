use super::*;
use crate::model::testing::tiny_config;

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
