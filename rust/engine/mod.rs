//! Continuous batching: the one generation loop of the runtime, in one process or over a
//! mesh (SPEC §10, §11).
//!
//! - [`Engine`] (scheduler.rs) owns the requests: a bounded waiting queue, the running set,
//!   and each sequence's tokens. Every step it admits waiting requests (each first consults
//!   the volume cache, exact then longest-prefix), then plans one batch under a token
//!   budget: every running sequence's decode row (plus its drafted tokens when speculating)
//!   first, then chunks of prompt prefill with what the budget has left, so a long prompt
//!   never stalls the running streams.
//! - An [`Executor`] runs what the engine planned: [`LocalExecutor`] in process (one batched
//!   forward pass per step, weights read once for every row), or a mesh executor that sends
//!   the batch through the stations. The executor samples (or verifies drafts) where the
//!   logits are, so no logits cross a wire; sampling is a pure function of the sequence's
//!   seed and position, so it does not matter where that is.
//! - Drafting for speculative decoding is a [`Proposer`] (draft.rs): prompt lookup today,
//!   pluggable for a draft model later.
//!
//! The invariant the engine keeps: a sequence's tokens (and logits) are bit-identical to the
//! same request run alone, whatever else shares its steps, because every kernel is
//! batch-invariant and every sequence attends only over its own ring.

#[cfg(test)]
mod constraint_tests;
mod draft;
mod executor;
mod local;
mod request;
mod scheduler;
#[cfg(test)]
mod tests;

pub use draft::{DraftConfig, PromptLookup, Proposer};
pub use executor::{Admission, Admitted, BatchEntry, EntryKind, EntryOutcome, Executor};
pub use local::LocalExecutor;
pub use request::{Event, FinishReason, Request, SeqId, SeqStats};
pub use scheduler::{step, Engine, EngineConfig, StepTotals};

use std::fmt;

/// What can go wrong in the engine or an executor.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineError {
    /// A request the engine refuses (empty prompt, bad parameters…); nothing was queued.
    Input(String),
    /// The waiting queue is full: retry later.
    QueueFull {
        /// Requests waiting.
        waiting: usize,
        /// The queue's bound.
        max_queue: usize,
    },
    /// The executor failed (a model error in process, a station over the mesh).
    Executor(String),
}

impl fmt::Display for EngineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineError::Input(m) => write!(f, "invalid request: {m}"),
            EngineError::QueueFull { waiting, max_queue } => write!(
                f,
                "the queue is full ({waiting} requests waiting, max {max_queue}); retry later"
            ),
            EngineError::Executor(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for EngineError {}

impl From<crate::model::ModelError> for EngineError {
    fn from(e: crate::model::ModelError) -> Self {
        EngineError::Executor(e.to_string())
    }
}
