//! The portable finiteness loops of [`super::slab`] compiled for AVX2 (twice the lanes of the
//! SSE2 baseline for the check), chosen at run time: the crate is built for baseline x86-64,
//! so without this the check would stay SSE2.

use super::slab::{all_finite_portable, copy_all_finite_portable, KvElem};

/// # Safety
/// The CPU supports AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn all_finite<T: KvElem>(values: &[T]) -> bool {
    all_finite_portable(values)
}

/// # Safety
/// The CPU supports AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn copy_all_finite<T: KvElem>(src: &[T], dst: &mut [T]) -> bool {
    copy_all_finite_portable(src, dst)
}
