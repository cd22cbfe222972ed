//! The step stream's listener: one thread accepts, one thread per connection reads its
//! frames in order and answers each before reading the next (a connection buffers at most
//! one frame).
//!
//! The edge rules of the station's HTTP surface hold here:
//! - every frame carries the mesh token, compared in constant time as soon as the prefix
//!   and the token are in, before a byte of header or payload is read;
//! - header and payload lengths are refused (413) past the limits before they are read;
//! - a refusal of the frame itself (magic, token, lengths) closes the connection;
//! - open connections are capped (the oldest idle one is closed to make room, else the new
//!   one gets a 503 frame); an idle connection closes after the keep-alive, one whose prefix
//!   or body dribbles in after the header or body deadline closes unanswered.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::fast::FastStep;
use super::frame::{monotonic_seconds, parse_prefix, Answer, FrameLimits, PREFIX_BYTES};

/// Answers the frames the fast path declines (the station's Python handler): the header,
/// the payload and when the frame was in (`monotonic_seconds`).
pub trait Handler: Send + Sync {
    fn handle(&self, head: Vec<u8>, payload: Vec<u8>, received: f64) -> Answer;
}

/// `(seconds from the frame's last byte to its answer, status)` of an answer the stream
/// wrote itself (refusals, fast steps); the station's metrics take them in.
pub type Observation = (f64, u16);

/// An open connection, as the cap sees it.
struct Conn {
    id: u64,
    /// A handle to shut the socket down from the accepting thread.
    socket: TcpStream,
    /// Since when it waits for a frame (None: one is being read or answered).
    idle_since: Option<Instant>,
}

struct Shared {
    limits: FrameLimits,
    fast: Arc<FastStep>,
    handler: Box<dyn Handler>,
    conns: Mutex<Vec<Conn>>,
    observations: Mutex<Vec<Observation>>,
    closing: AtomicBool,
    next_id: AtomicU64,
    /// Connection threads alive (`close` waits for them: one may be in the Python handler).
    serving: AtomicUsize,
}

impl Shared {
    fn conns(&self) -> MutexGuard<'_, Vec<Conn>> {
        self.conns.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn observe(&self, seconds: f64, status: u16) {
        self.observations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((seconds, status));
    }

    fn set_idle(&self, id: u64, idle: bool) {
        if let Some(c) = self.conns().iter_mut().find(|c| c.id == id) {
            c.idle_since = idle.then(Instant::now);
        }
    }

    /// Makes room for connection `id` under the cap: false if every other one is busy.
    fn admit(&self, id: u64, socket: &TcpStream) -> io::Result<bool> {
        let mut conns = self.conns();
        conns.push(Conn {
            id,
            socket: socket.try_clone()?,
            idle_since: Some(Instant::now()),
        });
        if conns.len() <= self.limits.max_connections {
            return Ok(true);
        }
        let oldest = conns
            .iter()
            .enumerate()
            .filter(|(_, c)| c.id != id)
            .filter_map(|(i, c)| c.idle_since.map(|t| (i, t)))
            .min_by_key(|&(_, t)| t)
            .map(|(i, _)| i);
        match oldest {
            Some(i) => {
                let _ = conns.remove(i).socket.shutdown(Shutdown::Both);
                Ok(true)
            }
            None => {
                conns.retain(|c| c.id != id);
                Ok(false)
            }
        }
    }
}

/// How long `close` waits for the connections' threads to finish.
pub const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// A listening step stream; `close` (or drop) stops it.
pub struct StepStream {
    shared: Arc<Shared>,
    port: u16,
    listener: Mutex<Option<thread::JoinHandle<()>>>,
}

impl StepStream {
    /// Listens on `host:port` (0: any free port).
    pub fn bind(
        host: &str,
        port: u16,
        limits: FrameLimits,
        fast: Arc<FastStep>,
        handler: Box<dyn Handler>,
    ) -> io::Result<StepStream> {
        let addr = (host, port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address"))?;
        let listener = TcpListener::bind(addr)?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            limits,
            fast,
            handler,
            conns: Mutex::new(Vec::new()),
            observations: Mutex::new(Vec::new()),
            closing: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            serving: AtomicUsize::new(0),
        });
        let accepting = Arc::clone(&shared);
        let handle = thread::Builder::new()
            .name("step-stream".into())
            .spawn(move || accept_loop(listener, accepting))?;
        Ok(StepStream {
            shared,
            port,
            listener: Mutex::new(Some(handle)),
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn fast(&self) -> &FastStep {
        &self.shared.fast
    }

    /// The observations since the last call.
    pub fn take_observations(&self) -> Vec<Observation> {
        std::mem::take(
            &mut *self
                .shared
                .observations
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// Open connections.
    pub fn connections(&self) -> usize {
        self.shared.conns().len()
    }

    /// Stops accepting and closes every connection; waits (at most [`CLOSE_WAIT`]) for a
    /// step being answered to finish, so that no thread calls the handler after this.
    pub fn close(&self) {
        if self.shared.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wakes the accepting thread, which then sees `closing`.
        let _ = TcpStream::connect(("127.0.0.1", self.port))
            .or_else(|_| TcpStream::connect(("::1", self.port)));
        for c in self.shared.conns().iter() {
            let _ = c.socket.shutdown(Shutdown::Both);
        }
        let handle = self
            .listener
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = handle {
            let _ = h.join();
        }
        let deadline = Instant::now() + CLOSE_WAIT;
        while self.shared.serving.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for StepStream {
    fn drop(&mut self) {
        self.close();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for socket in listener.incoming() {
        if shared.closing.load(Ordering::SeqCst) {
            return;
        }
        let Ok(socket) = socket else { continue };
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let serving = Arc::clone(&shared);
        serving.serving.fetch_add(1, Ordering::SeqCst);
        let spawned = thread::Builder::new()
            .name("step-stream-conn".into())
            .spawn(move || {
                crate::model::on_own_thread(|| serve(socket, id, &serving));
                serving.serving.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            // Out of threads: the connection closes.
            shared.serving.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// One connection, until it closes, fails or is refused.
fn serve(mut socket: TcpStream, id: u64, shared: &Shared) {
    let _ = socket.set_nodelay(true);
    if socket
        .set_read_timeout(Some(shared.limits.keepalive))
        .is_err()
    {
        return;
    }
    match shared.admit(id, &socket) {
        Ok(true) => {}
        Ok(false) => {
            let refusal = Answer::refusal(503, "too many connections; retry", Some(1));
            shared.observe(0.0, 503);
            let _ = socket.write_all(&refusal.encode());
            return;
        }
        Err(_) => return,
    }
    while !shared.closing.load(Ordering::SeqCst) {
        match next_frame(&mut socket, id, shared) {
            Ok(Some(answer)) => {
                if socket.write_all(&answer.encode()).is_err() {
                    break;
                }
                shared.set_idle(id, true);
            }
            Ok(None) | Err(_) => break,
        }
    }
    shared.conns().retain(|c| c.id != id);
    let _ = socket.shutdown(Shutdown::Both);
}

/// Reads one frame and answers it; Ok(None): the connection closes (the peer left, a
/// deadline passed, or the frame was refused, in which case the refusal was written).
///
/// The socket's read timeout rests at the keep-alive (the wait for a frame's first bytes);
/// the rest of a frame is read without waiting when it is there, as it almost always is,
/// and otherwise waits within its deadline.
fn next_frame(socket: &mut TcpStream, id: u64, shared: &Shared) -> io::Result<Option<Answer>> {
    let limits = &shared.limits;
    let mut prefix = [0u8; PREFIX_BYTES];
    let first = match socket.read(&mut prefix) {
        Ok(0) => return Ok(None),
        Ok(n) => n,
        Err(e) if is_timeout(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    shared.set_idle(id, false);
    let mut reader = Reader {
        socket,
        waited: false,
    };
    let answer = read_and_answer(&mut reader, &mut prefix, first, shared);
    if reader.waited {
        reader.socket.set_read_timeout(Some(limits.keepalive))?;
    }
    answer
}

fn read_and_answer(
    reader: &mut Reader<'_>,
    prefix: &mut [u8; PREFIX_BYTES],
    first: usize,
    shared: &Shared,
) -> io::Result<Option<Answer>> {
    let limits = &shared.limits;
    let header_deadline = Instant::now() + limits.header_timeout;
    if !reader.fill(&mut prefix[first..], header_deadline)? {
        return Ok(None);
    }
    let Some(p) = parse_prefix(prefix) else {
        let msg = "not a step-stream frame (see amplituhedron_rs.mesh.protocol)";
        return refuse(reader.socket, shared, Answer::refusal(400, msg, None));
    };
    let mut token = vec![0u8; p.token.min(super::MAX_TOKEN_BYTES)];
    if p.token <= super::MAX_TOKEN_BYTES && !reader.fill(&mut token, header_deadline)? {
        return Ok(None);
    }
    if let Some(refusal) = limits.refuse(p, &token) {
        return refuse(reader.socket, shared, refusal);
    }
    let body_deadline = Instant::now() + limits.body_timeout;
    let mut body = vec![0u8; p.head + p.payload];
    if !reader.fill(&mut body, body_deadline)? {
        return Ok(None);
    }
    let received = monotonic_seconds();
    let payload = body.split_off(p.head);
    let head = body;
    if let Some(answer) = shared.fast.try_step(&head, &payload, received) {
        shared.observe(monotonic_seconds() - received, answer.status);
        return Ok(Some(answer));
    }
    if shared.closing.load(Ordering::SeqCst) {
        return Ok(None);
    }
    // The handler records its own observations (and may run the failure drill).
    Ok(Some(shared.handler.handle(head, payload, received)))
}

/// Writes a refusal of the frame itself; the connection then closes.
fn refuse(socket: &mut TcpStream, shared: &Shared, refusal: Answer) -> io::Result<Option<Answer>> {
    shared.observe(0.0, refusal.status);
    socket.write_all(&refusal.encode())?;
    Ok(None)
}

/// Reads the rest of a frame.
struct Reader<'a> {
    socket: &'a mut TcpStream,
    /// The read timeout was changed from the keep-alive.
    waited: bool,
}

impl Reader<'_> {
    /// Fills `buf` before `deadline`; false if the peer closed or the deadline passed.
    fn fill(&mut self, buf: &mut [u8], deadline: Instant) -> io::Result<bool> {
        let mut at = 0;
        while at < buf.len() {
            let got = match recv_now(self.socket, &mut buf[at..]) {
                Ok(n) => Ok(n),
                Err(e) if is_timeout(&e) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(false);
                    }
                    self.socket
                        .set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
                    self.waited = true;
                    self.socket.read(&mut buf[at..])
                }
                Err(e) => Err(e),
            };
            match got {
                Ok(0) => return Ok(false),
                Ok(n) => at += n,
                Err(e) if is_timeout(&e) => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
}

/// What the socket holds now, without waiting (WouldBlock: nothing yet).
fn recv_now(socket: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: `buf` is valid for writes of its length; the descriptor is open (borrowed).
    let n = unsafe {
        libc::recv(
            socket.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
