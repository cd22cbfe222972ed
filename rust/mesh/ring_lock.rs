//! A lock shared by Python and the step stream's threads: `threading.Lock`'s semantics
//! (released by any thread, acquired with a timeout), with a wait that needs no GIL.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Exclusive use of a session's ring. Not reentrant; any thread may release it.
#[derive(Debug, Default)]
pub struct RingLock {
    held: Mutex<bool>,
    freed: Condvar,
}

impl RingLock {
    pub fn new() -> RingLock {
        RingLock::default()
    }

    /// Takes the lock if it is free; never waits.
    pub fn try_acquire(&self) -> bool {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if *held {
            return false;
        }
        *held = true;
        true
    }

    /// Takes the lock, waiting at most `timeout` (None: for as long as it takes).
    pub fn acquire(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        while *held {
            held = match deadline {
                None => self
                    .freed
                    .wait(held)
                    .unwrap_or_else(PoisonError::into_inner),
                Some(at) => {
                    let now = Instant::now();
                    if now >= at {
                        return false;
                    }
                    self.freed
                        .wait_timeout(held, at - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
        *held = true;
        true
    }

    /// Frees the lock; false (nothing done) if it was not held.
    pub fn release(&self) -> bool {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if !*held {
            return false;
        }
        *held = false;
        drop(held);
        self.freed.notify_one();
        true
    }

    pub fn is_held(&self) -> bool {
        *self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
