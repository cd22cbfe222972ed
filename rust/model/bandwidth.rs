//! The host's read bandwidth as the runtime's own workers see it: the floor a memory-bound
//! decode step is measured against (`amplituhedron bench-rows`, SPEC §15).
//!
//! Each worker of the [`runtime_pool`](super::runtime_pool) folds its share of a buffer larger
//! than any cache with XOR over eight independent lanes: loads and nothing else, so the
//! probe is bound by memory on any core, unlike a probe whose arithmetic can fall behind the
//! loads when a shared host slows the clock.

use std::time::Instant;

use rayon::prelude::*;

/// A buffer to stream, written once (so every page is resident before it is timed).
pub struct ReadProbe {
    words: Vec<u64>,
}

impl ReadProbe {
    /// A probe over `bytes` bytes (rounded down to whole 64-byte lines; at least one line).
    pub fn new(bytes: usize) -> ReadProbe {
        let lines = (bytes / 64).max(1);
        // Huge pages, as the weights have: the probe measures what a stream of them can read.
        let mut words = vec![0u64; lines * 8];
        super::advise_huge_pages(&mut words);
        for (i, w) in words.iter_mut().enumerate() {
            *w = i as u64;
        }
        ReadProbe { words }
    }

    /// Bytes the probe reads per pass.
    pub fn bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Bytes per second of the fastest of `passes` passes, each reading the whole buffer
    /// once on the runtime pool (one share per worker).
    pub fn measure(&self, passes: usize) -> f64 {
        let threads = super::runtime_pool().current_num_threads();
        let share = self.words.len().div_ceil(threads).next_multiple_of(8);
        let mut best = 0.0f64;
        for _ in 0..passes.max(1) {
            let seconds = super::run_on_pool(|| {
                let t0 = Instant::now();
                let folded = self
                    .words
                    .par_chunks(share)
                    .map(fold)
                    .reduce(|| 0, |a, b| a ^ b);
                std::hint::black_box(folded);
                t0.elapsed().as_secs_f64()
            });
            best = best.max(self.bytes() as f64 / seconds);
        }
        best
    }
}

/// XOR of every word, with the widest loads this CPU has (as wide as a streaming reader's).
fn fold(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has the feature the function is compiled for.
        return unsafe { fold_avx512(words) };
    }
    fold_lanes(words)
}

/// [`fold`] with 64-byte loads into four independent accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fold_avx512(words: &[u64]) -> u64 {
    use core::arch::x86_64::*;
    let mut chunks = words.chunks_exact(32);
    let mut acc = [_mm512_setzero_si512(); 4];
    for c in &mut chunks {
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c` holds 32 words, four vectors of eight; unaligned loads.
            let v = unsafe { _mm512_loadu_si512(c.as_ptr().add(8 * k) as *const _) };
            *a = _mm512_xor_si512(*a, v);
        }
    }
    let all = _mm512_xor_si512(
        _mm512_xor_si512(acc[0], acc[1]),
        _mm512_xor_si512(acc[2], acc[3]),
    );
    let mut out = [0u64; 8];
    // SAFETY: `out` holds eight words.
    unsafe { _mm512_storeu_si512(out.as_mut_ptr() as *mut _, all) };
    fold_lanes(chunks.remainder()) ^ out.iter().fold(0, |a, w| a ^ w)
}

/// XOR of every word over eight lanes, so the loads need not wait on one another.
fn fold_lanes(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let mut chunks = words.chunks_exact(8);
    for c in &mut chunks {
        for (l, w) in lanes.iter_mut().zip(c) {
            *l ^= w;
        }
    }
    let rest = chunks.remainder().iter().fold(0, |a, w| a ^ w);
    lanes.iter().fold(rest, |a, l| a ^ l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_reads_every_word_and_reports_a_rate() {
        let probe = ReadProbe::new(1 << 20);
        assert_eq!(probe.bytes(), 1 << 20);
        let words = (1 << 20) / 8;
        // XOR of 0..n over eight lanes equals the plain XOR: every word was read once.
        assert_eq!(fold(&probe.words), (0..words as u64).fold(0, |a, w| a ^ w));
        assert_eq!(fold(&[1, 2, 4]), 7);
        assert_eq!(fold_lanes(&probe.words), fold(&probe.words));
        assert!(probe.measure(2) > 0.0);
        assert_eq!(ReadProbe::new(0).bytes(), 64);
    }
}
