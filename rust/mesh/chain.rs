//! The coordinator's end of the step stream for a whole chain: a step goes through every
//! station in order (each station's answer payload is the next one's input) on pooled
//! persistent connections, without returning to Python between hops.
//!
//! Why: the coordinator waits for each hop before it sends the next, so what it spends per
//! hop is on every token's critical path; in asyncio that was ≈ 0.15 ms of CPU per hop at
//! 28 stations (a future, a timer, a wake-up and a parse per answer). Python renders the
//! headers, runs [`ChainPool::run`] in a worker thread and reads the exit's answer.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::frame::{monotonic_seconds, request, PREFIX_BYTES, STREAM_MAGIC};

/// A pooled connection idle this long is closed rather than reused (stations close theirs
/// after 30 s; one they have just closed must never be reused).
const IDLE: Duration = Duration::from_secs(15);

/// A station's step-stream address.
pub type Address = (String, u16);

/// One station's answer in a chain.
#[derive(Clone, Debug)]
pub struct HopReply {
    /// Its JSON header.
    pub head: Vec<u8>,
    /// When its request was written and its answer read (`monotonic_seconds`).
    pub sent: f64,
    pub answered: f64,
}

/// Why a chain stopped at a station.
#[derive(Clone, Debug)]
pub enum HopFailure {
    /// No answer: refused, reset, closed, or not within the deadline (`timeout`).
    NoAnswer { timeout: bool, message: String },
    /// An answer other than 200 (its header: `{"detail": …}`).
    Refused { status: u16, head: Vec<u8> },
    /// A 200 whose header is not a step's answer for the step's entries.
    Malformed { message: String },
}

/// The station (its index in the chain) where a chain stopped, and why.
#[derive(Clone, Debug)]
pub struct ChainFailure {
    pub station: usize,
    pub failure: HopFailure,
}

/// Idle connections per station address.
#[derive(Default)]
pub struct ChainPool {
    idle: Mutex<HashMap<Address, Vec<(TcpStream, Instant)>>>,
}

impl ChainPool {
    pub fn new() -> ChainPool {
        ChainPool::default()
    }

    /// Runs one step through `stations` in order: station `i` gets `heads[i]` and the
    /// previous station's answer payload (the first gets `payload`). Each answer must hold
    /// `entries` entries. Returns every station's answer and the last one's payload.
    pub fn run(
        &self,
        stations: &[Address],
        token: &[u8],
        heads: &[Vec<u8>],
        payload: Vec<u8>,
        entries: usize,
        timeout: Duration,
    ) -> Result<(Vec<HopReply>, Vec<u8>), ChainFailure> {
        assert_eq!(stations.len(), heads.len(), "one header per station");
        let mut replies = Vec::with_capacity(stations.len());
        let mut payload = payload;
        for (i, (addr, head)) in stations.iter().zip(heads).enumerate() {
            let fail = |failure| ChainFailure {
                station: i,
                failure,
            };
            let sent = monotonic_seconds();
            let (status, head, out) =
                self.call(addr, token, head, &payload, timeout)
                    .map_err(|e| {
                        self.forget(addr);
                        fail(HopFailure::NoAnswer {
                            timeout: matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                            ),
                            message: e.to_string(),
                        })
                    })?;
            let answered = monotonic_seconds();
            if status != 200 {
                return Err(fail(HopFailure::Refused { status, head }));
            }
            let counted = serde_json::from_slice::<serde_json::Value>(&head)
                .ok()
                .and_then(|v| v.get("entries")?.as_array().map(Vec::len));
            if counted != Some(entries) {
                let message = match counted {
                    Some(n) => format!("answered {n} entries for {entries}"),
                    None => "answered a malformed step".to_owned(),
                };
                return Err(fail(HopFailure::Malformed { message }));
            }
            replies.push(HopReply {
                head,
                sent,
                answered,
            });
            payload = out;
        }
        Ok((replies, payload))
    }

    /// Closes every idle connection.
    pub fn clear(&self) {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// Closes the idle connections to `addr` (its station failed).
    pub fn forget(&self, addr: &Address) {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(addr);
    }

    /// One request on a pooled (or new) connection; the answer's status, header, payload.
    fn call(
        &self,
        addr: &Address,
        token: &[u8],
        head: &[u8],
        payload: &[u8],
        timeout: Duration,
    ) -> io::Result<(u16, Vec<u8>, Vec<u8>)> {
        let deadline = Instant::now() + timeout;
        let mut conn = match self.take(addr) {
            Some(c) => c,
            None => connect(addr, timeout)?,
        };
        conn.write_all(&request(token, head, payload))?;
        let mut prefix = [0u8; PREFIX_BYTES];
        read_by(&mut conn, &mut prefix, deadline)?;
        if &prefix[..4] != STREAM_MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the station answered something that is not a frame",
            ));
        }
        let status = u16::from_le_bytes([prefix[4], prefix[5]]);
        let n_head = u32::from_le_bytes(prefix[6..10].try_into().expect("4 bytes")) as usize;
        let n_payload = u32::from_le_bytes(prefix[10..14].try_into().expect("4 bytes")) as usize;
        let mut body = vec![0u8; n_head + n_payload];
        read_by(&mut conn, &mut body, deadline)?;
        let out = body.split_off(n_head);
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(addr.clone())
            .or_default()
            .push((conn, Instant::now()));
        Ok((status, body, out))
    }

    fn take(&self, addr: &Address) -> Option<TcpStream> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let conns = idle.get_mut(addr)?;
        while let Some((conn, since)) = conns.pop() {
            if since.elapsed() < IDLE {
                return Some(conn);
            }
        }
        None
    }
}

fn connect(addr: &Address, timeout: Duration) -> io::Result<TcpStream> {
    let mut last = None;
    for a in (addr.0.as_str(), addr.1).to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address")))
}

/// Fills `buf` before `deadline` (TimedOut after it; UnexpectedEof if the peer closed).
fn read_by(conn: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no answer in time"));
        }
        conn.set_read_timeout(Some(left))?;
        match conn.read(&mut buf[at..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the connection closed",
                ))
            }
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
