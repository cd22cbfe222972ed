//! Volumes on disk: restart, corruption of every kind, the disk budget, the two tiers,
//! leftovers of unfinished writes, the directory lock.

use std::fs;
use std::path::{Path, PathBuf};

use super::*;
use crate::volume::disk::{file_name, Header};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "amplituhedron-volume-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&dir);
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    /// The volume files in the directory.
    fn volume_files(&self) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "vol"))
            .collect();
        files.sort();
        files
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn on_disk(dir: &TempDir, max_entries: usize, max_disk_bytes: Option<u64>) -> AmplituhedronCache {
    AmplituhedronCache::new(CacheConfig {
        max_entries,
        policy: EvictionPolicy::Lru,
        cache_dir: Some(dir.path().to_path_buf()),
        max_disk_bytes,
        ..CacheConfig::default()
    })
    .unwrap()
}

/// Three samples, the first two sharing a 20-id prefix (one shared block).
fn samples() -> [Sample; 3] {
    let shared: Vec<u32> = (0..20).collect();
    let mut salted = Sample::new((50..90).collect());
    salted.salt = Some("tenant".into());
    [
        Sample::new([shared.clone(), vec![7, 8, 9]].concat()),
        Sample::new([shared, vec![30; 17]].concat()),
        salted,
    ]
}

/// Captures `s` and waits for its file (writes are behind the capture, on the writer thread).
fn written(s: &Sample, cache: &mut AmplituhedronCache) {
    s.capture(cache).unwrap();
    cache.flush();
}

fn file_of(dir: &TempDir, s: &Sample) -> PathBuf {
    let key = s.key();
    let id = PrefixIdentity::of(&key);
    dir.path()
        .join(file_name(&Namespace::of(&key, &id), &id.digest))
}

#[test]
fn a_reopened_directory_serves_every_volume_bit_for_bit() {
    let dir = TempDir::new("restart");
    let all = samples();
    {
        let mut cache = on_disk(&dir, 8, None);
        for s in &all {
            written(s, &mut cache);
        }
        let st = cache.stats();
        assert_eq!((st.disk_writes, st.disk_entries), (3, 3));
        let sizes: u64 = dir
            .volume_files()
            .iter()
            .map(|p| fs::metadata(p).unwrap().len())
            .sum();
        assert_eq!(st.disk_bytes, sizes);
        assert!(fs::read_dir(dir.path()).unwrap().all(|e| !e
            .unwrap()
            .path()
            .to_string_lossy()
            .ends_with(".part")));
    }
    let mut cache = on_disk(&dir, 8, None);
    let st = cache.stats();
    assert_eq!((st.entries, st.disk_entries, st.bytes), (0, 3, 0));
    for s in &all {
        let v = s.replay(&mut cache).expect("served from disk");
        s.assert_is(&v);
        assert_eq!(v.tail(), Some(&s.tail[..]));
    }
    let st = cache.stats();
    assert_eq!(
        (st.hits, st.disk_hits, st.entries, st.disk_rejected),
        (3, 3, 3, 0)
    );
    // Loaded volumes share their common block like captured ones.
    let (a, b) = (
        all[0].replay(&mut cache).unwrap(),
        all[1].replay(&mut cache).unwrap(),
    );
    assert!(Arc::ptr_eq(&a.blocks()[0], &b.blocks()[0]));
    assert_eq!(cache.stats().bytes, resident_bytes(&cache.resident()));
    assert_eq!(cache.stats().disk_hits, 3, "resident now: no second load");
    // Longest-prefix reuse works straight from disk too.
    drop(cache);
    let mut cache = on_disk(&dir, 8, None);
    let probe = Sample::new([(0..20).collect::<Vec<u32>>(), vec![99; 5]].concat());
    let (v, usable) = cache
        .replay_longest_prefix(&probe.key(), 16)
        .unwrap()
        .unwrap();
    assert_eq!(usable, 20);
    assert_eq!(&v.tokens()[..20], &probe.tokens[..20]);
    assert_eq!(cache.stats().disk_hits, 1);
    // A salted volume stays the tenant's after a restart.
    let mut unsalted = all[2].clone();
    unsalted.salt = None;
    assert!(unsalted.replay(&mut cache).is_none());
}

#[test]
fn memory_evictions_keep_the_file_and_disk_evictions_keep_the_resident_copy() {
    let dir = TempDir::new("tiers");
    let all = samples();
    let one_file = |s: &Sample| {
        let mut c = AmplituhedronCache::default();
        s.capture(&mut c).unwrap();
        Header::of(&s.replay(&mut c).unwrap()).file_len()
    };
    // Room on disk for the two largest files, in memory for one entry.
    let budget = one_file(&all[1]) + one_file(&all[2]);
    let mut cache = on_disk(&dir, 1, Some(budget));
    written(&all[0], &mut cache);
    written(&all[1], &mut cache); // memory: evicts 0 (its file stays)
    assert_eq!((cache.len(), cache.stats().evictions), (1, 1));
    all[0].assert_is(&all[0].replay(&mut cache).unwrap()); // from disk
    assert_eq!(cache.stats().disk_hits, 1);
    // The third file does not fit: the least recently used file goes (1's: not hit since
    // its capture), and with it entry 1, which is not resident either (0 was loaded over it).
    written(&all[2], &mut cache);
    let st = cache.stats();
    assert_eq!((st.disk_evictions, st.disk_entries), (1, 2));
    assert!(st.disk_bytes <= budget);
    assert!(!file_of(&dir, &all[1]).exists());
    assert!(all[1].replay(&mut cache).is_none());
    all[0].assert_is(&all[0].replay(&mut cache).unwrap());
    // A file alone larger than the budget is not written; the volume still serves from
    // memory.
    let tiny_dir = TempDir::new("tiny");
    let mut tiny = on_disk(&tiny_dir, 4, Some(16));
    written(&all[0], &mut tiny);
    let st = tiny.stats();
    assert_eq!(
        (st.disk_skipped_too_large, st.disk_entries, st.entries),
        (1, 0, 1)
    );
    all[0].assert_is(&all[0].replay(&mut tiny).unwrap());
}

#[test]
fn the_disk_budget_is_evicted_by_the_memory_policy() {
    // Cost-aware on disk: with equal sizes, the file whose volume was hit most survives.
    let dir = TempDir::new("policy");
    let s: Vec<Sample> = (0..3).map(|i| Sample::new(vec![i; 8])).collect();
    let file = {
        let mut c = AmplituhedronCache::default();
        s[0].capture(&mut c).unwrap();
        Header::of(&s[0].replay(&mut c).unwrap()).file_len()
    };
    let mut cache = AmplituhedronCache::new(CacheConfig {
        max_entries: 8,
        policy: EvictionPolicy::CostAware,
        cache_dir: Some(dir.path().to_path_buf()),
        max_disk_bytes: Some(2 * file),
        ..CacheConfig::default()
    })
    .unwrap();
    written(&s[0], &mut cache);
    written(&s[1], &mut cache);
    s[0].replay(&mut cache).unwrap();
    s[0].replay(&mut cache).unwrap();
    s[1].replay(&mut cache).unwrap(); // most recent, but hit once
    written(&s[2], &mut cache);
    assert!(file_of(&dir, &s[0]).exists(), "hit twice: kept");
    assert!(
        !file_of(&dir, &s[1]).exists(),
        "hit once: evicted despite being recent"
    );
    assert!(file_of(&dir, &s[2]).exists());
}

/// Captures every sample into `dir` and closes the cache.
fn populate(dir: &TempDir) -> [Sample; 3] {
    let all = samples();
    let mut cache = on_disk(dir, 8, None);
    for s in &all {
        written(s, &mut cache);
    }
    all
}

/// Rewrites `path`'s bytes through `edit`.
fn edit_file(path: &Path, edit: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = fs::read(path).unwrap();
    edit(&mut bytes);
    fs::write(path, bytes).unwrap();
}

/// Re-encodes `path`'s header after `change` (so its checksums are valid again).
fn rewrite_header(path: &Path, change: impl FnOnce(&mut Header)) {
    let mut bytes = fs::read(path).unwrap();
    let mut header = Header::decode(&bytes[..200], |n| Ok(bytes[200..200 + n].to_vec())).unwrap();
    change(&mut header);
    let encoded = header.encode();
    bytes[..encoded.len()].copy_from_slice(&encoded);
    fs::write(path, bytes).unwrap();
}

#[test]
fn a_file_failing_any_check_is_a_miss_and_is_deleted() {
    type Corruption = (&'static str, Box<dyn Fn(&Path)>, bool);
    // (what, how, caught when the directory is opened rather than at the hit)
    let corruptions: Vec<Corruption> = vec![
        ("magic", Box::new(|p| edit_file(p, |b| b[0] ^= 0xff)), true),
        ("version", Box::new(|p| edit_file(p, |b| b[8] = 9)), true),
        (
            "fixed header byte",
            Box::new(|p| edit_file(p, |b| b[100] ^= 1)),
            true,
        ),
        (
            "fingerprint",
            Box::new(|p| edit_file(p, |b| b[16] ^= 1)),
            true,
        ),
        (
            "token id",
            Box::new(|p| edit_file(p, |b| b[200] ^= 1)),
            true,
        ),
        (
            "header checksum",
            Box::new(|p| edit_file(p, |b| b[170] ^= 1)),
            true,
        ),
        (
            "truncated",
            Box::new(|p| edit_file(p, |b| b.truncate(b.len() - 3))),
            true,
        ),
        ("extended", Box::new(|p| edit_file(p, |b| b.push(0))), true),
        (
            "truncated header",
            Box::new(|p| edit_file(p, |b| b.truncate(150))),
            true,
        ),
        (
            "other fingerprint, valid checksums",
            Box::new(|p| rewrite_header(p, |h| h.namespace.fingerprint ^= 1)),
            true,
        ),
        (
            "other token ids, valid checksums",
            Box::new(|p| {
                rewrite_header(p, |h| {
                    let mut t = h.tokens.to_vec();
                    t[0] += 1;
                    h.tokens = t.into();
                })
            }),
            true,
        ),
        (
            "payload byte (first block)",
            Box::new(|p| {
                let start = fs::metadata(p).unwrap().len() as usize / 2;
                edit_file(p, |b| b[start] ^= 0x10)
            }),
            false,
        ),
        (
            "payload byte (logits)",
            Box::new(|p| edit_file(p, |b| *b.last_mut().unwrap() ^= 0x01)),
            false,
        ),
    ];
    for (what, corrupt, at_open) in corruptions {
        let dir = TempDir::new("corrupt");
        let all = populate(&dir);
        let target = file_of(&dir, &all[1]);
        corrupt(&target);
        let mut cache = on_disk(&dir, 8, None);
        let at_open_rejected = cache.stats().disk_rejected;
        assert_eq!(
            at_open_rejected,
            u64::from(at_open),
            "{what}: rejected at open?"
        );
        assert!(all[1].replay(&mut cache).is_none(), "{what}: never served");
        assert!(!target.exists(), "{what}: the file is deleted");
        let st = cache.stats();
        assert_eq!(st.disk_rejected, 1, "{what}");
        assert_eq!((st.misses, st.disk_entries), (1, 2), "{what}");
        // The other volumes are untouched.
        all[0].assert_is(&all[0].replay(&mut cache).unwrap());
        all[2].assert_is(&all[2].replay(&mut cache).unwrap());
    }
}

#[test]
fn a_file_replaced_after_the_open_is_not_served() {
    let dir = TempDir::new("replaced");
    let all = populate(&dir);
    let mut cache = on_disk(&dir, 8, None);
    // Another volume's (valid) file moved under this key's name after indexing.
    fs::rename(file_of(&dir, &all[0]), file_of(&dir, &all[1])).unwrap();
    assert!(all[1].replay(&mut cache).is_none());
    assert!(all[0].replay(&mut cache).is_none(), "its own file is gone");
    let st = cache.stats();
    assert_eq!((st.disk_rejected, st.disk_entries, st.misses), (2, 1, 2));
    all[2].assert_is(&all[2].replay(&mut cache).unwrap());
}

#[test]
fn unfinished_writes_are_deleted_at_open_and_other_models_by_retain_model() {
    let dir = TempDir::new("leftovers");
    let all = populate(&dir);
    // What a kill mid-write leaves: a temporary file (here a torn copy of a real one).
    let torn = dir.path().join("0123.4.5.part");
    let whole = fs::read(file_of(&dir, &all[0])).unwrap();
    fs::write(&torn, &whole[..whole.len() / 2]).unwrap();
    fs::write(dir.path().join("notes.txt"), "not ours").unwrap();
    let mut cache = on_disk(&dir, 8, None);
    assert!(!torn.exists());
    assert!(
        dir.path().join("notes.txt").exists(),
        "foreign files are left alone"
    );
    assert_eq!(cache.stats().disk_rejected, 1);
    assert_eq!(cache.stats().disk_entries, 3);
    // A model change drops every volume of other models, files included.
    assert_eq!(cache.retain_model(all[0].fp), 0);
    assert_eq!(cache.retain_model(all[0].fp + 1), 3);
    assert!(dir.volume_files().is_empty());
    assert_eq!(cache.stats().drift_clears, 3);
}

#[test]
fn clear_erasure_and_the_lock() {
    let dir = TempDir::new("clear");
    let all = populate(&dir);
    let mut cache = on_disk(&dir, 8, None);
    // A second cache on the same directory is refused while this one lives.
    let err = AmplituhedronCache::new(CacheConfig {
        cache_dir: Some(dir.path().to_path_buf()),
        ..CacheConfig::default()
    })
    .unwrap_err();
    assert!(matches!(err, VolumeError::CacheDir { .. }), "{err}");
    assert!(err.to_string().contains("in use"), "{err}");
    // Damage distrusts the file: trimmed in memory, deleted on disk.
    all[0].replay(&mut cache).unwrap();
    let n = all[0].tokens.len();
    assert_eq!(
        cache.report_damage(&all[0].key(), n - 1).unwrap(),
        DamageOutcome::Trimmed { kv_len: n - 1 }
    );
    assert!(!file_of(&dir, &all[0]).exists());
    // An entry only on disk is cleared by damage.
    assert_eq!(
        cache.report_damage(&all[1].key(), 0).unwrap(),
        DamageOutcome::Cleared
    );
    assert!(!file_of(&dir, &all[1]).exists());
    cache.clear();
    assert!(dir.volume_files().is_empty());
    let st = cache.stats();
    assert_eq!(
        (st.entries, st.disk_entries, st.bytes, st.disk_bytes),
        (0, 0, 0, 0)
    );
    drop(cache);
    // A path that is a file cannot be a cache directory.
    let file = dir.path().join("plain");
    fs::write(&file, "x").unwrap();
    let err = AmplituhedronCache::new(CacheConfig {
        cache_dir: Some(file),
        ..CacheConfig::default()
    })
    .unwrap_err();
    assert!(matches!(err, VolumeError::CacheDir { .. }));
    assert!(AmplituhedronCache::new(CacheConfig {
        max_disk_bytes: Some(0),
        ..CacheConfig::default()
    })
    .is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn random_operations_keep_memory_and_disk_within_their_budgets(
        ops in proptest::collection::vec((0u8..4, 0u8..8, 1usize..40), 1..40),
        policy in 0usize..3,
    ) {
        let dir = TempDir::new("budget");
        let mut cache = AmplituhedronCache::new(CacheConfig {
            max_entries: 3,
            max_bytes: Some(6000),
            policy: EvictionPolicy::ALL[policy],
            cache_dir: Some(dir.path().to_path_buf()),
            max_disk_bytes: Some(12_000),
            ..CacheConfig::default()
        }).unwrap();
        for (op, prompt, len) in ops {
            let s = Sample::with_layout(vec![u32::from(prompt); len], 0, 1, 1, 4);
            match op {
                0 | 1 => { written(&s, &mut cache); }
                2 => if let Some(v) = s.replay(&mut cache) { s.assert_is(&v) },
                _ => { let _ = cache.report_damage(&s.key(), len - 1); }
            }
            let st = cache.stats();
            prop_assert!(st.entries <= 3 && st.bytes <= 6000 && st.disk_bytes <= 12_000);
            let files = dir.volume_files();
            prop_assert_eq!(files.len(), st.disk_entries);
            let on_disk: u64 = files.iter().map(|p| fs::metadata(p).unwrap().len()).sum();
            prop_assert_eq!(on_disk, st.disk_bytes);
            prop_assert_eq!(st.bytes, resident_bytes(&cache.resident()));
        }
    }
}

#[test]
fn writes_run_behind_the_capture_and_a_dropped_cache_finishes_them() {
    let dir = TempDir::new("behind");
    let all: Vec<Sample> = (0..12u32)
        .map(|i| Sample::new((i * 100..i * 100 + 40).collect()))
        .collect();
    {
        let mut cache = on_disk(&dir, 64, None);
        for s in &all {
            s.capture(&mut cache).unwrap();
            // Served from memory whether or not its file is written yet.
            s.assert_is(&s.replay(&mut cache).unwrap());
        }
        cache.flush();
        assert_eq!(cache.writes_in_flight(), 0);
        assert_eq!(cache.stats().disk_writes, all.len() as u64);
        // Queued and never waited for: dropping the cache finishes them.
        cache.clear();
        for s in &all {
            s.capture(&mut cache).unwrap();
        }
    }
    let mut cache = on_disk(&dir, 64, None);
    assert_eq!(cache.stats().disk_entries, all.len());
    for s in &all {
        s.assert_is(
            &s.replay(&mut cache)
                .expect("written before the drop returned"),
        );
    }
}

#[test]
fn an_entry_gone_before_its_write_ends_leaves_no_file_and_a_recapture_keeps_its_own() {
    let dir = TempDir::new("gone");
    let all = samples();
    let mut cache = on_disk(&dir, 8, None);
    // Whatever the writer has done by then, the outcome is the same: clear() queues the
    // deletion of queued writes behind them, and the second capture's write comes last.
    for s in &all {
        s.capture(&mut cache).unwrap();
    }
    cache.clear();
    all[0].capture(&mut cache).unwrap();
    cache.flush();
    assert_eq!(dir.volume_files(), vec![file_of(&dir, &all[0])]);
    let st = cache.stats();
    assert_eq!((st.disk_entries, st.entries), (1, 1));
    drop(cache);
    let mut cache = on_disk(&dir, 8, None);
    all[0].assert_is(&all[0].replay(&mut cache).expect("its file"));
    assert!(all[1].replay(&mut cache).is_none());
}

#[test]
fn an_f16_volume_file_is_half_the_kv_bytes_and_maps_back_bit_for_bit() {
    let dir = TempDir::new("f16");
    let s = Sample::new((0..40).collect());
    let slabs = f16_slabs(&s);
    let f32_file = {
        let other = TempDir::new("f16-f32");
        let mut cache = on_disk(&other, 8, None);
        written(&s, &mut cache);
        fs::metadata(file_of(&other, &s)).unwrap().len()
    };
    {
        let mut cache = on_disk(&dir, 8, None);
        cache.capture(&s.key(), f16_data(&s, &slabs)).unwrap();
        cache.flush();
        assert_eq!(cache.stats().disk_writes, 1);
    }
    // Two bytes a value instead of four: the file is smaller by exactly its f16 KV bytes.
    let kv_bytes = 2 * (slabs.0.len() + slabs.1.len()) as u64;
    assert_eq!(
        fs::metadata(file_of(&dir, &s)).unwrap().len(),
        f32_file - kv_bytes
    );
    let mut cache = on_disk(&dir, 8, None);
    let v = s.replay(&mut cache).expect("served from disk");
    assert_eq!(cache.stats().disk_hits, 1);
    assert!(v
        .blocks()
        .iter()
        .all(|b| b.is_mapped() && b.dtype() == KvDtype::F16));
    assert_eq!(v.kv_keys(), &widened(&slabs.0)[..]);
    assert_eq!(v.kv_vals(), &widened(&slabs.1)[..]);
    assert_eq!(
        (v.tail(), v.logits()),
        (Some(&s.tail[..]), s.logits.as_deref())
    );
    assert_eq!(v.nbytes() as u64, kv_bytes + 4 * (40 + 8 + 3));
    // A header naming a KV dtype this build does not know is rejected (and deleted).
    drop(cache);
    edit_file(&file_of(&dir, &s), |bytes| bytes[112] = 3);
    let mut cache = on_disk(&dir, 8, None);
    assert_eq!(cache.stats().disk_rejected, 1);
    assert!(s.replay(&mut cache).is_none());
}
