//! Steps without Python: a frame whose entries are all decode rows of open sessions, or
//! pieces of their prompts before the last, runs here on the sessions' rings; at the exit
//! station, each session's own sampler (shared with Python) then verifies a decode entry's
//! rows and emits, as `BatchStepper` does.
//!
//! It takes only frames it can answer exactly as the Python handler would, and whose
//! answer changes nothing Python keeps: every field of the header known and in range, every
//! session registered and free, every entry within its session's positions (a prompt piece:
//! the prompt's own tokens at the ring's clock, not its last piece, and no capture to make
//! in it); at the exit, no log-probabilities asked and no grammar. Anything else — a
//! prompt's last piece, a capture, a busy or unknown session, a malformed header — is
//! declined (`None`) before anything changed, and the Python handler answers it (with its
//! error, when it is one). A sampler that fails after the pass (non-finite logits) fails the step
//! as Python's does: the same 422 and detail, the rings moved on as Python's pass left them.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde_json::{Map, Value};

use crate::model::{
    ChunkInput, LayerRange, LogitsWanted, RangeSession, Sampler, SamplingError, Segment,
    StepBuffers, MAX_TOP_LOGPROBS,
};
use crate::ring::SpanType;

use super::frame::{monotonic_seconds, Answer};
use super::RingLock;

/// The entries a step header may hold (`BatchStepRequest`).
const MAX_ENTRIES: usize = 4096;
/// The largest `start` a header may give (`BatchEntrySpec`).
const MAX_START: u64 = 1 << 31;
const ENTRY_KEYS: [&str; 9] = [
    "session_id",
    "start",
    "tokens",
    "kind",
    "last",
    "emit",
    "capture",
    "logprobs",
    "prompt_logprobs",
];

/// What the stream knows of one open session: its ring and lock (shared with Python), its
/// prompt, its sampler at the exit station (shared with Python; None: the exit's steps are
/// Python's, e.g. under a grammar), and when a step last used it.
pub struct HopSession {
    pub ring: Arc<Mutex<RangeSession>>,
    pub lock: Arc<RingLock>,
    pub prompt: Vec<u32>,
    pub sampler: Option<Arc<Mutex<Sampler>>>,
    closed: AtomicBool,
    /// `monotonic_seconds()` of the last step here, as f64 bits (0: none yet).
    last_used: AtomicU64,
}

impl HopSession {
    pub fn new(
        ring: Arc<Mutex<RangeSession>>,
        lock: Arc<RingLock>,
        prompt: Vec<u32>,
        sampler: Option<Arc<Mutex<Sampler>>>,
    ) -> Self {
        HopSession {
            ring,
            lock,
            prompt,
            sampler,
            closed: AtomicBool::new(false),
            last_used: AtomicU64::new(0),
        }
    }

    fn prompt_len(&self) -> u64 {
        self.prompt.len() as u64
    }

    /// When a step here last used the session (None: never).
    pub fn last_used(&self) -> Option<f64> {
        let bits = self.last_used.load(Ordering::Relaxed);
        (bits != 0).then(|| f64::from_bits(bits))
    }
}

/// The sessions the stream may step, by id (registered when opened, removed when closed).
#[derive(Default)]
pub struct Registry {
    sessions: Mutex<HashMap<String, Arc<HopSession>>>,
}

impl Registry {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Arc<HopSession>>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn register(&self, sid: &str, session: HopSession) {
        self.map().insert(sid.to_owned(), Arc::new(session));
    }

    /// Forgets a session; a step that found it before waits for its lock and then sees it
    /// closed. Call with the session's lock held, before its ring is reused.
    pub fn unregister(&self, sid: &str) -> bool {
        match self.map().remove(sid) {
            Some(s) => {
                s.closed.store(true, Ordering::Release);
                true
            }
            None => false,
        }
    }

    pub fn get(&self, sid: &str) -> Option<Arc<HopSession>> {
        self.map().get(sid).cloned()
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One entry of a header: decode rows, or a piece of the prompt before its last.
struct Entry<'a> {
    sid: &'a str,
    start: u64,
    tokens: Vec<u32>,
    prefill: bool,
    capture: bool,
}

impl Entry<'_> {
    fn end(&self) -> u64 {
        self.start + self.tokens.len() as u64
    }
}

/// The fast path of one station: its layers, step buffers, registry and counters.
pub struct FastStep {
    range: LayerRange,
    bufs: Mutex<StepBuffers>,
    pub registry: Registry,
    /// Rows a decode entry may carry (the station's `max_rows`).
    max_rows: usize,
    /// Rows of logits a decode entry may ask at the exit (the station's `max_logits_rows`).
    max_logits_rows: usize,
    /// The volume cache's longest prefix (Python's `max_prefix_len`): a prompt longer than
    /// it has its head captured by the piece that computes its last position.
    max_prefix_len: AtomicUsize,
    enabled: bool,
    rows: AtomicU64,
    steps: AtomicU64,
}

impl FastStep {
    /// The fast path of `range`; `enabled` false declines every frame (a failure drill).
    pub fn new(
        range: LayerRange,
        max_rows: usize,
        max_logits_rows: usize,
        enabled: bool,
    ) -> FastStep {
        let bufs = StepBuffers::new(range.weights().config(), 1, 1);
        FastStep {
            enabled,
            range,
            bufs: Mutex::new(bufs),
            registry: Registry::default(),
            max_rows,
            max_logits_rows,
            max_prefix_len: AtomicUsize::new(usize::MAX),
            rows: AtomicU64::new(0),
            steps: AtomicU64::new(0),
        }
    }

    /// Follows the station's `max_prefix_len` (set at start and whenever it changes).
    pub fn set_max_prefix_len(&self, n: usize) {
        self.max_prefix_len.store(n, Ordering::SeqCst);
    }

    /// Rows run here (its share of the station's forwarded rows).
    pub fn rows(&self) -> u64 {
        self.rows.load(Ordering::Relaxed)
    }

    /// Steps answered here.
    pub fn steps(&self) -> u64 {
        self.steps.load(Ordering::Relaxed)
    }

    /// Drops the step buffers grown by larger steps (an idle station).
    pub fn release_buffers(&self) -> bool {
        let Ok(mut bufs) = self.bufs.try_lock() else {
            return false;
        };
        *bufs = StepBuffers::new(self.range.weights().config(), 1, 1);
        true
    }

    /// The answer to a step, or None when Python must answer it (nothing changed then).
    pub fn try_step(&self, head: &[u8], payload: &[u8], received: f64) -> Option<Answer> {
        if !self.enabled {
            return None;
        }
        let header: Value = serde_json::from_slice(head).ok()?;
        let (entries, timing) = self.parse(&header)?;
        let config = self.range.weights().config();
        let rows: usize = entries.iter().map(|e| e.tokens.len()).sum();
        let hidden_in: Option<Vec<f32>> = if self.range.is_entry() {
            if !payload.is_empty() {
                return None;
            }
            if entries
                .iter()
                .any(|e| e.tokens.iter().any(|&t| t as usize >= config.vocab))
            {
                return None;
            }
            None
        } else {
            if payload.len() != rows * config.hidden * 4 {
                return None;
            }
            let values: Vec<f32> = payload
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect();
            if !values.iter().all(|v| v.is_finite()) {
                return None;
            }
            Some(values)
        };
        let sessions: Vec<Arc<HopSession>> = entries
            .iter()
            .map(|e| self.registry.get(e.sid))
            .collect::<Option<_>>()?;
        let exit = self.range.is_exit();
        let head = self.max_prefix_len.load(Ordering::SeqCst) as u64;
        for (e, s) in entries.iter().zip(&sessions) {
            if e.prefill {
                // The prompt's own tokens, before its last piece (Python's 409 otherwise),
                // and no head capture in this piece (`_capture_head`).
                let n = s.prompt_len();
                let end = e.end();
                if end >= n || s.prompt[e.start as usize..end as usize] != e.tokens[..] {
                    return None;
                }
                if e.capture && n > head && e.start < head && head <= end {
                    return None;
                }
            } else if exit && s.sampler.is_none() {
                return None;
            }
        }
        let held = Held::take(&sessions)?;
        let mut rings: Vec<MutexGuard<'_, RangeSession>> = sessions
            .iter()
            .map(|s| s.ring.lock().unwrap_or_else(PoisonError::into_inner))
            .collect();
        for ((e, s), ring) in entries.iter().zip(&sessions).zip(&rings) {
            let fits = if e.prefill {
                // At the clock: a rollback into the prompt is Python's (it forgets the
                // prompt's tail row).
                e.start == ring.clock()
            } else {
                e.start <= ring.clock() && e.start >= s.prompt_len()
            };
            if !fits {
                return None; // Python answers the conflict
            }
        }
        let planned = monotonic_seconds();
        for (e, ring) in entries.iter().zip(rings.iter_mut()) {
            if ring.clock() > e.start {
                ring.rollback(e.start).ok()?;
            }
        }
        let mut outs: Vec<(Vec<f32>, Vec<f32>)> = vec![Default::default(); entries.len()];
        {
            let mut kvs = Vec::with_capacity(entries.len());
            for ring in rings.iter_mut() {
                kvs.push(ring.kv_for(&self.range).ok()?);
            }
            let mut at = 0;
            let mut segments: Vec<Segment<'_>> = Vec::with_capacity(entries.len());
            for ((kv, e), (h, l)) in kvs.into_iter().zip(&entries).zip(outs.iter_mut()) {
                let n = e.tokens.len();
                let input = match &hidden_in {
                    None => ChunkInput::Tokens(&e.tokens),
                    Some(v) => ChunkInput::Hidden(&v[at * config.hidden..(at + n) * config.hidden]),
                };
                at += n;
                segments.push(Segment {
                    kv,
                    input,
                    span: if e.prefill {
                        SpanType::User
                    } else {
                        SpanType::ResponseSentence
                    },
                    logits: match (exit && !e.prefill, n) {
                        (false, _) => LogitsWanted::None,
                        (true, 1) => LogitsWanted::Last,
                        (true, _) => LogitsWanted::All,
                    },
                    hidden_out: h,
                    logits_out: l,
                    shared_prefix: None,
                });
            }
            let mut bufs = self.bufs.lock().unwrap_or_else(PoisonError::into_inner);
            // A failed pass changed no ring: Python runs it again and answers the error.
            self.range.forward_batch(&mut segments, &mut bufs).ok()?;
        }
        let emitted = if exit {
            emit(&entries, &sessions, &outs, config.vocab)
        } else {
            Ok(vec![Vec::new(); entries.len()])
        };
        let computed = monotonic_seconds();
        let emitted = match emitted {
            Ok(emitted) => emitted,
            Err(failure) => {
                drop(rings);
                self.finish(&sessions, computed, rows);
                // `BatchStepper` raises InputError (422) with the sampler's message.
                return Some(Answer::refusal(422, &failure.0, None));
            }
        };
        let results: Vec<Value> = rings
            .iter()
            .zip(&entries)
            .zip(emitted)
            .map(|((ring, e), emitted)| {
                serde_json::json!({
                    "clock": ring.clock(),
                    "rows": if exit { 0 } else { e.tokens.len() },
                    "emitted": emitted,
                    "captured": 0,
                    "logprobs": null,
                    "prompt_logprobs": null,
                    "done": false,
                    "error": null,
                })
            })
            .collect();
        drop(rings);
        self.finish(&sessions, computed, rows);
        drop(held);
        // The exit answers tokens only.
        let mut payload_out = Vec::with_capacity(if exit { 0 } else { rows * config.hidden * 4 });
        for (h, _) in outs.iter().filter(|_| !exit) {
            for v in h {
                payload_out.extend_from_slice(&v.to_le_bytes());
            }
        }
        let mut reply = Map::new();
        reply.insert("entries".into(), Value::Array(results));
        let timing_value = if timing {
            serde_json::json!({
                "received": received,
                "planned": planned,
                "computed": computed,
                "finished": monotonic_seconds(),
            })
        } else {
            Value::Null
        };
        reply.insert("timing".into(), timing_value);
        Some(Answer {
            status: 200,
            head: Value::Object(reply).to_string().into_bytes(),
            payload: payload_out,
        })
    }

    /// Counts a step that ran and marks its sessions used.
    fn finish(&self, sessions: &[Arc<HopSession>], computed: f64, rows: usize) {
        for s in sessions {
            s.last_used.store(computed.to_bits(), Ordering::Relaxed);
        }
        self.rows.fetch_add(rows as u64, Ordering::Relaxed);
        self.steps.fetch_add(1, Ordering::Relaxed);
    }

    /// The header's entries (decode rows, prompt pieces) and its timing flag, when every
    /// field is one the fast path serves; None otherwise.
    fn parse<'a>(&self, header: &'a Value) -> Option<(Vec<Entry<'a>>, bool)> {
        let top = header.as_object()?;
        if top.keys().any(|k| k != "entries" && k != "timing") {
            return None;
        }
        let timing = match top.get("timing") {
            None => false,
            Some(v) => v.as_bool()?,
        };
        let list = top.get("entries")?.as_array()?;
        if list.is_empty() || list.len() > MAX_ENTRIES {
            return None;
        }
        let mut seen = HashSet::with_capacity(list.len());
        let mut entries = Vec::with_capacity(list.len());
        for item in list {
            let e = item.as_object()?;
            if e.keys().any(|k| !ENTRY_KEYS.contains(&k.as_str())) {
                return None;
            }
            let sid = e.get("session_id")?.as_str()?;
            if !is_session_id(sid) || !seen.insert(sid) {
                return None;
            }
            let start = e.get("start")?.as_u64()?;
            let prefill = match e.get("kind")?.as_str()? {
                "decode" => false,
                "prefill" => true,
                _ => return None,
            };
            if start > MAX_START {
                return None;
            }
            let flag = |name: &str| match e.get(name) {
                None => Some(false),
                Some(v) => v.as_bool(),
            };
            // A prompt's last piece records what a capture freezes (Python's); a decode
            // entry takes none of these (Python's 400).
            let capture = flag("capture")?;
            if flag("last")? || flag("emit")? || (capture && !prefill) {
                return None;
            }
            if !e.get("prompt_logprobs").is_none_or(Value::is_null) {
                return None;
            }
            // Only the exit station reports log-probabilities (Python's); elsewhere the
            // field is checked.
            if let Some(v) = e.get("logprobs").filter(|v| !v.is_null()) {
                if self.range.is_exit() || v.as_u64()? > MAX_TOP_LOGPROBS as u64 {
                    return None;
                }
            }
            let list = e.get("tokens")?.as_array()?;
            let most = if self.range.is_exit() && !prefill {
                self.max_rows.min(self.max_logits_rows)
            } else {
                self.max_rows
            };
            if list.is_empty() || list.len() > most {
                return None;
            }
            let tokens = list
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()?;
            entries.push(Entry {
                sid,
                start,
                tokens,
                prefill,
                capture,
            });
        }
        Some((entries, timing))
    }
}

/// The exit station's emission for each decode entry (none for a prompt piece), in order,
/// as `BatchStepper._finish` does it: the row's token observed (penalties), the drafts
/// verified against the rows' logits by the session's sampler (the accepted drafts, then
/// its own token), every row's token observed. Stops at the first failure, as Python's
/// exception does.
fn emit(
    entries: &[Entry<'_>],
    sessions: &[Arc<HopSession>],
    outs: &[(Vec<f32>, Vec<f32>)],
    vocab: usize,
) -> Result<Vec<Vec<u32>>, SamplingError> {
    let mut emitted = Vec::with_capacity(entries.len());
    for ((e, s), (_, logits)) in entries.iter().zip(sessions).zip(outs) {
        if e.prefill {
            emitted.push(Vec::new());
            continue;
        }
        let sampler = s.sampler.as_ref().expect("checked before the pass");
        let mut sampler = sampler.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = Vec::with_capacity(e.tokens.len());
        sampler.observe(e.start, &e.tokens[..1])?;
        sampler.verify(logits, vocab, &e.tokens[1..], e.start + 1, &mut out)?;
        sampler.observe(e.start, &e.tokens)?;
        emitted.push(out);
    }
    Ok(emitted)
}

/// The locks of a step's sessions, taken without waiting and released when dropped.
struct Held<'a> {
    sessions: &'a [Arc<HopSession>],
}

impl<'a> Held<'a> {
    /// Every session's lock, or None (none held) if one is busy or its session closed.
    fn take(sessions: &'a [Arc<HopSession>]) -> Option<Held<'a>> {
        for (i, s) in sessions.iter().enumerate() {
            if !s.lock.try_acquire() {
                for t in &sessions[..i] {
                    t.lock.release();
                }
                return None;
            }
        }
        let held = Held { sessions };
        if sessions.iter().any(|s| s.closed.load(Ordering::Acquire)) {
            return None;
        }
        Some(held)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        for s in self.sessions {
            s.lock.release();
        }
    }
}

/// `^[A-Za-z0-9_-]{16,64}$` (`SESSION_ID_PATTERN`).
fn is_session_id(sid: &str) -> bool {
    (16..=64).contains(&sid.len())
        && sid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
