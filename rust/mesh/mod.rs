//! The station's end of the step stream, in Rust (SPEC §10, §11).
//!
//! A mesh decodes one token by sending a step through every station in turn, so what a hop
//! costs beyond its layers' compute is paid `stations` times per token. In Python that was
//! ≈ 0.5 ms of interpreter per hop on cold caches (28 stations share two cores and a 32 MB
//! L3), more than a one-layer pass. Here a thread per connection reads the frames
//! ([`frame`]), and a decode step or a prompt piece (not the last) of sessions this station
//! can run without Python runs straight on their rings, the exit sampling with each
//! session's own sampler ([`fast`]); every other frame goes, parsed and bounded, to the
//! station's Python handler, unchanged.
//!
//! The coordinator's end ([`chain`]) sends a step through a whole chain of stations on
//! pooled connections without returning to Python between hops.
//!
//! Python and the stream share each session's ring and its lock ([`RingLock`]): whoever
//! holds the lock may touch the ring, so a step here and the routes never interleave.

mod chain;
mod fast;
mod frame;
mod ring_lock;
mod server;

pub use chain::{Address, ChainFailure, ChainPool, HopFailure, HopReply};
pub use fast::{FastStep, HopSession, Registry};
pub use frame::{monotonic_seconds, Answer, FrameLimits, MAX_TOKEN_BYTES, STREAM_MAGIC};
pub use ring_lock::RingLock;
pub use server::{Handler, Observation, StepStream};

#[cfg(test)]
mod tests;
