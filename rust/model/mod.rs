//! The model runtime: a Llama-architecture decoder run on its own quantized GGUF weights.
//!
//! - [`LlamaWeights`]: the memory-mapped GGUF tensors and the model fingerprint.
//! - [`LayerRange`]: the layers `[layer_lo, layer_hi)` — the unit a station runs — and the
//!   batched forward pass over them ([`LayerRange::forward_batch`]): many sequences' rows in
//!   one pass, each attending over its own [`SequenceKv`] ring, with one set of
//!   [`StepBuffers`]. The entry range embeds token ids, the exit range applies the final norm
//!   and the LM head; the whole model is one range.
//! - [`RangeSession`]: one sequence run alone (its KV plus its own buffers).
//! - [`NativeLlamaPipeline`]: a range plus its volume cache and the seed's `amplituhedron_*`
//!   calls, capturing from and splicing into the live ring buffer.
//! - [`Sampler`]: greedy / temperature / top-k / top-p with a seed, and speculative
//!   verification; generation itself is the engine's ([`crate::engine`]).
//!
//! Every kernel is batch-invariant (a row's result never depends on how many rows are computed
//! with it), so chunked prefill equals unchunked, cache-on equals cache-off, and a mesh of
//! stations equals one process, bit for bit.

mod adjust;
mod bandwidth;
mod config;
mod forward;
mod kv;
mod ops;
mod pipeline;
mod rings;
mod sampling;
mod session;
mod weights;

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

pub use adjust::{
    LogitsAdjust, MAX_LOGIT_BIAS, MAX_OPENAI_PENALTY, MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
};
pub use bandwidth::ReadProbe;
pub use config::{Activation, Architecture, ModelConfig, Recipe, RopeStyle, SlidingWindow};
pub use forward::{ChunkInput, LayerRange, LogitsWanted, Segment, StepBuffers};
pub use kv::{SequenceKv, SessionConfig, SPAN_TOKENS};
pub use pipeline::{NativeLlamaPipeline, ReplayOutcome, DEFAULT_MIN_PREFIX_REUSE};
pub use sampling::{
    argmax, token_logprobs, Sampler, SamplingError, SamplingParams, TokenLogprobs, MAX_TOP_LOGPROBS,
};
pub use session::RangeSession;
pub use weights::{
    tensor_digests, Digest, LayerView, LlamaWeights, LoadOptions, TensorInfo, WeightsMemory,
};

/// Returns the allocator's free heap pages to the system. Freed buffers of a few MiB stay
/// in glibc's arenas (its mmap threshold rises to the largest chunk freed), so a process
/// that dropped its work buffers would keep them in its resident set without this.
pub fn return_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Asks the kernel to back `buf` with transparent huge pages (2 MiB), where it allows them
/// on request (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, a common default).
/// Call it on a fresh, untouched allocation: the pages it then faults in are huge. A stream
/// over 4 KiB pages runs a page walk every 4 KiB and the hardware prefetchers stop at every
/// page boundary: on AMD Zen 4 one thread reads 23 GB/s from DRAM over 4 KiB pages and 27
/// over huge ones (two threads 30.5 and 34). A 7B decode step, whose kernels prefetch
/// ahead, gained ~2 % (within this host's noise). Only the 2 MiB-aligned interior is
/// advised; nothing changes where the kernel refuses.
pub fn advise_huge_pages<T>(buf: &mut [T]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = buf.as_mut_ptr() as usize;
        let end = start + std::mem::size_of_val(buf);
        let (lo, hi) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
        if lo < hi {
            // SAFETY: [lo, hi) lies inside `buf`'s allocation; MADV_HUGEPAGE changes how its
            // pages are backed, never their contents.
            unsafe {
                libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE);
            }
        }
    }
}

#[cfg(test)]
mod gemma_tests;
#[cfg(test)]
mod rope_tests;
#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;

/// How activations are quantized before the exact integer kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Two 8-bit passes (value + residual): ~14-bit activations, logits within a few
    /// hundredths of an f32 implementation, at twice the arithmetic but the same weight
    /// traffic. The default.
    #[default]
    Refined,
    /// One 8-bit pass, as llama.cpp does: fastest prefill, llama.cpp-level accuracy.
    Fast,
}

impl Precision {
    /// `"refined"` or `"fast"`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Refined => "refined",
            Precision::Fast => "fast",
        }
    }

    /// Parses `"refined"` / `"fast"`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "refined" => Some(Precision::Refined),
            "fast" => Some(Precision::Fast),
            _ => None,
        }
    }
}

/// The runtime's worker pool (one thread per core).
///
/// Every forward pass runs inside [`rayon::ThreadPool::install`], so the ~200 parallel
/// matmuls and attention calls of a decode step are joins among the pool's own workers
/// instead of cross-thread injections from the caller's thread, each of which would cost a
/// wake-up and a context switch.
pub fn runtime_pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        // AMPLITUHEDRON_THREADS overrides the core count (e.g. several stations on one host).
        let threads = std::env::var("AMPLITUHEDRON_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("amplituhedron-{i}"))
            .build()
            .expect("the runtime thread pool starts")
    })
}

/// Runs `f` on the [`runtime_pool`] with the pool's other workers kept awake while it runs:
/// each spins, taking any job the pass splits off (`rayon::yield_now`), instead of dozing
/// off between the pass's ~200 parallel regions. An idle rayon worker calls `sched_yield`
/// and then sleeps, and one that sleeps costs a futex wake-up (in a VM, an interrupt) at the
/// next region. Measured on a 2-core KVM guest: a decode step of 8 sequences 14.5 → 11.5 ms,
/// of 16 sequences 25 → 20.5 ms, a single sequence unchanged. (Kept awake for 2 ms after
/// each pass as well, so that a decode loop's next step would find them spinning, the gain
/// was gone: the spinning took the core the caller's own work between steps needed.) A
/// kept-awake worker lets other runnable threads of its core in every few microseconds.
/// Which thread runs a job never changes a result.
///
/// Passes run one at a time (a second caller waits): see [`Awake::enter`]. Off with
/// `AMPLITUHEDRON_KEEP_AWAKE=0` (see [`keeps_awake`]).
///
/// A caller that is itself worker 0 of a pool of its own (a station's step-stream thread,
/// see [`on_own_thread`]) runs the pass where it is, on that pool: handing it to the
/// runtime's workers and back would cost two wake-ups per pass (the first worker's, then
/// the caller's) and gain nothing.
pub fn run_on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    static ONE_PASS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_PASS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if OWN_POOL.get() {
        return f();
    }
    runtime_pool().install(|| {
        let _awake = keeps_awake().then(Awake::enter);
        f()
    })
}

thread_local! {
    /// Whether the calling thread is worker 0 of a pool [`on_own_thread`] made for it.
    static OWN_POOL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the calling thread made worker 0 of a pool of its own, as many threads as
/// the runtime's pool: [`run_on_pool`] then runs passes on this thread and that pool
/// instead of handing each to the runtime's workers. For a thread that serves one
/// connection and waits on its socket between passes (which run one at a time anyway): a
/// pass then wakes one sleeping thread (the pool's other worker, at its first parallel
/// region) instead of three (a runtime worker, the other one, and this thread at the end).
pub fn on_own_thread<R>(f: impl FnOnce() -> R) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    match rayon::ThreadPoolBuilder::new()
        .num_threads(runtime_pool().current_num_threads())
        .thread_name(|i| format!("amplituhedron-conn-{i}"))
        .use_current_thread()
        .build()
    {
        Ok(pool) => {
            OWN_POOL.set(true);
            let out = f();
            OWN_POOL.set(false);
            drop(pool);
            out
        }
        Err(_) => f(),
    }
}

/// Whether [`run_on_pool`] keeps the pool's other workers awake during a pass: yes, unless
/// `AMPLITUHEDRON_KEEP_AWAKE=0`. A process that shares the host's cores with others (a
/// station beside its coordinator and the other stations) turns it off: a kept-awake
/// pass first waits until every other worker has started spinning, and on contended cores
/// that wait is the whole cost. Measured on 2 cores, SmolLM2 (`bench-mesh`, decode
/// ms/token): 1 station 6.5/4.5/5.5 off against 7.2/5.3/6.0 on; 28 stations, two threads
/// each, ≈ 0.8 ms per hop off against ≈ 1.7 on.
pub fn keeps_awake() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("AMPLITUHEDRON_KEEP_AWAKE").map_or(true, |v| v.trim() != "0"))
}

/// Idle spins of a kept-awake worker between two `sched_yield`s.
const SPINS_PER_YIELD: u32 = 64;

/// Whether a pass is running (the kept-awake workers spin until it is not).
static PASS_ACTIVE: AtomicBool = AtomicBool::new(false);
/// Workers spinning in their kept-awake job.
static SPINNING: AtomicUsize = AtomicUsize::new(0);

/// A running pass, its pool's other workers kept awake (see [`run_on_pool`]).
struct Awake;

impl Awake {
    /// Marks a pass as running and sends every other worker a job that runs pending jobs, or
    /// spins, until the pass ends; then waits until each has started it. A worker thus
    /// enters it idle, never in the middle of a pass's work (where it would spin on top of
    /// work the pass waits for) — which is also why passes run one at a time. Must run on a
    /// pool worker.
    fn enter() -> Awake {
        PASS_ACTIVE.store(true, Ordering::SeqCst);
        let others = rayon::current_num_threads().saturating_sub(1);
        // A worker of the last pass that has not noticed its end yet still spins: it serves
        // this pass too (it checks the flag again before it stops counting itself).
        if others == 0 || SPINNING.load(Ordering::SeqCst) >= others {
            return Awake;
        }
        let me = rayon::current_thread_index();
        rayon::spawn_broadcast(move |ctx| {
            // The pass's own worker gets a copy too; it returns at once.
            if Some(ctx.index()) == me {
                return;
            }
            SPINNING.fetch_add(1, Ordering::SeqCst);
            let mut idle = 0u32;
            while PASS_ACTIVE.load(Ordering::SeqCst) {
                if rayon::yield_now() == Some(rayon::Yield::Executed) {
                    idle = 0;
                    continue;
                }
                idle += 1;
                if idle.is_multiple_of(SPINS_PER_YIELD) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            SPINNING.fetch_sub(1, Ordering::SeqCst);
        });
        while SPINNING.load(Ordering::SeqCst) < others {
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
                std::hint::spin_loop();
            }
        }
        Awake
    }
}

impl Drop for Awake {
    fn drop(&mut self) {
        PASS_ACTIVE.store(false, Ordering::SeqCst);
    }
}

/// Everything that can go wrong loading or running a model.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelError {
    /// The hyper-parameters are inconsistent.
    Config(String),
    /// A tensor is missing, mis-shaped or of an unsupported type.
    Weights(String),
    /// The model file could not be read.
    Io(String),
    /// A caller passed something the model cannot run (empty input, a token id outside the
    /// vocabulary, a hidden state of the wrong width, a layer range that is not this one…).
    Input(String),
    /// The session's KV ring refused the operation (full, bad rollback…).
    Ring(String),
    /// The volume cache refused the operation.
    Volume(String),
    /// Bad sampling parameters.
    Sampling(String),
    /// The part of the model asked for does not fit in the memory available.
    Memory(String),
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelError::Config(m) => write!(f, "invalid model config: {m}"),
            ModelError::Weights(m) => write!(f, "invalid weights: {m}"),
            ModelError::Io(m) => write!(f, "{m}"),
            ModelError::Input(m) => write!(f, "invalid input: {m}"),
            ModelError::Ring(m) => write!(f, "KV ring: {m}"),
            ModelError::Volume(m) => write!(f, "volume cache: {m}"),
            ModelError::Sampling(m) => write!(f, "sampling: {m}"),
            ModelError::Memory(m) => write!(f, "not enough memory: {m}"),
        }
    }
}

impl std::error::Error for ModelError {}

impl From<SamplingError> for ModelError {
    fn from(e: SamplingError) -> Self {
        ModelError::Sampling(e.0)
    }
}
