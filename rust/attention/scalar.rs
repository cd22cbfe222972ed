//! The portable lanes: `[f32; 16]` with `f32::mul_add`, the reference every SIMD path
//! matches bit for bit.

use super::kernel::{Lanes, LANES};

#[derive(Clone, Copy)]
pub(super) struct ScalarLanes([f32; LANES]);

impl ScalarLanes {
    #[inline(always)]
    fn map2(a: Self, b: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        ScalarLanes(std::array::from_fn(|l| f(a.0[l], b.0[l])))
    }

    #[inline(always)]
    fn tree(self, f: impl Fn(f32, f32) -> f32) -> f32 {
        let x = self.0;
        let t8: [f32; 8] = std::array::from_fn(|l| f(x[l], x[l + 8]));
        let t4: [f32; 4] = std::array::from_fn(|l| f(t8[l], t8[l + 4]));
        let t2: [f32; 2] = std::array::from_fn(|l| f(t4[l], t4[l + 2]));
        f(t2[0], t2[1])
    }
}

#[inline(always)]
fn max_rule(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

impl Lanes for ScalarLanes {
    const KEY_GROUP: usize = 8;
    const SCORE_HEADS: usize = 3;
    const VALUE_VECTORS: usize = 4;
    const VALUE_HEADS: usize = 4;

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        ScalarLanes([x; LANES])
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        ScalarLanes(ptr.cast::<[f32; LANES]>().read_unaligned())
    }
    #[inline(always)]
    unsafe fn load_f16(ptr: *const u16) -> Self {
        let bits = ptr.cast::<[u16; LANES]>().read_unaligned();
        ScalarLanes(bits.map(|b| half::f16::from_bits(b).to_f32()))
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        ptr.cast::<[f32; LANES]>().write_unaligned(self.0)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        ScalarLanes(std::array::from_fn(|l| a.0[l].mul_add(b.0[l], c.0[l])))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Self::map2(a, b, |x, y| x + y)
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Self::map2(a, b, |x, y| x - y)
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Self::map2(a, b, |x, y| x * y)
    }
    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        Self::map2(a, b, max_rule)
    }
    #[inline(always)]
    unsafe fn round_even(a: Self) -> Self {
        ScalarLanes(a.0.map(f32::round_ties_even))
    }
    #[inline(always)]
    unsafe fn pow2_int(a: Self) -> Self {
        ScalarLanes(a.0.map(|n| f32::from_bits(((n as i32 + 127) as u32) << 23)))
    }
    #[inline(always)]
    unsafe fn zero_below(x: Self, threshold: f32, y: Self) -> Self {
        Self::map2(x, y, |x, y| if x < threshold { 0.0 } else { y })
    }
    #[inline(always)]
    unsafe fn hsum(self) -> f32 {
        self.tree(|a, b| a + b)
    }
    #[inline(always)]
    unsafe fn hmax(self) -> f32 {
        self.tree(max_rule)
    }
}
