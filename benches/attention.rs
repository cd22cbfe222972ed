//! Decode attention over the ring's active slots at SmolLM2-135M shapes (9 query heads,
//! 3 KV heads, head_dim 64, one query row), 256 / 1024 / 4096 active slots of a 4096-slot ring.
//!
//! Variants: a shuffled indirection table, an in-order table, contiguous rows (no table), a
//! shuffled table over an f16 ring (the runtime's default storage: half the bytes), a naive
//! scalar loop (per-key dot + libm exp), and a memcpy of the same KV bytes as the bandwidth
//! reference. Throughput is the f32 KV bytes: 2 × active × kv_heads × head_dim × 4.
//! After criterion, a same-run table prints the ratios (indirection overhead, kernel read rate
//! / memcpy): the variants run in interleaved rounds of ~1 ms batches (each after one untimed
//! warm-up call), so the machine's noise hits them alike; the table shows each variant's best
//! batch and, for shuffled / contiguous, also the median of the per-round ratios. The
//! in-order column separates the cost of the table itself from that of scattered rows.

use std::hint::black_box;
use std::time::{Duration, Instant};

use amplituhedron::attention::{attend, attend_with, scratch_len, AttnDims, AttnInputs, Isa};
use amplituhedron::ring::KvSlice;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

const SLOTS: usize = 4096;
const DIMS: AttnDims = AttnDims {
    n_q_heads: 9,
    n_kv_heads: 3,
    head_dim: 64,
};
const ACTIVE: [usize; 3] = [256, 1024, 4096];

struct Fixture {
    q: Vec<f32>,
    ring_k: Vec<f32>,
    ring_v: Vec<f32>,
    ring_k16: Vec<u16>,
    ring_v16: Vec<u16>,
    shuffled: Vec<u32>,
    in_order: Vec<u32>,
    scratch: Vec<f32>,
    out: Vec<f32>,
    copy_dst: Vec<f32>,
}

fn lcg(state: &mut u64) -> u64 {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    *state >> 33
}

impl Fixture {
    fn new(active: usize) -> Fixture {
        let mut s = 7u64;
        let mut rand = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0)
                .collect()
        };
        let row = DIMS.kv_row();
        let q = rand(DIMS.q_row());
        let ring_k = rand(SLOTS * row);
        let ring_v = rand(SLOTS * row);
        let mut perm: Vec<u32> = (0..SLOTS as u32).collect();
        let mut st = 11u64;
        for i in (1..perm.len()).rev() {
            perm.swap(i, (lcg(&mut st) % (i as u64 + 1)) as usize);
        }
        let f16 = |xs: &[f32]| -> Vec<u16> {
            xs.iter()
                .map(|&x| half::f16::from_f32(x).to_bits())
                .collect()
        };
        Fixture {
            q,
            ring_k16: f16(&ring_k),
            ring_v16: f16(&ring_v),
            ring_k,
            ring_v,
            shuffled: perm[..active].to_vec(),
            in_order: (0..active as u32).collect(),
            scratch: vec![0.0; scratch_len(DIMS, active)],
            out: vec![0.0; DIMS.q_row()],
            copy_dst: vec![0.0; 2 * active * row],
        }
    }

    fn kernel(&mut self, slots: Slots) {
        let active = self.in_order.len();
        let row = DIMS.kv_row();
        let (table, local_k, local_v): (&[u32], &[f32], &[f32]) = match slots {
            Slots::Shuffled | Slots::ShuffledF16 => (&self.shuffled, &[], &[]),
            Slots::InOrder => (&self.in_order, &[], &[]),
            Slots::Contiguous => (
                &[],
                &self.ring_k[..active * row],
                &self.ring_v[..active * row],
            ),
        };
        let (ring_k, ring_v) = match slots {
            Slots::ShuffledF16 => (KvSlice::F16(&self.ring_k16), KvSlice::F16(&self.ring_v16)),
            _ => (KvSlice::F32(&self.ring_k), KvSlice::F32(&self.ring_v)),
        };
        let inputs = AttnInputs {
            q_fixed: &self.q,
            q_window: &self.q,
            ring_k,
            ring_v,
            fixed_slots: &[],
            window_slots: table,
            window_head: None,
            local_k,
            local_v,
        };
        attend(&inputs, DIMS, 0.125, &mut self.scratch, &mut self.out).unwrap();
    }

    fn memcpy(&mut self) {
        let n = self.in_order.len() * DIMS.kv_row();
        let (k, v) = self.copy_dst.split_at_mut(n);
        k.copy_from_slice(&self.ring_k[..n]);
        v.copy_from_slice(&self.ring_v[..n]);
    }

    /// The textbook loop: per-key dot products, libm exp, weighted sum.
    fn naive(&mut self) {
        let hd = DIMS.head_dim;
        let row = DIMS.kv_row();
        let group = DIMS.n_q_heads / DIMS.n_kv_heads;
        let n = self.shuffled.len();
        for h in 0..DIMS.n_q_heads {
            let g = h / group;
            let q = &self.q[h * hd..(h + 1) * hd];
            let scores = &mut self.scratch[..n];
            for (s, &slot) in scores.iter_mut().zip(&self.shuffled) {
                let k = &self.ring_k[slot as usize * row + g * hd..][..hd];
                *s = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * 0.125;
            }
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - m).exp();
                total += *s;
            }
            let out = &mut self.out[h * hd..(h + 1) * hd];
            out.fill(0.0);
            for (p, &slot) in scores.iter().zip(&self.shuffled) {
                let v = &self.ring_v[slot as usize * row + g * hd..][..hd];
                for (o, x) in out.iter_mut().zip(v) {
                    *o += p * x;
                }
            }
            for o in out.iter_mut() {
                *o /= total;
            }
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Slots {
    Shuffled,
    InOrder,
    Contiguous,
    ShuffledF16,
}

fn kv_bytes(active: usize) -> u64 {
    (2 * active * DIMS.kv_row() * 4) as u64
}

fn bench_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_attention");
    group
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(900))
        .sample_size(20);
    for active in ACTIVE {
        let mut f = Fixture::new(active);
        group.throughput(Throughput::Bytes(kv_bytes(active)));
        for slots in [
            Slots::Shuffled,
            Slots::InOrder,
            Slots::Contiguous,
            Slots::ShuffledF16,
        ] {
            let name = format!("{slots:?}").to_lowercase();
            group.bench_function(BenchmarkId::new(name, active), |b| {
                b.iter(|| f.kernel(black_box(slots)))
            });
        }
        group.bench_function(BenchmarkId::new("naive_scalar", active), |b| {
            b.iter(|| f.naive())
        });
        group.bench_function(BenchmarkId::new("memcpy", active), |b| {
            b.iter(|| f.memcpy())
        });
    }
    group.finish();
    print_ratios();
}

/// Interleaved rounds per variant in the ratio table.
const ROUNDS: usize = 40;

/// Per-call times of `variants` variants of `run`, measured in interleaved rounds (one ~1 ms
/// batch of each variant per round) so that machine noise hits them alike. Returns each
/// variant's best batch and, per variant, the median over rounds of its batch time divided by
/// variant 0's batch time in the same round.
fn interleaved_times(variants: usize, mut run: impl FnMut(usize)) -> (Vec<f64>, Vec<f64>) {
    let reps: Vec<usize> = (0..variants)
        .map(|v| {
            let t = Instant::now();
            run(v);
            ((1e-3 / t.elapsed().as_secs_f64().max(1e-9)) as usize).clamp(1, 1000)
        })
        .collect();
    let mut batch = |v: usize| {
        // One untimed call first: the previous batch ran another variant over other data,
        // and its cold start would otherwise count against whichever variant comes next.
        run(v);
        let t = Instant::now();
        for _ in 0..reps[v] {
            run(v);
        }
        t.elapsed().as_secs_f64() / reps[v] as f64
    };
    for v in 0..variants {
        batch(v);
    }
    let rounds: Vec<Vec<f64>> = (0..ROUNDS)
        .map(|_| (0..variants).map(&mut batch).collect())
        .collect();
    let best = (0..variants)
        .map(|v| rounds.iter().map(|r| r[v]).fold(f64::INFINITY, f64::min))
        .collect();
    let median_ratio = (0..variants)
        .map(|v| {
            let mut ratios: Vec<f64> = rounds.iter().map(|r| r[v] / r[0]).collect();
            ratios.sort_by(f64::total_cmp);
            ratios[ratios.len() / 2]
        })
        .collect();
    (best, median_ratio)
}

fn print_ratios() {
    println!(
        "\nratios (best of {ROUNDS} interleaved rounds, same run; ISA {:?}; shuf/contig also as \
         the median of same-round ratios; in-order = slot table 0, 1, 2, …):",
        Isa::best()
    );
    println!(
        "{:>7} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>9} {:>14} {:>14} {:>11} {:>13}",
        "active",
        "shuffled",
        "in-order",
        "contiguous",
        "memcpy",
        "naive",
        "shuf/contig",
        "(median)",
        "in-ord/contig",
        "kernel/memcpy",
        "naive/shuf",
        "f32/f16 shuf"
    );
    for active in ACTIVE {
        let mut f = Fixture::new(active);
        let bytes = kv_bytes(active) as f64;
        let (best, median) = interleaved_times(5, |v| match v {
            0 => f.kernel(Slots::Contiguous),
            1 => f.kernel(Slots::Shuffled),
            2 => f.kernel(Slots::InOrder),
            3 => f.memcpy(),
            _ => f.kernel(Slots::ShuffledF16),
        });
        let [contiguous, shuffled, in_order, memcpy] = [best[0], best[1], best[2], best[3]];
        let (naive, _) = interleaved_times(1, |_| f.naive());
        let gbs = |t: f64| bytes / t / 1e9;
        println!(
            "{active:>7} {:>9.2}GB/s {:>9.2}GB/s {:>9.2}GB/s {:>9.2}GB/s {:>9.2}GB/s \
             {:>11.1}% {:>8.1}% {:>13.1}% {:>14.2} {:>10.1}x {:>12.2}x",
            gbs(shuffled),
            gbs(in_order),
            gbs(contiguous),
            gbs(memcpy),
            gbs(naive[0]),
            (shuffled / contiguous - 1.0) * 100.0,
            (median[1] - 1.0) * 100.0,
            (in_order / contiguous - 1.0) * 100.0,
            memcpy / shuffled,
            naive[0] / shuffled,
            median[1] / median[4],
        );
    }
    // Cross-ISA speed, for the record (all ISAs give identical bits). The SIMD paths are
    // interleaved with each other; the scalar path (milliseconds a call) is timed on its own.
    let mut f = Fixture::new(4096);
    let isas: Vec<Isa> = Isa::ALL.into_iter().filter(|i| i.is_available()).collect();
    let mut run = |isa: Isa| {
        let inputs = AttnInputs {
            q_fixed: &f.q,
            q_window: &f.q,
            ring_k: KvSlice::F32(&f.ring_k),
            ring_v: KvSlice::F32(&f.ring_v),
            fixed_slots: &[],
            window_slots: &f.shuffled,
            window_head: None,
            local_k: &[],
            local_v: &[],
        };
        attend_with(isa, &inputs, DIMS, 0.125, &mut f.scratch, &mut f.out).unwrap();
    };
    let simd: Vec<Isa> = isas.iter().copied().filter(|&i| i != Isa::Scalar).collect();
    let (simd_best, _) = interleaved_times(simd.len(), |v| run(simd[v]));
    let (scalar_best, _) = interleaved_times(1, |_| run(Isa::Scalar));
    for (isa, t) in [(Isa::Scalar, scalar_best[0])]
        .into_iter()
        .chain(simd.into_iter().zip(simd_best))
    {
        println!(
            "  {isa:?}: 4096 shuffled slots {:.1} us ({:.2} GB/s)",
            t * 1e6,
            kv_bytes(4096) as f64 / t / 1e9
        );
    }
}

criterion_group!(benches, bench_decode);
criterion_main!(benches);
