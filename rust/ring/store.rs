//! KV element storage: f32, or IEEE half precision (f16), as llama.cpp stores its KV cache.
//!
//! Every value crosses the ring's API as f32. An f16 ring rounds each value once, on the way
//! in, to nearest-even after saturating to ±65504 (so a large activation stays finite rather
//! than turning into an infinity that would poison the softmax); reads widen exactly. The
//! rounding is the same on every path (AVX-512, F16C, scalar), so a position holds the same
//! bits however it got into the ring: prefill, decode, replay of a volume, or recall.

use std::fmt;
use std::ops::Range;
use std::sync::OnceLock;

use half::f16;

/// Largest finite f16.
const F16_MAX: f32 = 65504.0;

/// How a ring stores K and V.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// Half precision: half the memory and half the bytes attention reads per key.
    #[default]
    F16,
    /// Single precision: the values exactly as computed.
    F32,
}

impl KvDtype {
    /// Bytes per stored value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    /// `"f16"` or `"f32"`.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }

    /// Parses [`KvDtype::name`].
    pub fn parse(name: &str) -> Option<KvDtype> {
        match name {
            "f16" => Some(KvDtype::F16),
            "f32" => Some(KvDtype::F32),
            _ => None,
        }
    }

    /// `x` as this storage keeps it (f16: saturated, rounded to nearest-even, widened back).
    pub fn round(self, x: f32) -> f32 {
        match self {
            KvDtype::F16 => f16::from_bits(to_f16_scalar(x)).to_f32(),
            KvDtype::F32 => x,
        }
    }

    /// [`KvDtype::round`] on every value of `xs`, in place.
    pub fn round_slice(self, xs: &mut [f32]) {
        if self == KvDtype::F16 {
            let mut bits = [0u16; 256];
            for chunk in xs.chunks_mut(256) {
                let n = chunk.len();
                encode(chunk, &mut bits[..n]);
                decode(&bits[..n], chunk);
            }
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One K or V buffer of a ring (or its journal).
#[derive(Debug)]
pub(crate) enum KvStore {
    F32(Vec<f32>),
    /// f16 bit patterns.
    F16(Vec<u16>),
}

/// A borrowed run of stored values.
#[derive(Clone, Copy, Debug)]
pub enum KvSlice<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 bit patterns.
    F16(&'a [u16]),
}

impl<'a> KvSlice<'a> {
    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) => s.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The storage type.
    pub fn dtype(&self) -> KvDtype {
        match self {
            KvSlice::F32(_) => KvDtype::F32,
            KvSlice::F16(_) => KvDtype::F16,
        }
    }

    /// The values at `range`.
    pub fn slice(&self, range: Range<usize>) -> KvSlice<'a> {
        match *self {
            KvSlice::F32(s) => KvSlice::F32(&s[range]),
            KvSlice::F16(s) => KvSlice::F16(&s[range]),
        }
    }

    /// Writes the values, widened to f32 (exact), into `dst` (of the same length).
    pub fn widen_into(&self, dst: &mut [f32]) {
        match self {
            KvSlice::F32(s) => dst.copy_from_slice(s),
            KvSlice::F16(s) => decode(s, dst),
        }
    }

    /// The values widened to f32 (a copy).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            KvSlice::F32(s) => s.to_vec(),
            KvSlice::F16(s) => {
                let mut out = vec![0.0; s.len()];
                decode(s, &mut out);
                out
            }
        }
    }
}

impl<'a> From<&'a [f32]> for KvSlice<'a> {
    fn from(s: &'a [f32]) -> Self {
        KvSlice::F32(s)
    }
}

impl<'a> From<&'a Vec<f32>> for KvSlice<'a> {
    fn from(s: &'a Vec<f32>) -> Self {
        KvSlice::F32(s)
    }
}

impl KvStore {
    /// `len` zeros, in one zeroed allocation (pages are touched only when written).
    pub(crate) fn zeros(dtype: KvDtype, len: usize) -> KvStore {
        match dtype {
            KvDtype::F32 => KvStore::F32(vec![0.0; len]),
            KvDtype::F16 => KvStore::F16(vec![0; len]),
        }
    }

    /// Values held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        match self {
            KvStore::F32(v) => v.len(),
            KvStore::F16(v) => v.len(),
        }
    }

    pub(crate) fn slice(&self, range: Range<usize>) -> KvSlice<'_> {
        match self {
            KvStore::F32(v) => KvSlice::F32(&v[range]),
            KvStore::F16(v) => KvSlice::F16(&v[range]),
        }
    }

    /// Stores `src` at `at` (f16: saturated and rounded).
    #[inline]
    pub(crate) fn put(&mut self, at: usize, src: &[f32]) {
        match self {
            KvStore::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            KvStore::F16(v) => encode(src, &mut v[at..at + src.len()]),
        }
    }

    /// Stores `src` at `at`: the bits where the types agree, else widened or rounded as
    /// [`KvStore::put`] rounds (exact for f16 bits, and for f32 values that are f16-exact).
    #[inline]
    pub(crate) fn put_slice(&mut self, at: usize, src: KvSlice<'_>) {
        match (self, src) {
            (KvStore::F16(v), KvSlice::F16(s)) => v[at..at + s.len()].copy_from_slice(s),
            (KvStore::F32(v), KvSlice::F16(s)) => decode(s, &mut v[at..at + s.len()]),
            (store, KvSlice::F32(s)) => store.put(at, s),
        }
    }

    /// Reads `dst.len()` values at `at` as stored (f16 bits from an f16 store; an f32 store
    /// rounds them as [`KvStore::put`] would).
    #[inline]
    pub(crate) fn get_bits(&self, at: usize, dst: &mut [u16]) {
        match self {
            KvStore::F16(v) => dst.copy_from_slice(&v[at..at + dst.len()]),
            KvStore::F32(v) => encode(&v[at..at + dst.len()], dst),
        }
    }

    /// Reads `dst.len()` values at `at`, widened to f32.
    #[inline]
    pub(crate) fn get(&self, at: usize, dst: &mut [f32]) {
        match self {
            KvStore::F32(v) => dst.copy_from_slice(&v[at..at + dst.len()]),
            KvStore::F16(v) => decode(&v[at..at + dst.len()], dst),
        }
    }

    /// Copies `len` values at `at` into `dst` at `dst_at` (same storage type: the bits).
    #[inline]
    pub(crate) fn copy_to(&self, at: usize, dst: &mut KvStore, dst_at: usize, len: usize) {
        match (self, dst) {
            (KvStore::F32(s), KvStore::F32(d)) => {
                d[dst_at..dst_at + len].copy_from_slice(&s[at..at + len])
            }
            (KvStore::F16(s), KvStore::F16(d)) => {
                d[dst_at..dst_at + len].copy_from_slice(&s[at..at + len])
            }
            _ => unreachable!("a ring and its journal share one storage type"),
        }
    }

    /// Zeros `range`.
    pub(crate) fn zero(&mut self, range: Range<usize>) {
        match self {
            KvStore::F32(v) => v[range].fill(0.0),
            KvStore::F16(v) => v[range].fill(0),
        }
    }
}

/// The f16 bits of `x`: saturated to ±65504 with the x86 `min`/`max` rule (a NaN becomes
/// +65504, exactly as the vector paths do it), then rounded to nearest-even.
#[inline]
fn to_f16_scalar(x: f32) -> u16 {
    let x = if x < F16_MAX { x } else { F16_MAX };
    let x = if x > -F16_MAX { x } else { -F16_MAX };
    f16::from_f32(x).to_bits()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Avx512,
    F16c,
    Scalar,
}

fn path() -> Path {
    static PATH: OnceLock<Path> = OnceLock::new();
    *PATH.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Path::Avx512;
            }
            if std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("avx")
            {
                return Path::F16c;
            }
        }
        Path::Scalar
    })
}

/// `dst[i] = f16 bits of src[i]` (saturating, nearest-even), the widest way this CPU can.
pub(crate) fn encode(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    match path() {
        // SAFETY: the features were detected; lengths are equal (asserted).
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { encode_avx512(src, dst) },
        #[cfg(target_arch = "x86_64")]
        Path::F16c => unsafe { encode_f16c(src, dst) },
        _ => encode_scalar(src, dst),
    }
}

/// `dst[i] = src[i]` widened to f32 (exact).
pub(crate) fn decode(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    match path() {
        // SAFETY: as for `encode`.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { decode_avx512(src, dst) },
        #[cfg(target_arch = "x86_64")]
        Path::F16c => unsafe { decode_f16c(src, dst) },
        _ => decode_scalar(src, dst),
    }
}

fn encode_scalar(src: &[f32], dst: &mut [u16]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = to_f16_scalar(x);
    }
}

fn decode_scalar(src: &[u16], dst: &mut [f32]) {
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = f16::from_bits(b).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn encode_avx512(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let (hi, lo) = (_mm512_set1_ps(F16_MAX), _mm512_set1_ps(-F16_MAX));
    let full = src.len() / 16 * 16;
    for i in (0..full).step_by(16) {
        // SAFETY: 16 values at i in both slices (i + 16 ≤ full).
        unsafe {
            // `min(x, hi)` returns `hi` for a NaN `x` (second operand), as the scalar rule.
            let x = _mm512_max_ps(_mm512_min_ps(_mm512_loadu_ps(src.as_ptr().add(i)), hi), lo);
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
            _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, h);
        }
    }
    encode_scalar(&src[full..], &mut dst[full..]);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn decode_avx512(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let full = src.len() / 16 * 16;
    for i in (0..full).step_by(16) {
        // SAFETY: 16 values at i in both slices.
        unsafe {
            let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
        }
    }
    decode_scalar(&src[full..], &mut dst[full..]);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn encode_f16c(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let (hi, lo) = (_mm256_set1_ps(F16_MAX), _mm256_set1_ps(-F16_MAX));
    let full = src.len() / 8 * 8;
    for i in (0..full).step_by(8) {
        // SAFETY: 8 values at i in both slices.
        unsafe {
            let x = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(src.as_ptr().add(i)), hi), lo);
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
        }
    }
    encode_scalar(&src[full..], &mut dst[full..]);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn decode_f16c(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let full = src.len() / 8 * 8;
    for i in (0..full).step_by(8) {
        // SAFETY: 8 values at i in both slices.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
    }
    decode_scalar(&src[full..], &mut dst[full..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn awkward_values() -> Vec<f32> {
        let mut xs = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            65504.0,
            65519.9,
            65520.0,
            1e9,
            -1e9,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            6.0e-8,
            2.9e-8,
            3.0e-8,
            1.0e-5,
            -1.0e-5,
            f32::MIN_POSITIVE,
            0.1,
            1.0 / 3.0,
        ];
        let mut z = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..1000 {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mantissa = ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            xs.push(mantissa * 2f32.powi((i % 40) - 28));
        }
        xs
    }

    #[test]
    fn every_path_rounds_to_the_same_bits() {
        let xs = awkward_values();
        let mut scalar = vec![0u16; xs.len()];
        encode_scalar(&xs, &mut scalar);
        let mut best = vec![0u16; xs.len()];
        encode(&xs, &mut best);
        assert_eq!(scalar, best);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("f16c") {
            let mut f16c = vec![0u16; xs.len()];
            // SAFETY: detected.
            unsafe { encode_f16c(&xs, &mut f16c) };
            assert_eq!(scalar, f16c);
        }
        let mut back_scalar = vec![0.0; xs.len()];
        decode_scalar(&scalar, &mut back_scalar);
        let mut back = vec![0.0; xs.len()];
        decode(&scalar, &mut back);
        assert_eq!(
            back_scalar.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn saturates_rounds_to_nearest_even_and_round_trips() {
        let r = |x: f32| KvDtype::F16.round(x);
        assert_eq!(r(1e9), 65504.0);
        assert_eq!(r(-1e9), -65504.0);
        assert_eq!(r(f32::INFINITY), 65504.0);
        assert_eq!(r(f32::NAN), 65504.0);
        // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties go to the even mantissa (1).
        assert_eq!(r(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(r(1.0 + 3.0 * 2f32.powi(-11)), 1.0 + 2.0 * 2f32.powi(-10));
        for x in awkward_values().into_iter().filter(|x| x.is_finite()) {
            let once = r(x);
            assert_eq!(
                r(once).to_bits(),
                once.to_bits(),
                "{x} is not a fixed point"
            );
            assert_eq!(KvDtype::F32.round(x).to_bits(), x.to_bits());
        }
        let mut xs = awkward_values();
        let expect: Vec<u32> = xs.iter().map(|&x| r(x).to_bits()).collect();
        KvDtype::F16.round_slice(&mut xs);
        assert_eq!(xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), expect);
    }

    #[test]
    fn stores_put_get_and_copy() {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let mut a = KvStore::zeros(dtype, 40);
            let xs: Vec<f32> = (0..17).map(|i| i as f32 * 0.37 - 3.0).collect();
            a.put(5, &xs);
            let mut got = vec![0.0; 17];
            a.get(5, &mut got);
            let want: Vec<f32> = xs.iter().map(|&x| dtype.round(x)).collect();
            assert_eq!(got, want);
            let mut b = KvStore::zeros(dtype, 40);
            a.copy_to(5, &mut b, 20, 17);
            b.get(20, &mut got);
            assert_eq!(got, want);
            b.zero(20..30);
            b.get(20, &mut got);
            assert!(got[..10].iter().all(|&x| x == 0.0));
            assert_eq!(b.slice(0..40).len(), 40);
            assert_eq!(b.slice(0..40).dtype(), dtype);
            assert_eq!(a.slice(5..22).to_f32(), want);
        }
        assert_eq!(KvDtype::parse("f16"), Some(KvDtype::F16));
        assert_eq!(KvDtype::parse("bf16"), None);
        assert_eq!(KvDtype::default().bytes(), 2);
    }
}
