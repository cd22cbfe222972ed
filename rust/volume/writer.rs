//! Write-behind for the cache directory: volume files are written (and synced) on a thread
//! of their own, so a capture — on a station, inside a batched step — never waits for the
//! disk.
//!
//! Every file operation of a cache (writes and deletions) goes through this one thread, in
//! the order the cache issued them. That order is what keeps a file name's history right
//! when an entry is removed while its write is still queued and the same key is captured
//! again: the old write, its deletion, then the new write.
//!
//! The cache learns how each write ended from [`DiskWriter::finished`]; until then the entry
//! is served from memory and its bytes are reserved against the disk budget. Dropping the
//! writer finishes every queued operation first, so a cache dropped normally leaves every
//! accepted volume on disk; a process killed meanwhile leaves at worst a `*.part` file,
//! which the next open deletes.

use std::io;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::captured::AmplituhedronVolume;
use super::disk::{DiskStore, Header};
use super::EntryId;

/// Which write an outcome belongs to: entry ids are reused, so a serial tells a current
/// write from one whose entry has gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ticket {
    pub(super) entry: EntryId,
    pub(super) serial: u64,
    /// Bytes reserved against the disk budget until the write ends.
    pub(super) reserved: u64,
}

/// How a queued write ended.
#[derive(Debug)]
pub(super) struct Written {
    pub(super) ticket: Ticket,
    pub(super) result: io::Result<Header>,
}

enum Job {
    Write(Ticket, Arc<AmplituhedronVolume>),
    Remove(Header),
}

/// The writer thread of one cache directory.
#[derive(Debug)]
pub(super) struct DiskWriter {
    jobs: Option<Sender<Job>>,
    done: Receiver<Written>,
    thread: Option<JoinHandle<()>>,
    /// Writes queued whose outcome the cache has not taken yet.
    in_flight: usize,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Job::Write(t, _) => write!(f, "Write({t:?})"),
            Job::Remove(h) => write!(f, "Remove({})", h.file_name()),
        }
    }
}

impl DiskWriter {
    /// Starts the thread that performs `store`'s writes and deletions.
    pub(super) fn spawn(store: Arc<DiskStore>) -> io::Result<DiskWriter> {
        let (jobs, inbox) = channel::<Job>();
        let (outbox, done) = channel();
        let thread = std::thread::Builder::new()
            .name("amplituhedron-volume-writer".into())
            .spawn(move || {
                for job in inbox {
                    match job {
                        Job::Write(ticket, volume) => {
                            let result = store.write(&volume);
                            // The cache may be gone (dropped while writes were queued): the
                            // file is written all the same, only nobody hears of it.
                            let _ = outbox.send(Written { ticket, result });
                        }
                        Job::Remove(header) => store.remove(&header),
                    }
                }
            })?;
        Ok(DiskWriter {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            in_flight: 0,
        })
    }

    /// Queues the write of `volume`.
    pub(super) fn write(&mut self, ticket: Ticket, volume: Arc<AmplituhedronVolume>) {
        if self.send(Job::Write(ticket, volume)) {
            self.in_flight += 1;
        }
    }

    /// Queues the deletion of `header`'s file (after every write queued before it).
    pub(super) fn remove(&mut self, header: Header) {
        self.send(Job::Remove(header));
    }

    /// Writes queued whose outcome has not been taken.
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The outcomes ready now, without waiting.
    pub(super) fn finished(&mut self) -> Vec<Written> {
        let out: Vec<Written> = self.done.try_iter().collect();
        self.in_flight -= out.len();
        out
    }

    /// Waits for every queued write; their outcomes.
    pub(super) fn wait_all(&mut self) -> Vec<Written> {
        let mut out = Vec::with_capacity(self.in_flight);
        while self.in_flight > 0 {
            match self.done.recv() {
                Ok(w) => {
                    self.in_flight -= 1;
                    out.push(w);
                }
                // The thread is gone (it panicked): nothing more will come.
                Err(_) => {
                    self.in_flight = 0;
                }
            }
        }
        out
    }

    fn send(&mut self, job: Job) -> bool {
        let sent = self.jobs.as_ref().is_some_and(|j| j.send(job).is_ok());
        debug_assert!(sent, "the volume writer thread is gone");
        sent
    }
}

impl Drop for DiskWriter {
    /// Finishes every queued write and deletion.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
