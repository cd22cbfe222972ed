//! Capture and replay of 512-token volumes against a plain memcpy of the same bytes.
//!
//! Shapes: 3 KV heads, head_dim 64, f32, one layer and fourteen layers. `replay` is what a
//! station does on a hit: lookup (BLAKE3 of the ids + digest/ids verification) and copying
//! every (layer, head) row range into a preallocated destination with the finiteness check
//! into the copy. `capture` is validation + hashing + one checked copy into new buffers.
//! `memcpy` copies the same K+V bytes between preallocated buffers; `alloc_memcpy` copies
//! them into freshly allocated buffers (the floor for any capture: new memory must be
//! faulted in by the OS).
//!
//! After criterion finishes, the medians of this run are read back from criterion's
//! estimates and printed as bytes/s with the replay/memcpy and capture/memcpy ratios
//! (target: replay/memcpy >= 0.5).
//!
//! Run: `cargo bench --bench volume`

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use amplituhedron::volume::{AmplituhedronCache, CacheConfig, VolumeData, VolumeKey};
use criterion::{BatchSize, Criterion, Throughput};

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

struct Fixture {
    tokens: Vec<u32>,
    tail: Vec<f32>,
    keys: Vec<f32>,
    vals: Vec<f32>,
    layers: usize,
}

impl Fixture {
    fn new(layers: u16) -> Self {
        let layers = usize::from(layers);
        let n = layers * KV_HEADS * PREFIX_LEN * HEAD_DIM;
        Fixture {
            tokens: (0..PREFIX_LEN as u32).map(|i| i * 7 + 1).collect(),
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
            kv_keys: &self.keys,
            kv_vals: &self.vals,
            logits: None,
        }
    }

    fn kv_bytes(&self) -> u64 {
        ((self.keys.len() + self.vals.len()) * 4) as u64
    }
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
    let rows = PREFIX_LEN * HEAD_DIM;
    group.bench_function("replay", |b| {
        b.iter(|| {
            let vol = cache
                .replay(black_box(&fx.key()))
                .expect("valid key")
                .expect("hit");
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
            black_box((&dst_keys, &dst_vals));
        })
    });
    assert_eq!(dst_keys, fx.keys, "replay copied the slab exactly");
    assert_eq!(dst_vals, fx.vals);

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
    group.finish();
}

/// Median time (ns) of `group/function` from criterion's estimates, if written this run.
fn median_ns(group: &str, function: &str, since: SystemTime) -> Option<f64> {
    let root = std::env::var_os("CRITERION_HOME")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("CARGO_TARGET_DIR").map(|d| PathBuf::from(d).join("criterion"))
        })
        .unwrap_or_else(|| PathBuf::from("target/criterion"));
    let path = root.join(group).join(function).join("new/estimates.json");
    if std::fs::metadata(&path).ok()?.modified().ok()? < since {
        return None; // stale: this run did not measure it (filtered out)
    }
    let json = std::fs::read_to_string(path).ok()?;
    let median = &json[json.find("\"median\"")?..];
    let value = &median[median.find("\"point_estimate\":")? + "\"point_estimate\":".len()..];
    let end = value.find([',', '}'])?;
    value[..end].trim().parse().ok()
}

fn summary(since: SystemTime) {
    println!("\nvolume bench summary (medians of this run)");
    for shape in &SHAPES {
        let bytes = Fixture::new(shape.layers).kv_bytes() as f64;
        let get = |f: &str| median_ns(shape.name, f, since);
        let rate = |ns: Option<f64>| {
            ns.map_or_else(|| "n/a".to_owned(), |ns| format!("{:.2} GB/s", bytes / ns))
        };
        let (memcpy, replay, capture) = (get("memcpy"), get("replay"), get("capture"));
        let alloc_memcpy = get("alloc_memcpy");
        println!(
            "  {} ({:.2} MiB K+V): memcpy {}, replay {}, capture {}, alloc+memcpy {}",
            shape.name,
            bytes / (1 << 20) as f64,
            rate(memcpy),
            rate(replay),
            rate(capture),
            rate(alloc_memcpy)
        );
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
    c.final_summary();
    summary(since);
}
