//! The decode path — plan, attend, write, commit, roll back, abort — never allocates.
//!
//! A counting global allocator counts allocations made by this test's thread while armed.
//! It is the unit-test harness's allocator: it forwards every call to the system allocator
//! and counts only on an armed thread, so the other tests run as before.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use crate::attention::{attend, attend_chunk, scratch_len, AttnDims, AttnInputs, AttnScratch};
use crate::ring::{DynamicRingBuffer, RingConfig, SpanType};

struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

fn note() {
    // `try_with`: thread-local storage may already be torn down during thread exit.
    let _ = ARMED.try_with(|armed| {
        if armed.get() {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        }
    });
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made by `f` on this thread.
fn allocations_in(f: impl FnOnce()) -> usize {
    COUNT.with(|c| c.set(0));
    ARMED.with(|a| a.set(true));
    f();
    ARMED.with(|a| a.set(false));
    COUNT.with(|c| c.get())
}

const HEADS: usize = 6;

/// One decode step through the runtime protocol, with buffers the caller owns.
struct Step {
    q: Vec<f32>,
    kv: Vec<f32>,
    out: Vec<f32>,
    scratch: AttnScratch,
    row_scratch: Vec<f32>,
}

impl Step {
    fn run(&mut self, ring: &mut DynamicRingBuffer, span: SpanType, new_span: bool) {
        ring.begin_append(1, span, new_span).unwrap();
        let clock = ring.pending_clock(0);
        assert!(ring.pending_cache_pos(0) <= clock);
        for layer in 0..ring.config().n_layers {
            for (i, x) in self.kv.iter_mut().enumerate() {
                *x = ((clock as usize * 31 + layer * 7 + i) % 97) as f32 / 97.0 - 0.5;
            }
            attend_chunk(
                ring,
                layer,
                &self.q,
                &self.q,
                &self.kv,
                &self.kv,
                HEADS,
                0.125,
                &mut self.scratch,
                &mut self.out,
            )
            .unwrap();
            // The low-level single-row kernel too.
            let (ring_k, ring_v) = ring.layer_kv(layer);
            let inputs = AttnInputs {
                q_fixed: &self.q,
                q_window: &self.q,
                ring_k,
                ring_v,
                fixed_slots: ring.fixed_slots(),
                window_slots: ring.pending_window(0),
                window_head: None,
                local_k: &self.kv[ring.pending_local_start(0) * 128..],
                local_v: &self.kv[ring.pending_local_start(0) * 128..],
            };
            let dims = AttnDims {
                n_q_heads: HEADS,
                n_kv_heads: 2,
                head_dim: 64,
            };
            attend(&inputs, dims, 0.125, &mut self.row_scratch, &mut self.out).unwrap();
            ring.write_pending(layer, &self.kv, &self.kv).unwrap();
        }
        ring.commit_append().unwrap();
    }
}

#[test]
fn append_attend_commit_rollback_abort_never_allocate() {
    let cfg = RingConfig {
        slots: 64,
        recall: 4,
        n_sys: 4,
        max_chunk: 8,
        undo_capacity: 16,
        ..RingConfig::new(3, 2, 64)
    };
    let mut ring = DynamicRingBuffer::new(cfg).unwrap();
    let mut step = Step {
        q: vec![0.1; HEADS * 64],
        kv: vec![0.0; 128],
        out: vec![0.0; HEADS * 64],
        scratch: AttnScratch::new(1, HEADS, 64 + 8),
        row_scratch: vec![
            0.0;
            scratch_len(
                AttnDims {
                    n_q_heads: HEADS,
                    n_kv_heads: 2,
                    head_dim: 64
                },
                64
            )
        ],
    };
    let recall = vec![0.5; 3 * 128 * 2];
    ring.inject_recall(2, &recall, &recall).unwrap();
    // Warm-up outside the count (ISA detection, lazy statics).
    step.run(&mut ring, SpanType::System, true);

    let n = allocations_in(|| {
        for t in 1..300u64 {
            // Spans of 5 positions: the window (56 slots) wraps five times, evicting spans.
            step.run(&mut ring, SpanType::ResponseSentence, t % 5 == 0);
            if t % 17 == 0 {
                // A probe of 6 tokens, rolled back across overwrites and evictions.
                let saved = ring.clock();
                for _ in 0..6 {
                    step.run(&mut ring, SpanType::Thought, true);
                }
                ring.rollback_clock(saved).unwrap();
            }
            if t % 23 == 0 {
                ring.begin_append(1, SpanType::Thought, true).unwrap();
                ring.write_pending(0, &step.kv, &step.kv).unwrap();
                ring.abort_append();
            }
        }
        ring.prune_oldest_spans(3).unwrap();
        ring.clear_recall().unwrap();
    });
    assert!(ring.clock() > 4 * 64);
    assert_eq!(n, 0, "the decode path allocated {n} times");
}

#[test]
fn the_counter_sees_allocations() {
    let n = allocations_in(|| {
        std::hint::black_box(vec![1u8; 10]);
    });
    assert_eq!(n, 1);
}
