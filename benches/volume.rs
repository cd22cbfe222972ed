//! Capture and replay of 512-token volumes against a plain memcpy of the same bytes, in
//! memory and from a cache directory, and a restart's time to its first hit.
//!
//! Shapes: 3 KV heads, head_dim 64, f32, one layer and fourteen layers. `replay` is what a
//! station does on a hit: lookup (BLAKE3 of the ids + digest/ids verification) and copying
//! every (layer, head) row range into a preallocated destination with the finiteness check
//! into the copy. `replay_disk` is the same hit served from the volume's file: the entry is
//! not resident, so the hit maps the file, checks its header against the index, verifies
//! the BLAKE3 checksum of its payload, then copies (the file stays in the OS page cache
//! between iterations: this measures the cache's own work, not the device).
//! `capture` is validation + hashing + one checked copy into new blocks; `capture_disk`
//! also writes the file (temp, fsync, rename, fsync dir). `memcpy` copies the same K+V
//! bytes between preallocated buffers; `alloc_memcpy` copies them into freshly allocated
//! buffers (the floor for any capture: new memory must be faulted in by the OS).
//!
//! `restart/first_hit` opens a cache on a directory of 32 fourteen-layer volumes (indexing
//! every header) and replays one of them: a restarted station's time to its first hit
//! (target < 1 s).
//!
//! After criterion finishes, the medians of this run are read back from criterion's
//! estimates and printed as bytes/s with the replay/memcpy, replay_disk/replay and
//! capture/memcpy ratios (target: replay/memcpy >= 0.5).
//!
//! Run: `cargo bench --bench volume`

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use amplituhedron::volume::{AmplituhedronCache, CacheConfig, VolumeData, VolumeKey};
use criterion::{BatchSize, Criterion, Throughput};

mod common;
use common::median_ns;

const PREFIX_LEN: usize = 512;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const HIDDEN: usize = 576;

struct Shape {
    name: &'static str,
    layers: u16,
}

const SHAPES: [Shape; 2] = [
    Shape {
        name: "volume_512tok_1layer",
        layers: 1,
    },
    Shape {
        name: "volume_512tok_14layer",
        layers: 14,
    },
];

/// A fresh directory for a bench, removed on drop.
struct BenchDir(PathBuf);

impl BenchDir {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("amplituhedron-bench-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        BenchDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for BenchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn on_disk(dir: &Path) -> CacheConfig {
    CacheConfig {
        cache_dir: Some(dir.to_path_buf()),
        ..CacheConfig::default()
    }
}

struct Fixture {
    tokens: Vec<u32>,
    tail: Vec<f32>,
    keys: Vec<f32>,
    vals: Vec<f32>,
    layers: usize,
}

impl Fixture {
    fn new(layers: u16) -> Self {
        Self::numbered(layers, 0)
    }

    /// Fixture `i`: its own ids (so fixtures do not share blocks), the same data.
    fn numbered(layers: u16, i: u32) -> Self {
        let layers = usize::from(layers);
        let n = layers * KV_HEADS * PREFIX_LEN * HEAD_DIM;
        Fixture {
            tokens: (0..PREFIX_LEN as u32)
                .map(|t| t * 7 + 1 + i * 100_000)
                .collect(),
            tail: vec![1.0 / (HIDDEN as f32).sqrt(); HIDDEN],
            keys: (0..n).map(|i| (i % 977) as f32 * 1e-3).collect(),
            vals: (0..n).map(|i| (i % 983) as f32 * -1e-3).collect(),
            layers,
        }
    }

    fn key(&self) -> VolumeKey<'_> {
        VolumeKey {
            model_fingerprint: 0xfeed,
            tokens: &self.tokens,
            layer_lo: 0,
            layer_hi: self.layers as u16,
            salt: None,
        }
    }

    fn data(&self) -> VolumeData<'_> {
        VolumeData {
            kv_shape: [self.layers, KV_HEADS, PREFIX_LEN, HEAD_DIM],
            tail: &self.tail,
            kv_keys: (&self.keys).into(),
            kv_vals: (&self.vals).into(),
            logits: None,
        }
    }

    fn kv_bytes(&self) -> u64 {
        ((self.keys.len() + self.vals.len()) * 4) as u64
    }
}

/// A station's work on a hit: the lookup, then every (layer, head) row range copied into
/// the destinations with the finiteness check.
fn replay_into(
    cache: &mut AmplituhedronCache,
    fx: &Fixture,
    dst_keys: &mut [f32],
    dst_vals: &mut [f32],
) {
    let vol = cache
        .replay(black_box(&fx.key()))
        .expect("valid key")
        .expect("hit");
    let rows = PREFIX_LEN * HEAD_DIM;
    for layer in 0..fx.layers {
        for head in 0..KV_HEADS {
            let off = (layer * KV_HEADS + head) * rows;
            vol.copy_rows_checked(
                layer,
                head,
                0..PREFIX_LEN,
                &mut dst_keys[off..off + rows],
                &mut dst_vals[off..off + rows],
            )
            .expect("finite");
        }
    }
    black_box((dst_keys, dst_vals));
}

fn bench_shape(c: &mut Criterion, shape: &Shape) {
    let fx = Fixture::new(shape.layers);
    let mut group = c.benchmark_group(shape.name);
    group
        .throughput(Throughput::Bytes(fx.kv_bytes()))
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(20);

    let mut dst_keys = vec![0.0f32; fx.keys.len()];
    let mut dst_vals = vec![0.0f32; fx.vals.len()];

    group.bench_function("memcpy", |b| {
        b.iter(|| {
            dst_keys.copy_from_slice(black_box(&fx.keys));
            dst_vals.copy_from_slice(black_box(&fx.vals));
            black_box((&dst_keys, &dst_vals));
        })
    });

    let mut cache = AmplituhedronCache::default();
    cache.capture(&fx.key(), fx.data()).expect("valid capture");
    group.bench_function("replay", |b| {
        b.iter(|| replay_into(&mut cache, &fx, &mut dst_keys, &mut dst_vals))
    });
    // (Unless a filter skipped it: the destinations are still zero then.)
    let copied = |dst: &[f32]| dst.iter().any(|&v| v != 0.0);
    if copied(&dst_keys) {
        assert!(
            dst_keys == fx.keys && dst_vals == fx.vals,
            "replay copied the slab exactly"
        );
    }

    // What any capture into new memory costs at least: fresh buffers plus a plain copy.
    group.bench_function("alloc_memcpy", |b| {
        b.iter_batched(
            || (),
            |()| (black_box(&fx.keys).to_vec(), black_box(&fx.vals).to_vec()),
            BatchSize::SmallInput,
        )
    });

    group.bench_function("capture", |b| {
        b.iter_batched(
            || AmplituhedronCache::new(CacheConfig::default()).expect("default config"),
            |mut cache| {
                let out = cache.capture(black_box(&fx.key()), fx.data());
                black_box(out.expect("valid capture"));
                cache // dropped outside the timed section
            },
            BatchSize::SmallInput,
        )
    });

    // The same hit served from the file: memory holds nothing (max_bytes below one volume),
    // so every replay maps and verifies the file.
    let dir = BenchDir::new(shape.name);
    let mut disk = AmplituhedronCache::new(on_disk(dir.path())).expect("cache directory");
    disk.capture(&fx.key(), fx.data()).expect("valid capture");
    disk.set_max_bytes(Some(1)).expect("valid limit");
    dst_keys.fill(0.0);
    group.bench_function("replay_disk", |b| {
        b.iter(|| replay_into(&mut disk, &fx, &mut dst_keys, &mut dst_vals))
    });
    if copied(&dst_keys) {
        assert!(dst_keys == fx.keys, "the file gave back the slab exactly");
        assert_eq!(
            disk.stats().entries,
            0,
            "never resident: the hits read the file"
        );
    }
    drop(disk);

    let capture_dir = BenchDir::new(&format!("{}-capture", shape.name));
    // "capture_disk": the whole write (capture, then waiting for the file to be synced and
    // renamed); "capture_disk_behind": what a capture costs its caller, the write running
    // behind it on the writer thread (finished when the cache is dropped, outside the timing).
    for (name, wait) in [("capture_disk", true), ("capture_disk_behind", false)] {
        group.bench_function(name, |b| {
            b.iter_batched(
                || {
                    let _ = std::fs::remove_dir_all(capture_dir.path());
                    AmplituhedronCache::new(on_disk(capture_dir.path())).expect("cache directory")
                },
                |mut cache| {
                    let out = cache.capture(black_box(&fx.key()), fx.data());
                    black_box(out.expect("valid capture"));
                    if wait {
                        cache.flush();
                        assert_eq!(cache.stats().disk_writes, 1);
                    }
                    cache
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

/// Files in the restart bench's directory.
const RESTART_FILES: u32 = 32;

fn bench_restart(c: &mut Criterion) {
    let dir = BenchDir::new("restart");
    let fixtures: Vec<Fixture> = (0..RESTART_FILES)
        .map(|i| Fixture::numbered(14, i))
        .collect();
    {
        let mut cache = AmplituhedronCache::new(on_disk(dir.path())).expect("cache directory");
        for fx in &fixtures {
            cache.capture(&fx.key(), fx.data()).expect("valid capture");
        }
        cache.flush();
        assert_eq!(cache.stats().disk_entries, RESTART_FILES as usize);
    }
    let mut group = c.benchmark_group("restart");
    group
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(10);
    let probe = &fixtures[RESTART_FILES as usize / 2];
    group.bench_function("first_hit", |b| {
        b.iter(|| {
            let mut cache = AmplituhedronCache::new(on_disk(dir.path())).expect("cache directory");
            let hit = cache.replay(&probe.key()).expect("valid key");
            assert!(hit.is_some(), "served from disk at once");
            black_box(hit);
            cache // closed outside the timed section
        })
    });
    group.finish();
}

fn summary(since: SystemTime) {
    println!("\nvolume bench summary (medians of this run)");
    if let Some(ns) = median_ns(&["restart", "first_hit"], since) {
        println!(
            "  restart to first hit ({RESTART_FILES} files of 14 layers): {:.1} ms (target < 1 s)",
            ns / 1e6
        );
    }
    for shape in &SHAPES {
        let bytes = Fixture::new(shape.layers).kv_bytes() as f64;
        let get = |f: &str| median_ns(&[shape.name, f], since);
        let rate = |ns: Option<f64>| {
            ns.map_or_else(|| "n/a".to_owned(), |ns| format!("{:.2} GB/s", bytes / ns))
        };
        let (memcpy, replay, capture) = (get("memcpy"), get("replay"), get("capture"));
        let (alloc_memcpy, replay_disk) = (get("alloc_memcpy"), get("replay_disk"));
        let capture_disk = get("capture_disk");
        println!(
            "  {} ({:.2} MiB K+V): memcpy {}, replay {}, replay from disk {}, capture {}, \
             capture + file {}, alloc+memcpy {}",
            shape.name,
            bytes / (1 << 20) as f64,
            rate(memcpy),
            rate(replay),
            rate(replay_disk),
            rate(capture),
            rate(capture_disk),
            rate(alloc_memcpy)
        );
        if let (Some(r), Some(d)) = (replay, replay_disk) {
            println!("    replay_disk/replay = {:.2} (throughput)", r / d);
        }
        // Ratios of throughput: memcpy time / operation time.
        if let (Some(m), Some(r)) = (memcpy, replay) {
            println!("    replay/memcpy  = {:.2} (target >= 0.5)", m / r);
        }
        if let (Some(m), Some(c)) = (memcpy, capture) {
            println!("    capture/memcpy = {:.2}", m / c);
        }
        if let (Some(a), Some(c)) = (alloc_memcpy, capture) {
            println!("    capture/(alloc+memcpy) = {:.2}", a / c);
        }
    }
}

fn main() {
    let since = SystemTime::now();
    let mut c = Criterion::default().configure_from_args();
    for shape in &SHAPES {
        bench_shape(&mut c, shape);
    }
    bench_restart(&mut c);
    c.final_summary();
    summary(since);
}
