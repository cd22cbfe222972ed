//! The model fingerprint and the per-tensor digests it is made of.
//!
//! The fingerprint is BLAKE3 over the canonical config, the precision, the arithmetic
//! version, the KV storage type and, for every tensor sorted by name, its name, type, dims
//! and the BLAKE3 digest of its bytes. Two levels, so that a station hashes only the tensors
//! it holds: the others' digests come from one whole-file pass made once
//! ([`tensor_digests`], by the mesh launcher or a cached pass), and each station checks the
//! tensors it owns against them while it copies them. Every tensor is owned by exactly one
//! range, so a mesh whose stations report one fingerprint has checked every byte of the file
//! against it, with each byte hashed once in the whole mesh instead of once per station.

use std::fs::File;
use std::path::Path;

use rayon::prelude::*;

use super::{validate_entry, TensorInfo};
use crate::model::{ModelConfig, ModelError, Precision};
use crate::ring::KvDtype;

/// BLAKE3 of one tensor's bytes.
pub type Digest = [u8; 32];

/// Bytes per `read` when hashing through the file (large enough to amortise the syscall,
/// small enough to stay in L2 between the copy and the hash).
const READ_CHUNK: usize = 1 << 20;

/// Above this, a mapped tensor is hashed on every core ([`blake3::Hasher::update_rayon`]).
const PARALLEL_HASH: usize = 1 << 20;

/// The digest of bytes in memory (an owned tensor, through the mapping it is copied from).
pub(super) fn digest_bytes(bytes: &[u8]) -> Digest {
    let mut h = blake3::Hasher::new();
    if bytes.len() >= PARALLEL_HASH {
        h.update_rayon(bytes);
    } else {
        h.update(bytes);
    }
    *h.finalize().as_bytes()
}

/// The digest of `len` bytes at `start` of `file`, read with `pread` into a small buffer: no
/// mapping is touched, so the pages never join this process's resident set (they pass
/// through the shared page cache only).
pub(super) fn digest_read(file: &File, start: usize, len: usize) -> std::io::Result<Digest> {
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; READ_CHUNK.min(len)];
    let mut at = 0;
    while at < len {
        let n = READ_CHUNK.min(len - at);
        read_exact_at(file, &mut buf[..n], (start + at) as u64)?;
        h.update(&buf[..n]);
        at += n;
    }
    Ok(*h.finalize().as_bytes())
}

#[cfg(unix)]
pub(super) fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(windows)]
pub(super) fn read_exact_at(
    file: &File,
    mut buf: &mut [u8],
    mut offset: u64,
) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        match file.seek_read(buf, offset)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
        }
    }
    Ok(())
}

/// The digest of every tensor of `table` in `path`, in table order, read with `pread` (the
/// file is never mapped: hashing a 5 GB model leaves nothing of it resident). Tensors are
/// hashed in parallel, one per core at a time.
pub fn tensor_digests(path: &Path, table: &[TensorInfo]) -> Result<Vec<Digest>, ModelError> {
    let file = File::open(path)
        .map_err(|e| ModelError::Io(format!("cannot open {}: {e}", path.display())))?;
    let total = file
        .metadata()
        .map_err(|e| ModelError::Io(format!("cannot stat {}: {e}", path.display())))?
        .len();
    let total = usize::try_from(total)
        .map_err(|_| ModelError::Io(format!("{} is too large to map", path.display())))?;
    let entries = table
        .iter()
        .map(|t| validate_entry(t, total))
        .collect::<Result<Vec<_>, _>>()?;
    entries
        .par_iter()
        .map(|e| {
            digest_read(&file, e.start, e.len)
                .map_err(|err| ModelError::Io(format!("cannot read {}: {err}", path.display())))
        })
        .collect()
}

/// BLAKE3 over the canonical config and every tensor's name, type, dims and digest (sorted
/// by name), truncated to u64.
pub(super) fn fingerprint(
    config: &ModelConfig,
    precision: Precision,
    kv_dtype: KvDtype,
    table: &[TensorInfo],
    digests: &[Digest],
) -> u64 {
    let mut sorted: Vec<(&TensorInfo, &Digest)> = table.iter().zip(digests).collect();
    sorted.sort_by(|a, b| a.0.name.cmp(&b.0.name));
    let mut h = blake3::Hasher::new();
    // v2: tensors enter through their digests (v1 hashed their bytes in one stream).
    h.update(b"amplituhedron-rs model fingerprint v2\0");
    h.update(config.canonical().as_bytes());
    // The precision changes every KV value, so volumes of one must never serve the other.
    h.update(precision.name().as_bytes());
    // And so does any change of a precision's canonical arithmetic: volumes a build with
    // other kernels saved to a cache directory must miss. (2: refined 32-element blocks use
    // 16-bit activation codes.)
    h.update(b"\0arithmetic=2");
    // So does the KV storage type (through every later position's attention).
    h.update(b"\0kv=");
    h.update(kv_dtype.name().as_bytes());
    for (t, digest) in sorted {
        h.update(t.name.as_bytes());
        h.update(&[0]);
        h.update(&t.ggml_type.to_le_bytes());
        for d in &t.dims {
            h.update(&d.to_le_bytes());
        }
        h.update(digest);
    }
    crate::keys::digest_prefix_u64(h.finalize().as_bytes())
}
