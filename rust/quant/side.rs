//! Memory a matmul brings into cache for the next stage while it computes.
//!
//! A batched decode step is compute-bound in its matmuls and memory-bound in attention,
//! which reads every sequence's K/V history from DRAM. A [`SidePrefetch`] lists the bytes the
//! next stage will read (the next layer's K/V rows); the lane kernels prefetch a share of its
//! cache lines for every row group they compute, so those reads overlap the arithmetic
//! instead of following it. Prefetches never fault and change no value: results are
//! bit-identical with or without one.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Bytes of a cache line.
const LINE: usize = 64;
/// Rows of a kernel row group (the kernels claim one share per group).
const GROUP_ROWS: usize = 16;

/// Cache lines to prefetch, spread over the row groups of the matmuls that carry it.
#[derive(Default)]
pub struct SidePrefetch {
    /// `(first line address, lines)` of each range.
    ranges: Vec<(usize, usize)>,
    /// Lines before each range (prefix sums of `ranges`' counts).
    before: Vec<usize>,
    lines: usize,
    per_group: usize,
    next: AtomicUsize,
}

impl SidePrefetch {
    /// An empty list (prefetches nothing).
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets every range, keeping the allocations.
    pub fn clear(&mut self) {
        self.ranges.clear();
        self.before.clear();
        self.lines = 0;
        self.per_group = 0;
        *self.next.get_mut() = 0;
    }

    /// Adds the `bytes` bytes at `start` (whole cache lines around them).
    pub fn push(&mut self, start: *const u8, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let first = start as usize / LINE;
        let end = (start as usize + bytes).div_ceil(LINE);
        self.before.push(self.lines);
        self.ranges.push((first * LINE, end - first));
        self.lines += end - first;
    }

    /// Spreads the lines evenly over the row groups of matmuls with `rows` weight rows in
    /// all, and restarts from the first line.
    pub fn spread_over(&mut self, rows: usize) {
        let groups = rows.div_ceil(GROUP_ROWS).max(1);
        self.per_group = self.lines.div_ceil(groups);
        *self.next.get_mut() = 0;
    }

    /// Whether prefetching alongside the matmuls pays off on this CPU. On AMD Zen 4 it does
    /// (8 rows: +4–11 % tokens/s). On Intel Sapphire Rapids it costs 4–20 %: the weight
    /// stream already holds the core's line-fill buffers, and software prefetches queue
    /// behind it instead of overlapping it. Elsewhere unmeasured; it stays on.
    pub fn pays_off() -> bool {
        static PAYS_OFF: OnceLock<bool> = OnceLock::new();
        *PAYS_OFF.get_or_init(|| !cpu_vendor_is(b"GenuineIntel"))
    }

    /// Lines listed.
    pub fn lines(&self) -> usize {
        self.lines
    }

    /// The address of every line listed, in order.
    pub fn line_addresses(&self) -> impl Iterator<Item = usize> + '_ {
        self.ranges
            .iter()
            .flat_map(|&(addr, count)| (0..count).map(move |l| addr + l * LINE))
    }

    /// Claims the next group's share of lines: `(first, end)`, empty when all are claimed.
    fn claim(&self) -> (usize, usize) {
        if self.per_group == 0 {
            return (0, 0);
        }
        let from = self.next.fetch_add(self.per_group, Ordering::Relaxed);
        (
            from.min(self.lines),
            (from + self.per_group).min(self.lines),
        )
    }

    /// Prefetches lines `from..to` into L2.
    fn prefetch_lines(&self, from: usize, to: usize) {
        let mut r = self.before.partition_point(|&b| b <= from) - 1;
        let mut line = from;
        while line < to {
            let (addr, count) = self.ranges[r];
            let end = (self.before[r] + count).min(to);
            for l in line..end {
                prefetch(addr + (l - self.before[r]) * LINE);
            }
            line = end;
            r += 1;
        }
    }
}

/// Whether the CPU's vendor string (CPUID leaf 0) is `vendor`.
fn cpu_vendor_is(vendor: &[u8; 12]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let id = core::arch::x86_64::__cpuid(0);
        let mut name = [0u8; 12];
        for (i, reg) in [id.ebx, id.edx, id.ecx].into_iter().enumerate() {
            name[4 * i..4 * i + 4].copy_from_slice(&reg.to_le_bytes());
        }
        &name == vendor
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = vendor;
        false
    }
}

#[inline(always)]
fn prefetch(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, whatever the address.
    unsafe {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        _mm_prefetch::<_MM_HINT_T1>(addr as *const i8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

thread_local! {
    /// The side prefetch of the matmul task this thread is running, if any.
    static CURRENT: Cell<*const SidePrefetch> = const { Cell::new(std::ptr::null()) };
    /// Lines this thread claimed for its row group and not yet prefetched, and how many to
    /// prefetch per block: `(next, end, per_block)`.
    static CLAIMED: Cell<(usize, usize, usize)> = const { Cell::new((0, 0, 0)) };
}

/// Runs `f` with `side` as this thread's side prefetch (see [`claim_group`]).
pub(crate) fn with_current<R>(side: Option<&SidePrefetch>, f: impl FnOnce() -> R) -> R {
    let Some(side) = side else {
        return f();
    };
    struct Reset(*const SidePrefetch);
    impl Drop for Reset {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
            CLAIMED.with(|c| c.set((0, 0, 0)));
        }
    }
    let _reset = Reset(CURRENT.with(|c| c.replace(side)));
    f()
}

/// Claims a row group's share of the current side prefetch, to be issued over its
/// `blocks` blocks by [`issue_block`]: a few lines per block keep the misses in flight
/// below what the core tracks (a whole share at once stalled the kernel on them).
#[inline]
pub(crate) fn claim_group(blocks: usize) {
    let p = CURRENT.with(Cell::get);
    if p.is_null() {
        return;
    }
    // SAFETY: `with_current` keeps the pointer set only while its borrow lives.
    let (from, to) = unsafe { (*p).claim() };
    CLAIMED.with(|c| c.set((from, to, (to - from).div_ceil(blocks.max(1)))));
}

/// One block's part of the claimed lines.
#[inline]
pub(crate) fn issue_block() {
    let (from, to, step) = CLAIMED.with(Cell::get);
    if from >= to {
        return;
    }
    let end = (from + step).min(to);
    let p = CURRENT.with(Cell::get);
    if !p.is_null() {
        // SAFETY: as in `claim_group`.
        unsafe { (*p).prefetch_lines(from, end) };
    }
    CLAIMED.with(|c| c.set((end, to, step)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_line_once_in_order() {
        let buf = vec![0u8; 4096];
        let mut side = SidePrefetch::new();
        side.push(buf.as_ptr().wrapping_add(10), 100); // lines 0..2 or 0..3
        side.push(buf.as_ptr().wrapping_add(1000), 1);
        side.push(buf.as_ptr().wrapping_add(2048), 640);
        let expected = side.lines();
        side.spread_over(16 * 4);
        let mut claimed = Vec::new();
        for _ in 0..10 {
            claimed.push(side.claim());
        }
        // Consecutive shares, the first line to the last, then empty claims.
        assert_eq!(claimed[0].0, 0);
        for w in claimed.windows(2) {
            assert_eq!(w[1].0, w[0].1);
        }
        assert_eq!(claimed.last(), Some(&(expected, expected)));
        assert!(side.per_group * 4 >= expected);
        side.prefetch_lines(0, expected);
        side.clear();
        assert_eq!(side.lines(), 0);
        assert_eq!(side.claim(), (0, 0));
    }
}
