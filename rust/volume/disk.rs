//! Volumes on disk: one file per volume, written atomically, indexed by its header when a
//! cache opens its directory, mapped and verified in full before it serves a hit.
//!
//! File layout (little-endian):
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `b"AMPVOL\r\n"` |
//! | 8 | format version (`u32`, 1) |
//! | 12 | header length in bytes (`u32`): where the payload starts, a multiple of 64 |
//! | 16 | model fingerprint (`u64`) |
//! | 24 | `layer_lo`, `layer_hi` (`u16` each) |
//! | 28 | flags (`u32`): bit 0 = salted |
//! | 32 | tenant key `BLAKE3(salt)` (32 bytes, zero when unsalted) |
//! | 64 | BLAKE3 digest of the ids (keyed by the tenant key when salted), 32 bytes |
//! | 96 | `prefix_len`, `kv_heads`, `head_dim`, block positions, KV dtype (1 = f32, 2 = f16 bit patterns), tail length, logits length (0 = none) (`u32` each) |
//! | 124 | Pisot drift of the tail (`f32`), so eviction can weigh it before the payload is read |
//! | 128 | payload length in bytes (`u64`) |
//! | 136 | BLAKE3 of the payload (32 bytes) |
//! | 168 | BLAKE3 of bytes `[0, 168)` and the ids (32 bytes) |
//! | 200 | the `prefix_len` token ids (`u32` each), zero padding to the header length |
//!
//! The payload is every KV block in position order (its keys, then its values, each
//! `(layers, kv_heads, positions, head_dim)` of the KV dtype), then the tail residual, then
//! the logits (f32).
//!
//! Writes go to a temporary `*.part` file that is synced and then renamed into place (and
//! the directory synced), so a reader sees a whole file or none; a `*.part` file left by a
//! crash is deleted at the next open and never read. Nothing in a file is trusted: at open
//! every header is checked (magic, version, sizes against the file length, header checksum,
//! digest recomputed from the ids, file name derived from the key) and at a hit the mapped
//! file is checked again against the index and its payload checksum verified; a file that
//! fails is deleted and counts as a miss. Files are never modified in place, which is what
//! makes mapping them safe; the directory is locked against a second cache.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use memmap2::{Mmap, MmapOptions};

use super::block::{block_spans, Floats, KvBlock, BLOCK_POSITIONS};
use super::captured::AmplituhedronVolume;
use super::key::Namespace;
use super::slab::with_elems;
use crate::ring::KvDtype;

const _: () = assert!(
    cfg!(target_endian = "little"),
    "volume files are little-endian and mapped as is"
);

const MAGIC: [u8; 8] = *b"AMPVOL\r\n";
const VERSION: u32 = 1;
/// The header's KV dtype codes.
const DTYPE_F32: u32 = 1;
const DTYPE_F16: u32 = 2;
/// Bytes of the header before the token ids.
const FIXED: usize = 200;
/// Bytes covered by the header checksum before the ids.
const CHECKED: usize = 168;
/// Payload alignment: keeps every float array aligned in the mapping.
const ALIGN: usize = 64;
/// More ids than any real prompt: a header claiming more is corrupt (and is not read).
const MAX_TOKENS: usize = 1 << 24;
const VOLUME_EXT: &str = "vol";
const TEMP_EXT: &str = "part";
const LOCK_FILE: &str = ".lock";

/// A volume file's header, as written and as read back.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Header {
    pub(super) namespace: Namespace,
    pub(super) digest: [u8; 32],
    pub(super) tokens: Arc<[u32]>,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    /// How the KV blocks are stored.
    pub(super) kv_dtype: KvDtype,
    pub(super) tail_len: usize,
    /// 0: no logits.
    pub(super) logits_len: usize,
    pub(super) drift: f32,
    pub(super) payload_checksum: [u8; 32],
}

impl Header {
    /// The header of an intact volume, but for the payload checksum (computed as it is
    /// written).
    pub(super) fn of(volume: &AmplituhedronVolume) -> Self {
        Header {
            namespace: volume.namespace,
            digest: volume.digest,
            tokens: Arc::clone(&volume.tokens),
            kv_heads: volume.kv_heads(),
            head_dim: volume.head_dim(),
            kv_dtype: volume.kv_dtype(),
            tail_len: volume.tail().map_or(0, <[f32]>::len),
            logits_len: volume.logits().map_or(0, <[f32]>::len),
            drift: volume.drift(),
            payload_checksum: [0; 32],
        }
    }

    fn slab_floats(&self) -> Option<usize> {
        self.namespace
            .layers()
            .checked_mul(self.kv_heads)?
            .checked_mul(self.tokens.len())?
            .checked_mul(self.head_dim)
    }

    fn header_len(&self) -> usize {
        (FIXED + 4 * self.tokens.len()).next_multiple_of(ALIGN)
    }

    fn payload_len(&self) -> Option<usize> {
        let kv = self
            .slab_floats()?
            .checked_mul(2)?
            .checked_mul(self.kv_dtype.bytes())?;
        self.tail_len
            .checked_add(self.logits_len)?
            .checked_mul(4)?
            .checked_add(kv)
    }

    /// Bytes of the whole file.
    pub(super) fn file_len(&self) -> u64 {
        (self.header_len() + self.payload_len().expect("checked when built")) as u64
    }

    /// The file name this header's key must have.
    pub(super) fn file_name(&self) -> String {
        file_name(&self.namespace, &self.digest)
    }

    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.header_len());
        out.extend_from_slice(&MAGIC);
        put32(&mut out, VERSION);
        put32(&mut out, self.header_len() as u32);
        out.extend_from_slice(&self.namespace.fingerprint.to_le_bytes());
        out.extend_from_slice(&self.namespace.layer_lo.to_le_bytes());
        out.extend_from_slice(&self.namespace.layer_hi.to_le_bytes());
        put32(&mut out, u32::from(self.namespace.salt_key.is_some()));
        out.extend_from_slice(&self.namespace.salt_key.unwrap_or([0; 32]));
        out.extend_from_slice(&self.digest);
        for v in [
            self.tokens.len(),
            self.kv_heads,
            self.head_dim,
            BLOCK_POSITIONS,
            dtype_code(self.kv_dtype) as usize,
            self.tail_len,
            self.logits_len,
        ] {
            put32(&mut out, v as u32);
        }
        out.extend_from_slice(&self.drift.to_le_bytes());
        let payload = self.payload_len().expect("checked when built") as u64;
        out.extend_from_slice(&payload.to_le_bytes());
        out.extend_from_slice(&self.payload_checksum);
        debug_assert_eq!(out.len(), CHECKED);
        let ids = as_bytes(&self.tokens);
        let checksum = header_checksum(&out, ids);
        out.extend_from_slice(&checksum);
        out.extend_from_slice(ids);
        out.resize(self.header_len(), 0);
        out
    }

    /// Parses and checks a header: `fixed` is its first [`FIXED`] bytes, `read_ids` reads the
    /// given number of id bytes that follow them.
    pub(super) fn decode(
        fixed: &[u8],
        read_ids: impl FnOnce(usize) -> io::Result<Vec<u8>>,
    ) -> Result<Header, Reject> {
        if fixed.len() < FIXED || fixed[..8] != MAGIC {
            return Err(Reject::Header("bad magic"));
        }
        let u32_at = |at: usize| u32::from_le_bytes(fixed[at..at + 4].try_into().unwrap());
        let word = |at: usize| u32_at(at) as usize;
        if u32_at(8) != VERSION {
            return Err(Reject::Header("unknown format version"));
        }
        let prefix_len = word(96);
        if prefix_len == 0 || prefix_len > MAX_TOKENS {
            return Err(Reject::Header("token count out of range"));
        }
        let id_bytes = read_ids(4 * prefix_len).map_err(|_| Reject::Size)?;
        if header_checksum(&fixed[..CHECKED], &id_bytes) != fixed[CHECKED..FIXED] {
            return Err(Reject::Header("header checksum mismatch"));
        }
        let salted = match u32_at(28) {
            0 => false,
            1 => true,
            _ => return Err(Reject::Header("unknown flags")),
        };
        let bytes32 = |at: usize| -> [u8; 32] { fixed[at..at + 32].try_into().unwrap() };
        let namespace = Namespace {
            fingerprint: u64::from_le_bytes(fixed[16..24].try_into().unwrap()),
            layer_lo: u16::from_le_bytes([fixed[24], fixed[25]]),
            layer_hi: u16::from_le_bytes([fixed[26], fixed[27]]),
            salt_key: salted.then(|| bytes32(32)),
        };
        let tokens: Arc<[u32]> = id_bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let kv_dtype = match u32_at(112) {
            DTYPE_F32 => KvDtype::F32,
            DTYPE_F16 => KvDtype::F16,
            _ => return Err(Reject::Header("unsupported KV dtype")),
        };
        let header = Header {
            namespace,
            digest: bytes32(64),
            tokens,
            kv_heads: word(100),
            head_dim: word(104),
            kv_dtype,
            tail_len: word(116),
            logits_len: word(120),
            drift: f32::from_le_bytes(fixed[124..128].try_into().unwrap()),
            payload_checksum: bytes32(136),
        };
        if namespace.layer_lo >= namespace.layer_hi
            || header.kv_heads == 0
            || header.head_dim == 0
            || header.tail_len == 0
        {
            return Err(Reject::Header("empty dimension"));
        }
        if !(header.drift.is_finite() && header.drift >= 0.0) {
            return Err(Reject::Header("drift out of range"));
        }
        if word(108) != BLOCK_POSITIONS {
            return Err(Reject::Header("unsupported block size"));
        }
        if !salted && fixed[32..64].iter().any(|&b| b != 0) {
            return Err(Reject::Header("tenant key without the salted flag"));
        }
        let payload = u64::from_le_bytes(fixed[128..136].try_into().unwrap());
        if header.payload_len().map(|p| p as u64) != Some(payload)
            || word(12) != header.header_len()
        {
            return Err(Reject::Header("sizes disagree with the shape"));
        }
        if header.namespace.digest_of(&header.tokens) != header.digest {
            return Err(Reject::Header("token ids do not match the digest"));
        }
        Ok(header)
    }
}

/// Why a volume file is not used (it is deleted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Reject {
    /// The file is gone.
    Missing,
    /// The length differs from what the header implies (torn or truncated).
    Size,
    /// The header is malformed, inconsistent or fails its checksum.
    Header(&'static str),
    /// The name does not belong to the key in the header.
    Name,
    /// The header differs from the one indexed at open (the file was replaced).
    Changed,
    /// The payload fails its checksum.
    Checksum,
    /// Reading it failed.
    Io(String),
}

/// A volume file found at open, its header checked.
#[derive(Debug)]
pub(super) struct Scanned {
    pub(super) header: Header,
    pub(super) modified: SystemTime,
}

/// What an open found in the directory.
#[derive(Debug)]
pub(super) struct Scan {
    pub(super) files: Vec<Scanned>,
    /// Files deleted: failed checks, or temporary files of writes that never finished.
    pub(super) rejected: usize,
}

/// The cache's directory, locked for this process.
#[derive(Debug)]
pub(super) struct DiskStore {
    dir: PathBuf,
    /// Held for the store's lifetime: a second cache on the directory fails to open.
    _lock: File,
    /// Temporary file counter.
    writes: AtomicU64,
}

impl DiskStore {
    /// Opens (creating it if needed) and locks `dir`, deletes leftovers of unfinished writes,
    /// and checks the header of every volume file, deleting those that fail.
    pub(super) fn open(dir: &Path) -> io::Result<(DiskStore, Scan)> {
        fs::create_dir_all(dir)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(LOCK_FILE))?;
        lock.try_lock().map_err(|e| match e {
            fs::TryLockError::WouldBlock => io::Error::new(
                io::ErrorKind::ResourceBusy,
                "the directory is in use by another volume cache",
            ),
            fs::TryLockError::Error(e) => e,
        })?;
        let mut scan = Scan {
            files: Vec::new(),
            rejected: 0,
        };
        for item in fs::read_dir(dir)? {
            let item = item?;
            let path = item.path();
            match path.extension().and_then(|e| e.to_str()) {
                Some(TEMP_EXT) => {
                    remove_quietly(&path);
                    scan.rejected += 1;
                }
                Some(VOLUME_EXT) => match scan_file(&path) {
                    Ok(found) => scan.files.push(found),
                    Err(_) => {
                        remove_quietly(&path);
                        scan.rejected += 1;
                    }
                },
                _ => {}
            }
        }
        let store = DiskStore {
            dir: dir.to_path_buf(),
            _lock: lock,
            writes: AtomicU64::new(0),
        };
        Ok((store, scan))
    }

    /// Writes an intact volume atomically; returns its header. On error nothing is left.
    pub(super) fn write(&self, volume: &AmplituhedronVolume) -> io::Result<Header> {
        debug_assert!(!volume.is_erased() && volume.tail().is_some());
        let mut header = Header::of(volume);
        let serial = self.writes.fetch_add(1, Ordering::Relaxed) + 1;
        let name = header.file_name();
        let temp = self
            .dir
            .join(format!("{name}.{}.{serial}.{TEMP_EXT}", std::process::id(),));
        let written = (|| {
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&temp)?;
            file.seek(SeekFrom::Start(header.header_len() as u64))?;
            let mut hasher = blake3::Hasher::new();
            let mut put = |bytes: &[u8]| -> io::Result<()> {
                hasher.update(bytes);
                file.write_all(bytes)
            };
            for b in volume.blocks() {
                for kv in [b.keys(), b.vals()] {
                    put(with_elems!(kv, v => as_bytes(v)))?;
                }
            }
            put(as_bytes(volume.tail().unwrap_or_default()))?;
            put(as_bytes(volume.logits().unwrap_or_default()))?;
            header.payload_checksum = *hasher.finalize().as_bytes();
            file.seek(SeekFrom::Start(0))?;
            file.write_all(&header.encode())?;
            file.sync_all()?;
            fs::rename(&temp, self.dir.join(&name))?;
            File::open(&self.dir)?.sync_all()
        })();
        match written {
            Ok(()) => Ok(header),
            Err(e) => {
                remove_quietly(&temp);
                Err(e)
            }
        }
    }

    /// Maps the file indexed as `expected`, checks it against that header and verifies its
    /// payload checksum; returns the mapping.
    pub(super) fn map(&self, expected: &Header) -> Result<Arc<Mmap>, Reject> {
        let path = self.dir.join(expected.file_name());
        let file = File::open(&path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => Reject::Missing,
            _ => Reject::Io(e.to_string()),
        })?;
        let len = file
            .metadata()
            .map_err(|e| Reject::Io(e.to_string()))?
            .len();
        if len != expected.file_len() {
            return Err(Reject::Size);
        }
        // SAFETY: volume files are never written after the rename that publishes them and
        // the directory is locked to this cache, so the mapping does not change under us;
        // the length was checked just above. Populated up front: the checksum reads every
        // page anyway, and one read-ahead beats a fault per page.
        let map = unsafe { MmapOptions::new().populate().map(&file) }
            .map_err(|e| Reject::Io(e.to_string()))?;
        let start = expected.header_len();
        let header = Header::decode(&map[..FIXED], |n| {
            map.get(FIXED..FIXED + n)
                .map(<[u8]>::to_vec)
                .ok_or_else(|| io::ErrorKind::UnexpectedEof.into())
        })?;
        if header != *expected {
            return Err(Reject::Changed);
        }
        let mut hasher = blake3::Hasher::new();
        hasher.update_rayon(&map[start..]);
        if *hasher.finalize().as_bytes() != expected.payload_checksum {
            return Err(Reject::Checksum);
        }
        Ok(Arc::new(map))
    }

    /// Deletes the file of `header` (a missing file is not an error).
    pub(super) fn remove(&self, header: &Header) {
        remove_quietly(&self.dir.join(header.file_name()));
    }
}

/// The pieces of a verified mapped volume: its KV blocks, tail and logits.
pub(super) fn mapped_parts(
    header: &Header,
    map: &Arc<Mmap>,
) -> (Vec<KvBlock>, Vec<f32>, Option<Vec<f32>>) {
    let row = header.namespace.layers() * header.kv_heads * header.head_dim;
    let mut at = header.header_len();
    let blocks = block_spans(header.tokens.len())
        .map(|(_, n)| {
            let values = 2 * row * n;
            let block = KvBlock::new(n, Floats::mapped(map, at, values, header.kv_dtype));
            at += header.kv_dtype.bytes() * values;
            block
        })
        .collect();
    let mut floats = |n: usize| {
        let mut out = vec![0.0f32; n];
        for (dst, src) in out.iter_mut().zip(map[at..at + 4 * n].chunks_exact(4)) {
            *dst = f32::from_le_bytes(src.try_into().expect("4 bytes"));
        }
        at += 4 * n;
        out
    };
    let tail = floats(header.tail_len);
    let logits = (header.logits_len > 0).then(|| floats(header.logits_len));
    (blocks, tail, logits)
}

/// Reads and checks the header of the volume file at `path`.
fn scan_file(path: &Path) -> Result<Scanned, Reject> {
    let io = |e: io::Error| Reject::Io(e.to_string());
    let mut file = File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    let mut fixed = [0u8; FIXED];
    file.read_exact(&mut fixed).map_err(|_| Reject::Size)?;
    let header = Header::decode(&fixed, |n| {
        let mut ids = vec![0u8; n];
        file.read_exact(&mut ids)?;
        Ok(ids)
    })?;
    if meta.len() != header.file_len() {
        return Err(Reject::Size);
    }
    if path.file_name().and_then(|n| n.to_str()) != Some(header.file_name().as_str()) {
        return Err(Reject::Name);
    }
    Ok(Scanned {
        header,
        modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
    })
}

/// The file name of a volume: 32 hex digits of a BLAKE3 over its whole key.
pub(super) fn file_name(namespace: &Namespace, digest: &[u8; 32]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"amplituhedron volume file v1");
    h.update(&namespace.fingerprint.to_le_bytes());
    h.update(&namespace.layer_lo.to_le_bytes());
    h.update(&namespace.layer_hi.to_le_bytes());
    match &namespace.salt_key {
        Some(k) => h.update(&[1]).update(k),
        None => h.update(&[0]),
    };
    h.update(digest);
    let hex: String = h.finalize().as_bytes()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{hex}.{VOLUME_EXT}")
}

fn header_checksum(fixed: &[u8], ids: &[u8]) -> [u8; 32] {
    *blake3::Hasher::new()
        .update(fixed)
        .update(ids)
        .finalize()
        .as_bytes()
}

fn put32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// The little-endian bytes of plain words (this target is little-endian).
fn as_bytes<T: Plain>(words: &[T]) -> &[u8] {
    // SAFETY: `T` is a plain value (f32, u32 or u16: no padding, every byte initialised); u8
    // has no alignment requirement; the length covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

/// Types whose values are their bytes (no padding, no invalid bit patterns).
trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for u32 {}
impl Plain for u16 {}

/// The header's code of a KV dtype.
fn dtype_code(dtype: KvDtype) -> u32 {
    match dtype {
        KvDtype::F32 => DTYPE_F32,
        KvDtype::F16 => DTYPE_F16,
    }
}

fn remove_quietly(path: &Path) {
    // Already gone is fine; any other failure leaves a file the next open checks again.
    let _ = fs::remove_file(path);
}
