//! What the weights cost in memory: the check made before anything is loaded, and the
//! resident bytes a station reports.
//!
//! A file mapping's pages count in a process's resident set once touched, and stay there
//! until unmapped or dropped, although they are clean page-cache pages shared by every
//! process mapping the file. So the resident bytes of the weights are their anonymous copies
//! plus the mapping's resident pages, read from `/proc/self/smaps` (the `Rss` of the
//! mapping's VMA). `mincore` would not do: for a file mapping it reports what is in the page
//! cache, including pages another station touched.
//!
//! So that the mapping holds only what is read in place, the tensors that are copied are read
//! with `pread` and never through the mapping: a page faulted in there would stay resident,
//! with the neighbours the kernel maps around each fault ("fault-around": a 64 KiB window,
//! or a whole large page-cache folio of a freshly written file, up to 2 MiB). The small F32
//! vectors are copied for the same reason.

use crate::model::ModelError;

/// What a set of weights holds and keeps resident.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightsMemory {
    /// Bytes of the tensors these weights hold (their layer range's, plus the embedding at
    /// the entry and the final norm and LM head at the exit): what the memory check counts.
    pub held: usize,
    /// Anonymous copies: the interleaved matrices (and the LM head's, once made).
    pub copied: usize,
    /// This process's resident pages of the file mapping (`None`: no mapping, or no
    /// `/proc/self/smaps` to read them from).
    pub mapped: Option<usize>,
}

impl WeightsMemory {
    /// Anonymous copies plus resident mapped pages: the weights' share of the resident set.
    pub fn resident(&self) -> usize {
        self.copied + self.mapped.unwrap_or(0)
    }
}

/// `MemAvailable` of `/proc/meminfo` in bytes: what the kernel estimates can be allocated
/// without swapping (free memory plus reclaimable page cache). `None` off Linux.
pub(super) fn mem_available() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo_field(&text, "MemAvailable")
}

fn meminfo_field(text: &str, key: &str) -> Option<usize> {
    let line = text.lines().find(|l| {
        l.strip_prefix(key)
            .is_some_and(|rest| rest.starts_with(':'))
    })?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// The `Rss` of the VMA of `/proc/self/smaps` that starts at `addr`, in bytes.
pub(super) fn mapping_resident(addr: usize) -> Option<usize> {
    let text = std::fs::read_to_string("/proc/self/smaps").ok()?;
    smaps_rss(&text, addr)
}

fn smaps_rss(text: &str, addr: usize) -> Option<usize> {
    let mut inside = false;
    for line in text.lines() {
        // A VMA's header line: "start-end perms offset dev inode [path]".
        if let Some((start, _)) = line.split_once('-') {
            if let Ok(start) = usize::from_str_radix(start, 16) {
                inside = start == addr;
                continue;
            }
        }
        if inside {
            if let Some(rest) = line.strip_prefix("Rss:") {
                let kb: usize = rest.split_whitespace().next()?.parse().ok()?;
                return kb.checked_mul(1024);
            }
        }
    }
    None
}

/// Caps the bytes one process's weights may hold below `MemAvailable` (a byte count): for a
/// host that keeps memory for other work, and for tests of the refusal.
pub const MEMORY_BUDGET_ENV: &str = "AMPLITUHEDRON_MEMORY_BUDGET";

/// What the weights may hold: `MemAvailable`, capped by [`MEMORY_BUDGET_ENV`] (`None`: no
/// limit known). A budget that is not a byte count is an error, not ignored.
fn memory_budget() -> Result<Option<(usize, &'static str)>, ModelError> {
    let available = mem_available().map(|b| (b, "MemAvailable"));
    let Ok(text) = std::env::var(MEMORY_BUDGET_ENV) else {
        return Ok(available);
    };
    let budget: usize = text.trim().parse().map_err(|_| {
        ModelError::Input(format!(
            "{MEMORY_BUDGET_ENV}={text:?} is not a byte count (a non-negative integer)"
        ))
    })?;
    Ok(Some(match available {
        Some((b, _)) if b < budget => (b, "MemAvailable"),
        _ => (budget, MEMORY_BUDGET_ENV),
    }))
}

/// Refuses a range whose tensors do not fit in `MemAvailable` (or the budget of
/// [`MEMORY_BUDGET_ENV`]), before anything is loaded.
pub(super) fn check_fits(held: usize, lo: usize, hi: usize, n: usize) -> Result<(), ModelError> {
    let Some((available, source)) = memory_budget()? else {
        return Ok(());
    };
    if held <= available {
        return Ok(());
    }
    let mut what = format!("layers {lo}:{hi}");
    if lo == 0 {
        what.push_str(" with the token embedding");
    }
    if hi == n {
        what.push_str(" with the final norm and LM head");
    }
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    Err(ModelError::Memory(format!(
        "{what} need {held} bytes ({:.2} GiB) resident, and {source} is {available} \
         bytes ({:.2} GiB): give this station fewer layers (a mesh with more stations), or \
         free memory",
        gib(held),
        gib(available)
    )))
}

/// Reads one byte per page of `bytes`, so a tensor used in place is resident before the
/// first request needs it.
pub(super) fn touch(bytes: &[u8]) {
    let mut acc = 0u8;
    for i in (0..bytes.len()).step_by(4096) {
        acc ^= std::hint::black_box(bytes[i]);
    }
    std::hint::black_box(acc);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_smaps_are_parsed() {
        let meminfo =
            "MemTotal:       24000000 kB\nMemAvailableX:  1 kB\nMemAvailable:   21000 kB\n";
        assert_eq!(meminfo_field(meminfo, "MemAvailable"), Some(21000 * 1024));
        assert_eq!(meminfo_field(meminfo, "Cached"), None);
        let smaps = "\
7f0000000000-7f0000100000 r--p 00000000 fd:00 12 /m.gguf
Size:               1024 kB
Rss:                 256 kB
7f0000200000-7f0000300000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                1024 kB
";
        assert_eq!(smaps_rss(smaps, 0x7f00_0000_0000), Some(256 * 1024));
        assert_eq!(smaps_rss(smaps, 0x7f00_0020_0000), Some(1024 * 1024));
        assert_eq!(smaps_rss(smaps, 0x7f00_0010_0000), None);
    }

    #[test]
    fn the_live_process_reports_memory() {
        if cfg!(target_os = "linux") {
            assert!(mem_available().is_some_and(|b| b > 0));
        }
    }
}
