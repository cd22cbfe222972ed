//! The portable finiteness loops of [`super::slab`] compiled for AVX2 (twice the lanes of the
//! SSE2 baseline for the check), chosen at run time: the crate is built for baseline x86-64,
//! so without this the check would stay SSE2.

use super::slab::{all_finite_portable, copy_all_finite_portable};

/// # Safety
/// The CPU supports AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn all_finite(values: &[f32]) -> bool {
    all_finite_portable(values)
}

/// # Safety
/// The CPU supports AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn copy_all_finite(src: &[f32], dst: &mut [f32]) -> bool {
    copy_all_finite_portable(src, dst)
}
