//! The step stream's framing (as `amplituhedron_rs.mesh.protocol` defines it).
//!
//! A request is `STREAM_MAGIC, u16 LE token length T, u32 LE header length H, u32 LE
//! payload length P`, then the token, the JSON header and the payload. An answer is
//! `STREAM_MAGIC, u16 LE status, u32 LE H, u32 LE P`, then the header and the payload.

use std::time::Duration;

pub const STREAM_MAGIC: &[u8; 4] = b"AMS1";
/// Bytes of a frame's fixed prefix.
pub const PREFIX_BYTES: usize = 14;
/// The longest mesh token a frame may carry.
pub const MAX_TOKEN_BYTES: usize = 1024;

/// A request frame's prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefix {
    pub token: usize,
    pub head: usize,
    pub payload: usize,
}

/// The prefix of a request frame; None when it does not start with the magic.
pub fn parse_prefix(bytes: &[u8; PREFIX_BYTES]) -> Option<Prefix> {
    if &bytes[..4] != STREAM_MAGIC {
        return None;
    }
    let u32_at =
        |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
    Some(Prefix {
        token: u16::from_le_bytes([bytes[4], bytes[5]]) as usize,
        head: u32_at(6),
        payload: u32_at(10),
    })
}

/// A request frame (the coordinator's side; tests).
pub fn request(token: &[u8], head: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX_BYTES + token.len() + head.len() + payload.len());
    out.extend_from_slice(STREAM_MAGIC);
    out.extend_from_slice(&(token.len() as u16).to_le_bytes());
    out.extend_from_slice(&(head.len() as u32).to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(token);
    out.extend_from_slice(head);
    out.extend_from_slice(payload);
    out
}

/// An answer: the status, its JSON header and its payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub head: Vec<u8>,
    pub payload: Vec<u8>,
}

impl Answer {
    /// A refusal: `{"detail": message}` (and `retry_after` when given).
    pub fn refusal(status: u16, message: &str, retry_after: Option<u32>) -> Answer {
        let mut body = serde_json::json!({ "detail": message });
        if let Some(s) = retry_after {
            body["retry_after"] = s.into();
        }
        Answer {
            status,
            head: body.to_string().into_bytes(),
            payload: Vec::new(),
        }
    }

    /// The answer as one frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(PREFIX_BYTES + self.head.len() + self.payload.len());
        out.extend_from_slice(STREAM_MAGIC);
        out.extend_from_slice(&self.status.to_le_bytes());
        out.extend_from_slice(&(self.head.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.head);
        out.extend_from_slice(&self.payload);
        out
    }
}

/// The bounds of the stream (the station's edge limits).
#[derive(Clone, Debug)]
pub struct FrameLimits {
    /// The mesh token every frame must carry (None: an open, loopback-only station).
    pub token: Option<Vec<u8>>,
    pub max_json_bytes: usize,
    /// Header and payload together.
    pub max_octet_bytes: usize,
    pub max_connections: usize,
    /// An idle connection closes after this long.
    pub keepalive: Duration,
    /// A frame's prefix and token must be in within this long of its first byte.
    pub header_timeout: Duration,
    /// Its header and payload within this long of the prefix.
    pub body_timeout: Duration,
}

impl FrameLimits {
    /// The refusal of a prefix (and its token), if any; the connection closes after one.
    pub fn refuse(&self, prefix: Prefix, token: &[u8]) -> Option<Answer> {
        if prefix.token > MAX_TOKEN_BYTES {
            return Some(Answer::refusal(401, "invalid mesh token", None));
        }
        if let Some(expected) = &self.token {
            if !constant_time_eq(token, expected) {
                return Some(Answer::refusal(401, "missing or invalid mesh token", None));
            }
        }
        if prefix.head > self.max_json_bytes {
            let m = format!(
                "header of {} bytes exceeds the {}-byte limit",
                prefix.head, self.max_json_bytes
            );
            return Some(Answer::refusal(413, &m, None));
        }
        if prefix.head + prefix.payload > self.max_octet_bytes {
            let m = format!(
                "body of {} bytes exceeds the {}-byte limit of octet bodies",
                prefix.head + prefix.payload,
                self.max_octet_bytes
            );
            return Some(Answer::refusal(413, &m, None));
        }
        None
    }
}

/// Equality whose time depends only on the lengths, not on where the bytes differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Seconds of the host's `CLOCK_MONOTONIC`: Python's `time.monotonic()`, so a step's timing
/// answer is comparable with the caller's clock on the same host.
pub fn monotonic_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}
