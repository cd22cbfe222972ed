use super::*;
use crate::ring::{RingConfig, SpanType};
use std::collections::BTreeMap;

/// Small deterministic generator (splitmix64) for test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn f32s(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp)
            .collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Straightforward f64 attention over an explicit key list.
fn reference(
    q_fixed: &[f32],
    q_window: &[f32],
    keys: &[(Vec<f32>, Vec<f32>, bool)],
    dims: AttnDims,
    scale: f32,
) -> Vec<f32> {
    let hd = dims.head_dim;
    let group = dims.n_q_heads / dims.n_kv_heads;
    let mut out = vec![0.0; dims.q_row()];
    for h in 0..dims.n_q_heads {
        let g = h / group;
        let scores: Vec<f64> = keys
            .iter()
            .map(|(k, _, fixed)| {
                let q = if *fixed { q_fixed } else { q_window };
                (0..hd)
                    .map(|d| q[h * hd + d] as f64 * k[g * hd + d] as f64)
                    .sum::<f64>()
                    * scale as f64
            })
            .collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let total: f64 = p.iter().sum();
        for d in 0..hd {
            let acc: f64 = keys
                .iter()
                .zip(&p)
                .map(|((_, v, _), p)| p * v[g * hd + d] as f64)
                .sum();
            out[h * hd + d] = (acc / total) as f32;
        }
    }
    out
}

/// A random attention problem: ring of `slots` rows, random fixed/window slot tables and
/// `n_local` local rows.
struct Problem {
    dims: AttnDims,
    q_fixed: Vec<f32>,
    q_window: Vec<f32>,
    ring_k: Vec<f32>,
    ring_v: Vec<f32>,
    fixed: Vec<u32>,
    window: Vec<u32>,
    local_k: Vec<f32>,
    local_v: Vec<f32>,
}

impl Problem {
    fn random(
        rng: &mut Rng,
        dims: AttnDims,
        slots: usize,
        n_fixed: usize,
        n_window: usize,
        n_local: usize,
    ) -> Problem {
        let kv = dims.kv_row();
        let mut perm: Vec<u32> = (0..slots as u32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        Problem {
            dims,
            q_fixed: rng.f32s(dims.q_row(), 1.0),
            q_window: rng.f32s(dims.q_row(), 1.0),
            ring_k: rng.f32s(slots * kv, 2.0),
            ring_v: rng.f32s(slots * kv, 1.0),
            fixed: perm[..n_fixed].to_vec(),
            window: perm[n_fixed..n_fixed + n_window].to_vec(),
            local_k: rng.f32s(n_local * kv, 2.0),
            local_v: rng.f32s(n_local * kv, 1.0),
        }
    }

    fn inputs(&self) -> AttnInputs<'_> {
        AttnInputs {
            q_fixed: &self.q_fixed,
            q_window: &self.q_window,
            ring_k: KvSlice::F32(&self.ring_k),
            ring_v: KvSlice::F32(&self.ring_v),
            fixed_slots: &self.fixed,
            window_slots: &self.window,
            window_head: None,
            local_k: &self.local_k,
            local_v: &self.local_v,
        }
    }

    fn keys(&self) -> Vec<(Vec<f32>, Vec<f32>, bool)> {
        let kv = self.dims.kv_row();
        let ring_row = |s: u32, fixed: bool| {
            let s = s as usize;
            (
                self.ring_k[s * kv..(s + 1) * kv].to_vec(),
                self.ring_v[s * kv..(s + 1) * kv].to_vec(),
                fixed,
            )
        };
        let mut keys: Vec<_> = self.fixed.iter().map(|&s| ring_row(s, true)).collect();
        keys.extend(self.window.iter().map(|&s| ring_row(s, false)));
        for i in 0..self.local_k.len() / kv {
            keys.push((
                self.local_k[i * kv..(i + 1) * kv].to_vec(),
                self.local_v[i * kv..(i + 1) * kv].to_vec(),
                false,
            ));
        }
        keys
    }

    fn run(&self, isa: Isa, scale: f32) -> Vec<f32> {
        let n = self.keys().len();
        let mut scratch = vec![f32::NAN; scratch_len(self.dims, n)];
        let mut out = vec![f32::NAN; self.dims.q_row()];
        attend_with(
            isa,
            &self.inputs(),
            self.dims,
            scale,
            &mut scratch,
            &mut out,
        )
        .unwrap();
        out
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The f16 bit patterns of `xs` (as an f16 ring stores them).
fn f16_bits(xs: &[f32]) -> Vec<u16> {
    xs.iter()
        .map(|&x| half::f16::from_f32(x).to_bits())
        .collect()
}

const SHAPES: [(usize, usize, usize); 7] = [
    (9, 3, 64),
    (4, 4, 16),
    (8, 2, 128),
    (6, 3, 17),
    (2, 1, 100),
    (3, 3, 1),
    (12, 4, 48),
];

#[test]
fn matches_f64_reference_on_every_isa() {
    let mut rng = Rng(1);
    for (n_q_heads, n_kv_heads, head_dim) in SHAPES {
        let dims = AttnDims {
            n_q_heads,
            n_kv_heads,
            head_dim,
        };
        for (n_fixed, n_window, n_local) in [(0, 0, 1), (3, 40, 5), (17, 0, 0), (0, 200, 33)] {
            let p = Problem::random(&mut rng, dims, 300, n_fixed, n_window, n_local);
            let scale = 1.0 / (head_dim as f32).sqrt();
            let expected = reference(&p.q_fixed, &p.q_window, &p.keys(), dims, scale);
            for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
                let got = p.run(isa, scale);
                for (g, e) in got.iter().zip(&expected) {
                    assert!((g - e).abs() <= 2e-6, "{isa:?} {dims:?}: {g} vs {e}");
                }
            }
        }
    }
}

/// An f16 ring is read by widening each value exactly: on every ISA, attention over the f16
/// bits equals the f32 kernel over the same values widened (odd head dims included, where
/// the last block of a row is a partial f16 load).
#[test]
fn f16_rings_equal_the_f32_kernel_on_their_values_on_every_isa() {
    let mut rng = Rng(7);
    for (n_q_heads, n_kv_heads, head_dim) in SHAPES {
        let dims = AttnDims {
            n_q_heads,
            n_kv_heads,
            head_dim,
        };
        for (n_fixed, n_window, n_local) in [(0, 0, 1), (3, 40, 5), (17, 0, 0), (0, 200, 33)] {
            let mut p = Problem::random(&mut rng, dims, 300, n_fixed, n_window, n_local);
            let (k16, v16) = (f16_bits(&p.ring_k), f16_bits(&p.ring_v));
            p.ring_k = KvSlice::F16(&k16).to_f32();
            p.ring_v = KvSlice::F16(&v16).to_f32();
            let scale = 1.0 / (head_dim as f32).sqrt();
            let widened = p.run(Isa::Scalar, scale);
            for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
                let inputs = AttnInputs {
                    ring_k: KvSlice::F16(&k16),
                    ring_v: KvSlice::F16(&v16),
                    ..p.inputs()
                };
                let n = p.keys().len();
                let mut scratch = vec![f32::NAN; scratch_len(dims, n)];
                let mut out = vec![f32::NAN; dims.q_row()];
                attend_with(isa, &inputs, dims, scale, &mut scratch, &mut out).unwrap();
                assert_eq!(bits(&out), bits(&widened), "{isa:?} {dims:?}");
            }
        }
    }
}

/// A row's query heads can be computed in any split (as `attend_batch` does when it has
/// fewer rows than threads): every part equals its slice of the whole row, bit for bit, on
/// every ISA and for both storage types.
#[test]
fn any_split_of_a_rows_heads_equals_the_whole_row() {
    let mut rng = Rng(11);
    for (n_q_heads, n_kv_heads, head_dim) in SHAPES {
        let dims = AttnDims {
            n_q_heads,
            n_kv_heads,
            head_dim,
        };
        let p = Problem::random(&mut rng, dims, 300, 5, 150, 7);
        let (k16, v16) = (f16_bits(&p.ring_k), f16_bits(&p.ring_v));
        let f16_inputs = AttnInputs {
            ring_k: KvSlice::F16(&k16),
            ring_v: KvSlice::F16(&v16),
            ..p.inputs()
        };
        let scale = 1.0 / (head_dim as f32).sqrt();
        let n = p.keys().len();
        for inputs in [p.inputs(), f16_inputs] {
            for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
                let mut scratch = vec![f32::NAN; scratch_len(dims, n)];
                let mut whole = vec![f32::NAN; dims.q_row()];
                run_row(isa, &inputs, dims, scale, &mut scratch, &mut whole);
                for parts in 2..=n_q_heads.min(4) {
                    let mut split = Vec::new();
                    for part in 0..parts {
                        let heads = part * n_q_heads / parts..(part + 1) * n_q_heads / parts;
                        let mut out = vec![f32::NAN; heads.len() * head_dim];
                        let mut scratch = vec![f32::NAN; scratch_len(dims, n)];
                        run_heads(isa, &inputs, dims, scale, heads, &mut scratch, &mut out);
                        split.extend(out);
                    }
                    assert_eq!(bits(&split), bits(&whole), "{isa:?} {dims:?} {parts} parts");
                }
            }
        }
    }
}

#[test]
fn mixed_ring_storage_types_are_refused() {
    let mut rng = Rng(3);
    let dims = AttnDims {
        n_q_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
    };
    let p = Problem::random(&mut rng, dims, 10, 2, 3, 1);
    let v16 = vec![0u16; p.ring_v.len()];
    let inputs = AttnInputs {
        ring_v: KvSlice::F16(&v16),
        ..p.inputs()
    };
    let mut scratch = vec![0.0; scratch_len(dims, 6)];
    let mut out = vec![0.0; dims.q_row()];
    let err = attend(&inputs, dims, 0.25, &mut scratch, &mut out).unwrap_err();
    assert_eq!(err, AttnError::MixedKvDtypes);
    assert!(err.to_string().contains("same type"));
}

#[test]
fn every_isa_is_bit_identical_to_scalar() {
    let available: Vec<Isa> = Isa::ALL.into_iter().filter(|i| i.is_available()).collect();
    // This machine class has AVX-512; make sure the test is not vacuous there.
    if std::arch::is_x86_feature_detected!("avx512f") {
        assert_eq!(available.len(), 3);
    }
    let mut rng = Rng(2);
    for round in 0..40 {
        let (n_q_heads, n_kv_heads, head_dim) = SHAPES[round % SHAPES.len()];
        let dims = AttnDims {
            n_q_heads,
            n_kv_heads,
            head_dim,
        };
        let n_fixed = rng.below(20);
        let n_window = rng.below(150);
        let n_local = 1 + rng.below(40);
        let p = Problem::random(&mut rng, dims, 256, n_fixed, n_window, n_local);
        // Large scales push scores far apart: exercises the exp flush-to-zero branch.
        let scale = [0.125, 1.0, 40.0][round % 3];
        let scalar = bits(&p.run(Isa::Scalar, scale));
        for &isa in &available {
            assert_eq!(bits(&p.run(isa, scale)), scalar, "{isa:?} round {round}");
        }
    }
}

#[test]
fn exp_polynomial_is_accurate_and_identical_across_isas() {
    let xs: Vec<f32> = (0..4096)
        .map(|i| -(i as f32) * 0.0231)
        .chain([-87.3, -87.34, -88.0, -1e30, f32::NEG_INFINITY, -0.0, 0.0])
        .collect();
    let eval = |isa: Isa| -> Vec<f32> {
        let mut out = vec![0.0; xs.len().div_ceil(LANES) * LANES];
        let mut padded = xs.clone();
        padded.resize(out.len(), 0.0);
        for b in (0..padded.len()).step_by(LANES) {
            // SAFETY: the ISA is available (checked by the caller) and both buffers hold 16
            // f32 from `b`.
            unsafe {
                match isa {
                    Isa::Scalar => {
                        ScalarLanes::exp_nonpositive(ScalarLanes::load(padded.as_ptr().add(b)))
                            .store(out.as_mut_ptr().add(b))
                    }
                    Isa::Avx2Fma => avx2::exp_avx2(padded.as_ptr().add(b), out.as_mut_ptr().add(b)),
                    Isa::Avx512 => {
                        avx512::exp_avx512(padded.as_ptr().add(b), out.as_mut_ptr().add(b))
                    }
                }
            }
        }
        out.truncate(xs.len());
        out
    };
    let scalar = eval(Isa::Scalar);
    for (x, y) in xs.iter().zip(&scalar) {
        let exact = (*x as f64).exp();
        if *x < -87.336_55 {
            assert_eq!(*y, 0.0);
        } else {
            assert!(
                ((*y as f64) - exact).abs() <= 2.5e-7 * exact,
                "exp({x}) = {y}, want {exact}"
            );
        }
    }
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        assert_eq!(bits(&eval(isa)), bits(&scalar), "{isa:?}");
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let mut rng = Rng(3);
    let dims = AttnDims {
        n_q_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
    };
    let mut p = Problem::random(&mut rng, dims, 10, 2, 3, 1);
    let mut scratch = vec![0.0; scratch_len(dims, 6)];
    let mut out = vec![0.0; 32];
    let bad = AttnDims {
        n_kv_heads: 3,
        ..dims
    };
    assert_eq!(
        attend(&p.inputs(), bad, 1.0, &mut scratch, &mut out),
        Err(AttnError::BadDims(bad))
    );
    assert!(matches!(
        attend(&p.inputs(), dims, 1.0, &mut scratch[..10], &mut out),
        Err(AttnError::ScratchTooSmall { .. })
    ));
    assert!(matches!(
        attend(&p.inputs(), dims, 1.0, &mut scratch, &mut out[..31]),
        Err(AttnError::ShapeMismatch { what: "out", .. })
    ));
    p.window[1] = 10;
    let err = attend(&p.inputs(), dims, 1.0, &mut scratch, &mut out).unwrap_err();
    assert_eq!(
        err,
        AttnError::SlotOutOfRange {
            slot: 10,
            slots: 10
        }
    );
    assert_eq!(
        err.to_string(),
        "slot 10 out of range: the ring has 10 slots"
    );
    assert!(out.iter().all(|&x| x == 0.0));
    let empty = AttnInputs {
        fixed_slots: &[],
        window_slots: &[],
        window_head: None,
        local_k: &[],
        local_v: &[],
        ..p.inputs()
    };
    assert_eq!(
        attend(&empty, dims, 1.0, &mut scratch, &mut out),
        Err(AttnError::NoKeys)
    );
}

// ----- the model-runtime protocol: chunking and threads never change a bit ---------------

const HEADS: usize = 6;

/// Query rows of a position: `q_window` at its clock; `q_fixed` at its cache position, equal to
/// `q_window` while the two positions coincide (as RoPE makes them).
fn queries(ring: &DynamicRingBuffer, i: usize, layer: usize) -> (Vec<f32>, Vec<f32>) {
    let hd = ring.config().head_dim;
    let c = ring.pending_clock(i);
    let q_window = crate::ring::tests::row_for(c, layer, 2, HEADS * hd);
    let q_fixed = if ring.pending_cache_pos(i) == c {
        q_window.clone()
    } else {
        crate::ring::tests::row_for(c, layer, 3, HEADS * hd)
    };
    (q_fixed, q_window)
}

/// Runs the full protocol over `spans` (type, length), each span cut into chunks of `chunk`;
/// returns every (clock, layer) output.
fn run_stream(
    cfg: &RingConfig,
    spans: &[(SpanType, usize)],
    chunk: usize,
    scratch_blocks: usize,
    recall_first: bool,
) -> BTreeMap<(u64, usize), Vec<u32>> {
    let mut ring = DynamicRingBuffer::new(cfg.clone()).unwrap();
    if recall_first {
        let rows = Rng(9).f32s(cfg.n_layers * cfg.row_len() * 3, 1.0);
        ring.inject_recall(3, &rows, &rows).unwrap();
    }
    let q_row = HEADS * cfg.head_dim;
    let mut scratch = AttnScratch::new(scratch_blocks, HEADS, cfg.slots + cfg.max_chunk);
    let mut outputs = BTreeMap::new();
    for &(span, len) in spans {
        let mut done = 0;
        while done < len {
            let n = chunk.min(len - done);
            ring.begin_append(n, span, done == 0).unwrap();
            for layer in 0..cfg.n_layers {
                let (k, v) = crate::ring::tests::pending_rows(&ring, layer);
                let (mut qf, mut qw) = (Vec::new(), Vec::new());
                for i in 0..n {
                    let (f, w) = queries(&ring, i, layer);
                    qf.extend(f);
                    qw.extend(w);
                }
                let mut out = vec![0.0; n * q_row];
                let scale = 1.0 / (cfg.head_dim as f32).sqrt();
                attend_chunk(
                    &ring,
                    layer,
                    &qf,
                    &qw,
                    &k,
                    &v,
                    HEADS,
                    scale,
                    &mut scratch,
                    &mut out,
                )
                .unwrap();
                for i in 0..n {
                    outputs.insert(
                        (ring.pending_clock(i), layer),
                        bits(&out[i * q_row..(i + 1) * q_row]),
                    );
                }
                ring.write_pending(layer, &k, &v).unwrap();
            }
            ring.commit_append().unwrap();
            done += n;
        }
    }
    outputs
}

fn stream_config() -> RingConfig {
    RingConfig {
        slots: 96,
        recall: 8,
        n_sys: 10,
        max_chunk: 78,
        undo_capacity: 4,
        ..RingConfig::new(2, 2, 64)
    }
}

/// Spans for ~4 wraps of the 78-slot window, lengths up to a whole window.
fn stream_spans() -> Vec<(SpanType, usize)> {
    let mut spans = vec![(SpanType::System, 10), (SpanType::User, 70)];
    for (i, len) in [13, 1, 64, 7, 78, 30, 2, 77, 20, 41]
        .into_iter()
        .enumerate()
    {
        spans.push((SpanType::ALL[1 + i % 6], len));
    }
    spans
}

#[test]
fn chunked_appends_match_one_at_a_time_bit_for_bit_across_wraps() {
    let cfg = stream_config();
    let spans = stream_spans();
    let total: usize = spans.iter().map(|s| s.1).sum();
    assert!(total > 4 * 78);
    for recall_first in [false, true] {
        let single = run_stream(&cfg, &spans, 1, 1, recall_first);
        assert_eq!(single.len(), total * cfg.n_layers);
        for chunk in [7, 64, cfg.max_chunk] {
            let chunked = run_stream(&cfg, &spans, chunk, 2, recall_first);
            assert!(
                chunked == single,
                "chunk {chunk}, recall_first {recall_first}"
            );
        }
    }
}

#[test]
fn thread_count_and_row_grouping_never_change_a_bit() {
    let cfg = stream_config();
    let spans = stream_spans();
    let reference = run_stream(&cfg, &spans, 64, 1, true);
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for blocks in [2, 5] {
            let got = pool.install(|| run_stream(&cfg, &spans, 64, blocks, true));
            assert!(got == reference, "threads {threads}, blocks {blocks}");
        }
    }
}

#[test]
fn rows_that_do_not_divide_over_the_threads_split_their_heads_without_changing_a_bit() {
    // Long enough for rows of 128+ keys, where a lone row's heads go to several threads, and
    // the rows of chunks that do not divide over the threads (a verify step's k + 1 rows) are
    // cut into head ranges shared out evenly.
    let cfg = RingConfig {
        slots: 300,
        ..stream_config()
    };
    let spans = [
        (SpanType::System, 10),
        (SpanType::User, 200),
        (SpanType::ALL[2], 150),
    ];
    let reference = run_stream(&cfg, &spans, 1, 1, true);
    for threads in [2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for (chunk, blocks) in [(1, threads), (1, 4), (2, 4), (3, threads), (5, 4), (8, 3)] {
            let got = pool.install(|| run_stream(&cfg, &spans, chunk, blocks, true));
            assert!(
                got == reference,
                "threads {threads}, chunk {chunk}, blocks {blocks}"
            );
        }
    }
}

#[test]
fn before_the_first_wrap_ring_attention_is_plain_causal_attention() {
    let cfg = stream_config();
    let outputs = run_stream(
        &cfg,
        &[(SpanType::System, 10), (SpanType::User, 60)],
        7,
        2,
        false,
    );
    // Recompute clock 50, layer 1 with the f64 reference over positions 0..=50.
    let hd = cfg.head_dim;
    let row = cfg.row_len();
    let keys: Vec<_> = (0..=50u64)
        .map(|c| {
            (
                crate::ring::tests::row_for(c, 1, 0, row),
                crate::ring::tests::row_for(c, 1, 1, row),
                false,
            )
        })
        .collect();
    let q = crate::ring::tests::row_for(50, 1, 2, HEADS * hd);
    let dims = AttnDims {
        n_q_heads: HEADS,
        n_kv_heads: 2,
        head_dim: hd,
    };
    let expected = reference(&q, &q, &keys, dims, 1.0 / 8.0);
    let got: Vec<f32> = outputs[&(50, 1)]
        .iter()
        .map(|&b| f32::from_bits(b))
        .collect();
    for (g, e) in got.iter().zip(&expected) {
        assert!((g - e).abs() <= 2e-6);
    }
}

#[test]
fn chunk_helper_validates_its_arguments() {
    let cfg = stream_config();
    let mut ring = DynamicRingBuffer::new(cfg.clone()).unwrap();
    let mut scratch = AttnScratch::new(1, HEADS, 8);
    let mut out = vec![0.0; HEADS * 64];
    let q = vec![0.0; HEADS * 64];
    let kv = vec![0.0; 2 * 64];
    assert_eq!(
        attend_chunk(
            &ring,
            0,
            &q,
            &q,
            &kv,
            &kv,
            HEADS,
            1.0,
            &mut scratch,
            &mut out
        ),
        Err(AttnError::NoPendingAppend)
    );
    ring.begin_append(1, SpanType::User, true).unwrap();
    assert_eq!(
        attend_chunk(
            &ring,
            2,
            &q,
            &q,
            &kv,
            &kv,
            HEADS,
            1.0,
            &mut scratch,
            &mut out
        ),
        Err(AttnError::LayerOutOfRange {
            layer: 2,
            n_layers: 2
        })
    );
    assert!(matches!(
        attend_chunk(
            &ring,
            0,
            &q,
            &q,
            &kv[1..],
            &kv,
            HEADS,
            1.0,
            &mut scratch,
            &mut out
        ),
        Err(AttnError::ShapeMismatch {
            what: "local_k",
            ..
        })
    ));
    attend_chunk(
        &ring,
        0,
        &q,
        &q,
        &kv,
        &kv,
        HEADS,
        1.0,
        &mut scratch,
        &mut out,
    )
    .unwrap();
}

// ----- the primitives behind pass 1: same bits on every ISA ------------------------------

fn available_isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
}

fn empty_probe() -> LanesProbe {
    LanesProbe {
        sums_in: [[0.0; LANES]; BLOCK_KEYS],
        sums_out: [0.0; BLOCK_KEYS],
        partial_in: [0.0; LANES],
        partial_n: 0,
        loaded: [0.0; LANES],
        stored: [0.0; LANES],
        stored8: [0.0; LANES],
    }
}

/// The probe run on `isa` (which must be available).
fn probe(isa: Isa, mut p: LanesProbe) -> LanesProbe {
    assert!(isa.is_available());
    // SAFETY: the ISA's features are present (checked above).
    unsafe {
        match isa {
            Isa::Scalar => probe_lanes::<ScalarLanes>(&mut p),
            Isa::Avx2Fma => avx2::probe_avx2(&mut p),
            Isa::Avx512 => avx512::probe_avx512(&mut p),
        }
    }
    p
}

/// The canonical horizontal sum, written out: `l + l⊕8`, `l + l⊕4`, `l + l⊕2`, `l + l⊕1`.
fn tree_sum(x: &[f32; LANES]) -> f32 {
    let t8: Vec<f32> = (0..8).map(|l| x[l] + x[l + 8]).collect();
    let t4: Vec<f32> = (0..4).map(|l| t8[l] + t8[l + 4]).collect();
    let t2: Vec<f32> = (0..2).map(|l| t4[l] + t4[l + 2]).collect();
    t2[0] + t2[1]
}

#[test]
fn transposed_horizontal_sums_add_exactly_the_tree_pairs_on_every_isa() {
    let mut rng = Rng(5);
    let mut order_mattered = false;
    for _ in 0..300 {
        let mut p = empty_probe();
        for lanes in p.sums_in.iter_mut() {
            for x in lanes.iter_mut() {
                // Magnitudes 2^-20 … 2^20 with mixed signs: the rounding depends on the order.
                let exponent = rng.below(41) as i32 - 20;
                *x = rng.f32s(1, 1.0)[0] * 2f32.powi(exponent);
            }
        }
        let expected: Vec<f32> = p.sums_in.iter().map(tree_sum).collect();
        order_mattered |= p
            .sums_in
            .iter()
            .zip(&expected)
            .any(|(x, t)| x.iter().sum::<f32>().to_bits() != t.to_bits());
        for isa in available_isas() {
            let got = probe(isa, p.clone());
            assert_eq!(bits(&got.sums_out), bits(&expected), "{isa:?}");
        }
    }
    assert!(
        order_mattered,
        "the data never told the tree from a plain sum"
    );
}

#[test]
fn partial_loads_and_stores_touch_only_their_lanes_on_every_isa() {
    let values: [f32; LANES] = std::array::from_fn(|l| l as f32 + 1.5);
    for n in 0..=LANES {
        let mut p = empty_probe();
        p.partial_in = values;
        p.partial_n = n;
        p.stored = [-7.0; LANES];
        p.stored8 = [-7.0; LANES];
        for isa in available_isas() {
            let got = probe(isa, p.clone());
            let loaded: Vec<f32> = (0..LANES)
                .map(|l| if l < n { values[l] } else { 0.0 })
                .collect();
            let stored: Vec<f32> = (0..LANES)
                .map(|l| if l < n { values[l] } else { -7.0 })
                .collect();
            let stored8: Vec<f32> = (0..LANES)
                .map(|l| if l < 8 { values[l] } else { -7.0 })
                .collect();
            assert_eq!(bits(&got.loaded), bits(&loaded), "{isa:?} load n = {n}");
            assert_eq!(bits(&got.stored), bits(&stored), "{isa:?} store n = {n}");
            assert_eq!(bits(&got.stored8), bits(&stored8), "{isa:?} store8");
        }
    }
}

// ----- score blocks: every block boundary and every row alignment -------------------------

#[test]
fn every_score_block_boundary_is_bit_identical_and_accurate() {
    let mut rng = Rng(6);
    for (n_q_heads, n_kv_heads, head_dim) in [(9, 3, 64), (6, 3, 17), (4, 1, 16), (8, 2, 40)] {
        let dims = AttnDims {
            n_q_heads,
            n_kv_heads,
            head_dim,
        };
        for n_fixed in [0, 1, 7, 8, 9] {
            for n_window in [0, 7, 8, 9, 16, 17] {
                for n_local in [1, 8, 9] {
                    let p = Problem::random(&mut rng, dims, 64, n_fixed, n_window, n_local);
                    let scale = 1.0 / (head_dim as f32).sqrt();
                    let expected = reference(&p.q_fixed, &p.q_window, &p.keys(), dims, scale);
                    let scalar = p.run(Isa::Scalar, scale);
                    for (g, e) in scalar.iter().zip(&expected) {
                        assert!((g - e).abs() <= 2e-6, "{dims:?}: {g} vs {e}");
                    }
                    for isa in available_isas() {
                        assert_eq!(
                            bits(&p.run(isa, scale)),
                            bits(&scalar),
                            "{isa:?} {dims:?} fixed {n_fixed} window {n_window} local {n_local}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn row_alignment_never_changes_a_bit() {
    // The same ring and local rows placed at every f32 offset within a cache line: masked
    // tails, unaligned loads and prefetches must all see the same values.
    let mut rng = Rng(7);
    let dims = AttnDims {
        n_q_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
    };
    let p = Problem::random(&mut rng, dims, 200, 5, 150, 11);
    let scale = 0.125;
    let reference_bits = bits(&p.run(Isa::Scalar, scale));
    let n_keys = p.keys().len();
    for offset in 0..LANES {
        let shifted = |rows: &[f32]| {
            let mut buf = vec![f32::NAN; offset];
            buf.extend_from_slice(rows);
            buf
        };
        let (ring_k, ring_v) = (shifted(&p.ring_k), shifted(&p.ring_v));
        let (local_k, local_v) = (shifted(&p.local_k), shifted(&p.local_v));
        let inputs = AttnInputs {
            ring_k: KvSlice::F32(&ring_k[offset..]),
            ring_v: KvSlice::F32(&ring_v[offset..]),
            local_k: &local_k[offset..],
            local_v: &local_v[offset..],
            ..p.inputs()
        };
        for isa in available_isas() {
            let mut scratch = vec![f32::NAN; scratch_len(dims, n_keys)];
            let mut out = vec![f32::NAN; dims.q_row()];
            attend_with(isa, &inputs, dims, scale, &mut scratch, &mut out).unwrap();
            assert_eq!(bits(&out), reference_bits, "{isa:?} offset {offset}");
        }
    }
}

// ----- sliding-window layers ------------------------------------------------------------

/// A sliding layer's stream: every row equals plain attention over exactly the keys at
/// `c − window + 1 ..= c`, bit for bit whatever the chunking, although the ring (window
/// plus one span of slack) still holds older rows.
#[test]
fn sliding_rows_see_exactly_the_window_at_any_chunking() {
    const WINDOW: usize = 16;
    let cfg = RingConfig {
        slots: WINDOW + 8,
        recall: 0,
        n_sys: 0,
        max_chunk: 8,
        undo_capacity: 4,
        ..RingConfig::new(1, 2, 32)
    };
    let hd = cfg.head_dim;
    let q_row = HEADS * hd;
    let dims = AttnDims {
        n_q_heads: HEADS,
        n_kv_heads: 2,
        head_dim: hd,
    };
    let scale = 1.0 / (hd as f32).sqrt();
    let run = |chunk: usize| {
        let mut ring = DynamicRingBuffer::new(cfg.clone()).unwrap();
        let mut scratch = AttnScratch::new(2, HEADS, cfg.slots + cfg.max_chunk);
        let mut outputs = BTreeMap::new();
        // Spans of 8 positions at fixed boundaries (as the model runtime opens them).
        let mut clock = 0u64;
        while clock < 72 {
            let n = (chunk as u64).min(8 - clock % 8) as usize;
            ring.begin_append(n, SpanType::User, clock.is_multiple_of(8))
                .unwrap();
            let (k, v) = crate::ring::tests::pending_rows(&ring, 0);
            let q: Vec<f32> = (0..n)
                .flat_map(|i| crate::ring::tests::row_for(ring.pending_clock(i), 0, 2, q_row))
                .collect();
            let mut out = vec![0.0; n * q_row];
            let chunk = PendingChunk {
                ring: &ring,
                q_fixed: &q,
                q_window: &q,
                local_k: &k,
                local_v: &v,
                window: Some(WINDOW),
                shared_prefix: None,
            };
            attend_batch(&[chunk], 0, HEADS, scale, &mut scratch, &mut out).unwrap();
            for i in 0..n {
                outputs.insert(
                    ring.pending_clock(i),
                    out[i * q_row..(i + 1) * q_row].to_vec(),
                );
            }
            ring.write_pending(0, &k, &v).unwrap();
            ring.commit_append().unwrap();
            clock += n as u64;
        }
        outputs
    };
    let whole = run(8);
    for chunk in [1, 3] {
        let got = run(chunk);
        let first_diff = whole.keys().find(|c| got[c] != whole[c]);
        assert_eq!(first_diff, None, "chunk {chunk}");
    }
    let row = cfg.row_len();
    for (&c, got) in &whole {
        let keys: Vec<(Vec<f32>, Vec<f32>, bool)> = ((c + 1).saturating_sub(WINDOW as u64)..=c)
            .map(|p| {
                (
                    crate::ring::tests::row_for(p, 0, 0, row),
                    crate::ring::tests::row_for(p, 0, 1, row),
                    false,
                )
            })
            .collect();
        let q = crate::ring::tests::row_for(c, 0, 2, q_row);
        let expected = reference(&q, &q, &keys, dims, scale);
        for (g, e) in got.iter().zip(&expected) {
            assert!((g - e).abs() <= 2e-6, "clock {c}: {g} vs {e}");
        }
    }
}

#[test]
fn sliding_attention_refuses_rings_with_fixed_rows() {
    let cfg = stream_config();
    let mut ring = DynamicRingBuffer::new(cfg).unwrap();
    ring.append_slab(
        10,
        &vec![0.0; 2 * 128 * 10],
        &vec![0.0; 2 * 128 * 10],
        SpanType::System,
        true,
    )
    .unwrap();
    ring.begin_append(1, SpanType::User, true).unwrap();
    let mut scratch = AttnScratch::new(1, HEADS, 200);
    let (q, kv) = (vec![0.0; HEADS * 64], vec![0.0; 2 * 64]);
    let mut out = vec![0.0; HEADS * 64];
    let chunk = PendingChunk {
        ring: &ring,
        q_fixed: &q,
        q_window: &q,
        local_k: &kv,
        local_v: &kv,
        window: Some(8),
        shared_prefix: None,
    };
    let err = attend_batch(&[chunk], 0, HEADS, 1.0, &mut scratch, &mut out).unwrap_err();
    assert_eq!(
        err,
        AttnError::BadWindow {
            window: 8,
            fixed: 10
        }
    );
}

/// A shared prefix changes where attention reads the window's first keys, never what it
/// computes: a follower reading them from a leader ring with the same rows gets its own
/// result bit for bit (f16 and f32 rings, one and several pending rows, a sliding window
/// that hides the prefix's first keys or not); from a ring with
/// other rows there it gets another one (so the leader's rows are what it read); a ring
/// that no longer holds every clock from 0 shares nothing; a bad chunk index is refused.
#[test]
fn a_shared_prefix_reads_the_leaders_rows_with_the_same_result() {
    use crate::ring::tests::{append, pending_rows, row_for};
    use crate::ring::KvDtype;
    for kv_dtype in [KvDtype::F32, KvDtype::F16] {
        let cfg = RingConfig {
            slots: 64,
            recall: 0,
            n_sys: 0,
            max_chunk: 8,
            kv_dtype,
            ..RingConfig::new(1, 2, 32)
        };
        let q_row = HEADS * cfg.head_dim;
        let scale = 1.0 / (cfg.head_dim as f32).sqrt();
        let filled = |clocks: usize| {
            let mut ring = DynamicRingBuffer::new(cfg.clone()).unwrap();
            append(&mut ring, clocks, 8, SpanType::User, true).unwrap();
            ring
        };
        // A ring whose rows at every clock differ from the others'.
        let mut liar = DynamicRingBuffer::new(cfg.clone()).unwrap();
        for i in 0..3 {
            liar.begin_append(8, SpanType::User, i == 0).unwrap();
            let row = cfg.row_len();
            let other = |which| -> Vec<f32> {
                (0..8)
                    .flat_map(|i| row_for(liar.pending_clock(i) + 1000, 0, which, row))
                    .collect()
            };
            let (k, v) = (other(0), other(1));
            liar.write_pending(0, &k, &v).unwrap();
            liar.commit_append().unwrap();
        }
        for (rows, window) in [(1, None), (3, None), (1, Some(12)), (3, Some(12))] {
            let (mut leader, mut follower) = (filled(30), filled(24));
            for r in [&mut leader, &mut follower, &mut liar] {
                r.begin_append(rows, SpanType::User, false).unwrap();
            }
            let run = |rings: &[&DynamicRingBuffer], shared: Option<SharedPrefix>| {
                let me = rings.len() - 1;
                let inputs: Vec<_> = rings
                    .iter()
                    .map(|r| {
                        let (k, v) = pending_rows(r, 0);
                        let q: Vec<f32> = (0..rows)
                            .flat_map(|i| row_for(r.pending_clock(i), 0, 2, q_row))
                            .collect();
                        (q, k, v)
                    })
                    .collect();
                let chunks: Vec<PendingChunk<'_>> = rings
                    .iter()
                    .zip(&inputs)
                    .enumerate()
                    .map(|(i, (r, (q, k, v)))| PendingChunk {
                        ring: r,
                        q_fixed: q,
                        q_window: q,
                        local_k: k,
                        local_v: v,
                        window,
                        shared_prefix: if i == me { shared } else { None },
                    })
                    .collect();
                let total: usize = rings.iter().map(|r| r.pending_len()).sum();
                let mut out = vec![f32::NAN; total * q_row];
                let mut scratch = AttnScratch::new(2, HEADS, 64 + 8);
                attend_batch(&chunks, 0, HEADS, scale, &mut scratch, &mut out)?;
                Ok::<_, AttnError>(out[(total - rows) * q_row..].to_vec())
            };
            let alone = run(&[&follower], None).unwrap();
            let sp = |clocks| Some(SharedPrefix { chunk: 0, clocks });
            assert_eq!(shareable_window(&follower, &leader, 20), 20);
            assert_eq!(shareable_window(&follower, &leader, 99), 24);
            for clocks in [1, 20, 24, 99] {
                let shared = run(&[&leader, &follower], sp(clocks)).unwrap();
                assert!(
                    shared == alone,
                    "{kv_dtype:?}, {rows} rows, {clocks} clocks"
                );
            }
            let misled = run(&[&liar, &follower], sp(20)).unwrap();
            assert!(misled != alone, "the leader's rows were not read");
            assert_eq!(
                run(
                    &[&leader, &follower],
                    Some(SharedPrefix {
                        chunk: 1,
                        clocks: 8
                    })
                ),
                Err(AttnError::BadSharedPrefix {
                    chunk: 1,
                    chunks: 2
                })
            );
            // A follower whose window no longer starts at clock 0 shares nothing.
            follower.abort_append();
            append(&mut follower, 16, 8, SpanType::User, true).unwrap();
            follower.prune_oldest_spans(1).unwrap();
            follower.begin_append(rows, SpanType::User, false).unwrap();
            assert!(follower.window_lo() > 0);
            assert_eq!(shareable_window(&follower, &leader, 20), 0);
            let alone = run(&[&follower], None).unwrap();
            assert!(run(&[&liar, &follower], sp(20)).unwrap() == alone);
            liar.abort_append();
        }
    }
}
