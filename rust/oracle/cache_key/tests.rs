use super::*;

#[test]
fn tags_and_encodings_match_the_lean() {
    let memo = LeanCacheKey::Memo { input_hash: 42 };
    let volume = LeanCacheKey::Volume {
        model_fingerprint: 7,
        prefix_hash: 42,
        layer_lo: 0,
        layer_hi: 32,
    };
    assert_eq!((memo.tag(), volume.tag()), (1, 2));
    assert_eq!(memo.encode(), [1, 42]);
    assert_eq!(volume.encode(), [2, 7, 42, 0, 32]);
}

#[test]
fn encodings_of_the_two_spaces_never_share_a_head() {
    let memo = LeanCacheKey::Memo { input_hash: 2 };
    let volume = LeanCacheKey::Volume {
        model_fingerprint: 1,
        prefix_hash: 2,
        layer_lo: 0,
        layer_hi: 0,
    };
    assert_ne!(memo.encode()[0], volume.encode()[0]);
    assert_ne!(memo.encode(), volume.encode());
}
