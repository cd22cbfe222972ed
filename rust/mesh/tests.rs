use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::frame::{parse_prefix, request, PREFIX_BYTES};
use super::*;
use crate::model::testing::{tiny_config, tiny_weights};
use crate::model::{
    ChunkInput, LayerRange, LogitsAdjust, LogitsWanted, RangeSession, Sampler, SamplingParams,
    SessionConfig,
};
use crate::ring::SpanType;

const SID: &str = "AAAAAAAAAAAAAAAAAAAAAAAA";
const PROMPT: [u32; 5] = [3, 14, 15, 92, 65];

#[test]
fn a_ring_lock_is_released_by_any_thread_and_waits_with_a_timeout() {
    let lock = Arc::new(RingLock::new());
    assert!(lock.try_acquire());
    assert!(!lock.try_acquire());
    assert!(!lock.acquire(Some(Duration::from_millis(20))));
    let other = Arc::clone(&lock);
    let waiter = std::thread::spawn(move || other.acquire(Some(Duration::from_secs(10))));
    std::thread::sleep(Duration::from_millis(20));
    assert!(lock.release());
    assert!(waiter.join().unwrap());
    assert!(lock.is_held());
    assert!(lock.release());
    assert!(!lock.release(), "releasing a free lock is refused");
}

#[test]
fn a_frame_prefix_is_parsed_and_refused_by_its_lengths_and_token() {
    let frame = request(b"secret", b"{}", b"abc");
    let p = parse_prefix(frame[..PREFIX_BYTES].try_into().unwrap()).unwrap();
    assert_eq!((p.token, p.head, p.payload), (6, 2, 3));
    assert!(parse_prefix(b"GET / HTTP/1.1").is_none());
    let limits = limits(Some(b"secret"));
    assert!(limits.refuse(p, b"secret").is_none());
    assert_eq!(limits.refuse(p, b"secreT").unwrap().status, 401);
    assert_eq!(limits.refuse(p, b"").unwrap().status, 401);
    let long = frame::Prefix {
        token: MAX_TOKEN_BYTES + 1,
        ..p
    };
    assert_eq!(limits.refuse(long, b"").unwrap().status, 401);
    let big_head = frame::Prefix { head: 1 << 20, ..p };
    assert_eq!(limits.refuse(big_head, b"secret").unwrap().status, 413);
    let big_body = frame::Prefix {
        payload: 1 << 22,
        ..p
    };
    assert_eq!(limits.refuse(big_body, b"secret").unwrap().status, 413);
}

fn limits(token: Option<&[u8]>) -> FrameLimits {
    FrameLimits {
        token: token.map(<[u8]>::to_vec),
        max_json_bytes: 1 << 16,
        max_octet_bytes: 1 << 21,
        max_connections: 2,
        keepalive: Duration::from_secs(5),
        header_timeout: Duration::from_secs(5),
        body_timeout: Duration::from_secs(5),
    }
}

/// A session of `lo..hi` of the tiny model that has run the prompt (token ids at the
/// entry, the entry's output rows elsewhere); the rows it forwards next.
fn prefilled(lo: usize, hi: usize) -> (RangeSession, Vec<f32>) {
    let w = tiny_weights(7);
    let cfg = SessionConfig {
        slots: 64,
        recall: 8,
        n_sys: 0,
        max_chunk: 16,
    };
    let mut entry = RangeSession::new(Arc::clone(&w), 0, lo.max(1), &cfg).unwrap();
    let (mut h, mut l) = (Vec::new(), Vec::new());
    entry
        .forward(
            ChunkInput::Tokens(&PROMPT),
            SpanType::User,
            LogitsWanted::None,
            &mut h,
            &mut l,
        )
        .unwrap();
    if lo == 0 {
        return (entry, h);
    }
    let mut session = RangeSession::new(w, lo, hi, &cfg).unwrap();
    {
        let (mut out, mut l) = (Vec::new(), Vec::new());
        session
            .forward(
                ChunkInput::Hidden(&h),
                SpanType::User,
                LogitsWanted::None,
                &mut out,
                &mut l,
            )
            .unwrap();
    }
    (session, h)
}

fn decode(sid: &str, start: usize, tokens: &[u32]) -> Vec<u8> {
    serde_json::json!({
        "entries": [{"session_id": sid, "start": start, "tokens": tokens, "kind": "decode",
                     "logprobs": null}],
        "timing": true,
    })
    .to_string()
    .into_bytes()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A fast path over `lo..hi` with one registered session (a twin of it returned, to run
/// the same rows alone).
fn fast_with_session(lo: usize, hi: usize) -> (FastStep, HopSession, RangeSession) {
    fast_with(lo, hi, None, 64)
}

/// [`fast_with_session`] with the session's sampler (the exit's) and the rows of logits an
/// entry may ask.
fn fast_with(
    lo: usize,
    hi: usize,
    sampler: Option<Sampler>,
    max_logits_rows: usize,
) -> (FastStep, HopSession, RangeSession) {
    fast_with_prompt(lo, hi, &PROMPT, sampler, max_logits_rows)
}

/// [`fast_with`] for a session whose prompt is `prompt`, of which [`PROMPT`] ran.
fn fast_with_prompt(
    lo: usize,
    hi: usize,
    prompt: &[u32],
    sampler: Option<Sampler>,
    max_logits_rows: usize,
) -> (FastStep, HopSession, RangeSession) {
    let (session, _) = prefilled(lo, hi);
    let (twin, _) = prefilled(lo, hi);
    let range = LayerRange::new(Arc::clone(session.weights()), lo, hi).unwrap();
    let fast = FastStep::new(range, 64, max_logits_rows, true);
    let ring = Arc::new(Mutex::new(session));
    let lock = Arc::new(RingLock::new());
    let sampler = sampler.map(|s| Arc::new(Mutex::new(s)));
    let hop = || {
        let (ring, lock) = (Arc::clone(&ring), Arc::clone(&lock));
        HopSession::new(ring, lock, prompt.to_vec(), sampler.clone())
    };
    fast.registry.register(SID, hop());
    (fast, hop(), twin)
}

fn sampler(params: SamplingParams) -> Sampler {
    Sampler::new(params).unwrap()
}

fn greedy() -> SamplingParams {
    SamplingParams {
        greedy: true,
        ..SamplingParams::default()
    }
}

/// Two rows of hidden state for the exit (a decode row and one draft's).
fn exit_rows() -> Vec<f32> {
    (0..2 * tiny_config().hidden)
        .map(|i| (i as f32 * 0.37).sin())
        .collect()
}

#[test]
fn a_fast_decode_step_equals_the_session_run_alone() {
    // A middle station (hidden rows in) and the entry station (token ids in).
    for (lo, hi) in [(1, 2), (0, 1)] {
        let (fast, hop, mut twin) = fast_with_session(lo, hi);
        let row: Vec<f32> = (0..tiny_config().hidden)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let (input, payload) = if lo == 0 {
            (ChunkInput::Tokens(&[42]), Vec::new())
        } else {
            (ChunkInput::Hidden(&row), f32_bytes(&row))
        };
        let answer = fast
            .try_step(&decode(SID, PROMPT.len(), &[42]), &payload, 1.0)
            .expect("the fast path serves a decode step");
        let (mut want, mut l) = (Vec::new(), Vec::new());
        twin.forward(
            input,
            SpanType::ResponseSentence,
            LogitsWanted::None,
            &mut want,
            &mut l,
        )
        .unwrap();
        assert_eq!(answer.status, 200);
        assert_eq!(
            answer.payload,
            f32_bytes(&want),
            "bit-identical to the session alone"
        );
        let head: serde_json::Value = serde_json::from_slice(&answer.head).unwrap();
        assert_eq!(head["entries"][0]["clock"], PROMPT.len() + 1);
        assert_eq!(head["entries"][0]["rows"], 1);
        assert!(head["timing"]["computed"].as_f64().unwrap() >= 1.0);
        assert!(
            hop.last_used().is_none(),
            "the twin entry is not the registered one"
        );
        assert!(fast.registry.get(SID).unwrap().last_used().is_some());
        assert_eq!((fast.steps(), fast.rows()), (1, 1));
        // The same position again rolls the ring back first: the same answer.
        let again = fast
            .try_step(&decode(SID, PROMPT.len(), &[42]), &payload, 1.0)
            .unwrap();
        assert_eq!(again.payload, answer.payload);
        assert!(!hop.lock.is_held(), "the lock is released after a step");
    }
}

#[test]
fn the_fast_path_declines_what_python_must_answer_and_changes_nothing() {
    let (fast, hop, _) = fast_with_session(1, 2);
    let hidden = tiny_config().hidden;
    let row = f32_bytes(&vec![0.5; hidden]);
    let clock = || hop.ring.lock().unwrap().clock();
    let before = clock();
    let declined = |head: &[u8], payload: &[u8]| fast.try_step(head, payload, 0.0).is_none();
    let entry = |extra: serde_json::Value| {
        let mut e = serde_json::json!({"session_id": SID, "start": PROMPT.len(), "tokens": [1],
                                       "kind": "decode"});
        e.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::json!({"entries": [e]}).to_string().into_bytes()
    };
    assert!(declined(b"{not json", &row));
    assert!(
        declined(&decode("B".repeat(24).as_str(), PROMPT.len(), &[1]), &row),
        "unknown"
    );
    assert!(
        declined(&decode("short", PROMPT.len(), &[1]), &row),
        "not a session id"
    );
    assert!(
        declined(&decode(SID, PROMPT.len() - 1, &[1]), &row),
        "inside the prompt"
    );
    assert!(
        declined(&decode(SID, PROMPT.len() + 1, &[1]), &row),
        "past the clock"
    );
    assert!(
        declined(&decode(SID, PROMPT.len(), &[1]), &row[4..]),
        "short payload"
    );
    let mut nan = row.clone();
    nan[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    assert!(
        declined(&decode(SID, PROMPT.len(), &[1]), &nan),
        "not finite"
    );
    assert!(declined(
        &entry(serde_json::json!({"kind": "prefill"})),
        &row
    ));
    assert!(declined(&entry(serde_json::json!({"capture": true})), &row));
    assert!(declined(
        &entry(serde_json::json!({"prompt_logprobs": 2})),
        &row
    ));
    assert!(declined(&entry(serde_json::json!({"logprobs": 21})), &row));
    assert!(declined(&entry(serde_json::json!({"surprise": 1})), &row));
    assert!(declined(&entry(serde_json::json!({"tokens": [1.5]})), &row));
    let twice = serde_json::json!({"entries": [
        {"session_id": SID, "start": PROMPT.len(), "tokens": [1], "kind": "decode"},
        {"session_id": SID, "start": PROMPT.len(), "tokens": [1], "kind": "decode"}]});
    assert!(declined(
        twice.to_string().as_bytes(),
        &f32_bytes(&vec![0.5; 2 * hidden])
    ));
    // A session busy with Python, then one closed meanwhile.
    assert!(hop.lock.try_acquire());
    assert!(declined(&decode(SID, PROMPT.len(), &[1]), &row), "busy");
    assert!(fast.registry.unregister(SID));
    hop.lock.release();
    assert!(declined(&decode(SID, PROMPT.len(), &[1]), &row), "closed");
    assert_eq!(clock(), before, "nothing ran");
    assert_eq!(fast.steps(), 0);
}

#[test]
fn a_fast_exit_step_emits_what_the_sessions_sampler_picks_from_the_same_logits() {
    let vocab = tiny_config().vocab;
    let rows = exit_rows();
    for params in [
        greedy(),
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            seed: 11,
            ..SamplingParams::default()
        },
    ] {
        let (fast, hop, mut twin) = fast_with(2, 3, Some(sampler(params.clone())), 64);
        let (mut h, mut logits) = (Vec::new(), Vec::new());
        twin.forward(
            ChunkInput::Hidden(&rows),
            SpanType::ResponseSentence,
            LogitsWanted::All,
            &mut h,
            &mut logits,
        )
        .unwrap();
        // The draft is the first row's own token, so it is accepted when greedy.
        let mut first = Vec::new();
        sampler(params.clone())
            .verify(&logits[..vocab], vocab, &[], 6, &mut first)
            .unwrap();
        let tokens = [42, first[0]];
        let mut want = Vec::new();
        sampler(params.clone())
            .verify(&logits, vocab, &tokens[1..], 6, &mut want)
            .unwrap();
        let answer = fast
            .try_step(&decode(SID, PROMPT.len(), &tokens), &f32_bytes(&rows), 1.0)
            .expect("the exit serves a decode step of a session with a sampler");
        assert_eq!(answer.status, 200);
        assert!(answer.payload.is_empty(), "the exit answers tokens only");
        let head: serde_json::Value = serde_json::from_slice(&answer.head).unwrap();
        let entry = &head["entries"][0];
        assert_eq!(entry["emitted"], serde_json::json!(want));
        assert_eq!(
            (entry["rows"].as_u64(), entry["clock"].as_u64()),
            (Some(0), Some(7))
        );
        if params.greedy {
            assert_eq!(
                want.len(),
                2,
                "the greedy draft is accepted, then the bonus"
            );
        }
        assert!(!hop.lock.is_held());
    }
}

#[test]
fn the_exit_declines_logprobs_grammars_and_long_entries_and_fails_as_python_does() {
    let rows = exit_rows();
    let row = &rows[..tiny_config().hidden];
    let clock = |hop: &HopSession| hop.ring.lock().unwrap().clock();
    // No sampler registered (a session under a grammar): Python's.
    let (fast, hop, _) = fast_with(2, 3, None, 64);
    assert!(fast
        .try_step(&decode(SID, 5, &[1]), &f32_bytes(row), 0.0)
        .is_none());
    // Log-probabilities asked: Python's.
    let (fast, hop2, _) = fast_with(2, 3, Some(sampler(greedy())), 1);
    let lp = serde_json::json!({"entries": [{"session_id": SID, "start": 5, "tokens": [1],
                                             "kind": "decode", "logprobs": 2}]});
    assert!(fast
        .try_step(lp.to_string().as_bytes(), &f32_bytes(row), 0.0)
        .is_none());
    // More rows of logits than the station's max_logits_rows: Python's 413.
    assert!(fast
        .try_step(&decode(SID, 5, &[1, 2]), &f32_bytes(&rows), 0.0)
        .is_none());
    assert_eq!((clock(&hop), clock(&hop2), fast.steps()), (5, 5, 0));
    // A sampler that fails after the pass (its penalties never saw the prompt) fails the
    // step with Python's 422 and message; the ring moved on, as Python's pass leaves it.
    let penalised = SamplingParams {
        adjust: LogitsAdjust {
            presence_penalty: 0.5,
            ..LogitsAdjust::default()
        },
        ..greedy()
    };
    let (fast, hop, _) = fast_with(2, 3, Some(sampler(penalised.clone())), 64);
    let answer = fast
        .try_step(&decode(SID, 5, &[1]), &f32_bytes(row), 0.0)
        .expect("answered");
    let mut alone = sampler(penalised);
    let message = alone.observe(5, &[1]).unwrap_err().0;
    assert_eq!(answer.status, 422);
    let head: serde_json::Value = serde_json::from_slice(&answer.head).unwrap();
    assert_eq!(head["detail"], message.as_str());
    assert_eq!((clock(&hop), fast.steps()), (6, 1));
    assert!(!hop.lock.is_held());
}

/// Answers every declined frame with status 299 and the header echoed.
struct Echo;

impl Handler for Echo {
    fn handle(&self, head: Vec<u8>, payload: Vec<u8>, _received: f64) -> Answer {
        Answer {
            status: 299,
            head,
            payload,
        }
    }
}

/// Answers every frame 200 with its header and payload echoed (a station in a chain).
struct EchoOk;

impl Handler for EchoOk {
    fn handle(&self, head: Vec<u8>, payload: Vec<u8>, _received: f64) -> Answer {
        Answer {
            status: 200,
            head,
            payload,
        }
    }
}

fn read_answer(s: &mut TcpStream) -> Option<(u16, Vec<u8>, Vec<u8>)> {
    let mut prefix = [0u8; PREFIX_BYTES];
    s.read_exact(&mut prefix).ok()?;
    assert_eq!(&prefix[..4], STREAM_MAGIC);
    let status = u16::from_le_bytes([prefix[4], prefix[5]]);
    let n_head = u32::from_le_bytes(prefix[6..10].try_into().unwrap()) as usize;
    let n_payload = u32::from_le_bytes(prefix[10..14].try_into().unwrap()) as usize;
    let mut head = vec![0; n_head];
    let mut payload = vec![0; n_payload];
    s.read_exact(&mut head).ok()?;
    s.read_exact(&mut payload).ok()?;
    Some((status, head, payload))
}

fn closed(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn the_stream_serves_fast_and_python_frames_refuses_bad_ones_and_caps_connections() {
    let (fast, hop, _) = fast_with_session(1, 2);
    let fast = Arc::new(fast);
    let stream = StepStream::bind(
        "127.0.0.1",
        0,
        limits(Some(b"tok")),
        Arc::clone(&fast),
        Box::new(Echo),
    )
    .unwrap();
    let connect = || TcpStream::connect(("127.0.0.1", stream.port())).unwrap();
    let row = f32_bytes(&vec![0.25; tiny_config().hidden]);
    let mut s = connect();
    // A decode step runs here; a prefill goes to the handler; both on one connection.
    s.write_all(&request(b"tok", &decode(SID, PROMPT.len(), &[9]), &row))
        .unwrap();
    let (status, _, payload) = read_answer(&mut s).unwrap();
    assert_eq!((status, payload.len()), (200, row.len()));
    s.write_all(&request(b"tok", b"{\"entries\":[]}", b"xy"))
        .unwrap();
    assert_eq!(
        read_answer(&mut s).unwrap(),
        (299, b"{\"entries\":[]}".to_vec(), b"xy".to_vec())
    );
    assert_eq!(hop.ring.lock().unwrap().clock(), PROMPT.len() as u64 + 1);
    // A wrong token: 401 before the body (never sent) is read, then closed.
    let mut bad = connect();
    let mut frame = request(b"tak", b"{}", &[]);
    frame[10..14].copy_from_slice(&(1u32 << 20).to_le_bytes());
    bad.write_all(&frame).unwrap();
    assert_eq!(read_answer(&mut bad).unwrap().0, 401);
    assert!(closed(&mut bad));
    // Not a frame: 400, closed.
    let mut http = connect();
    http.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert_eq!(read_answer(&mut http).unwrap().0, 400);
    assert!(closed(&mut http));
    // The cap is 2: the oldest idle connection makes room for a new one.
    let mut second = connect();
    std::thread::sleep(Duration::from_millis(50));
    let mut third = connect();
    third.write_all(&request(b"tok", b"{}", &[])).unwrap();
    assert_eq!(read_answer(&mut third).unwrap().0, 299);
    assert!(closed(&mut s), "the oldest idle connection was closed");
    second.write_all(&request(b"tok", b"{}", &[])).unwrap();
    assert_eq!(read_answer(&mut second).unwrap().0, 299);
    let seen: Vec<u16> = stream.take_observations().iter().map(|o| o.1).collect();
    assert_eq!(
        seen,
        vec![200, 401, 400],
        "the stream's own answers are observed"
    );
    stream.close();
    assert!(closed(&mut second));
}

#[test]
fn a_chain_runs_every_station_in_order_and_names_the_one_that_fails() {
    let echo = |token: &[u8]| {
        let range = LayerRange::new(tiny_weights(7), 1, 2).unwrap();
        let fast = Arc::new(FastStep::new(range, 64, 64, false));
        StepStream::bind("127.0.0.1", 0, limits(Some(token)), fast, Box::new(EchoOk)).unwrap()
    };
    let (a, b) = (echo(b"tok"), echo(b"tok"));
    let at = |s: &StepStream| ("127.0.0.1".to_owned(), s.port());
    let pool = ChainPool::new();
    let heads = vec![
        br#"{"entries":[{"n":1}]}"#.to_vec(),
        br#"{"entries":[{"n":2}]}"#.to_vec(),
    ];
    let timeout = Duration::from_secs(10);
    for _ in 0..2 {
        // Twice: the second time on the pooled connections.
        let (replies, out) = pool
            .run(
                &[at(&a), at(&b)],
                b"tok",
                &heads,
                b"xy".to_vec(),
                1,
                timeout,
            )
            .unwrap();
        assert_eq!(out, b"xy", "each station's payload is the next one's input");
        assert_eq!(replies[1].head, heads[1]);
        assert!(replies[0].sent <= replies[0].answered && replies[0].answered <= replies[1].sent);
    }
    let stop = pool
        .run(&[at(&a), at(&b)], b"tok", &heads, Vec::new(), 2, timeout)
        .unwrap_err();
    assert_eq!(stop.station, 0);
    assert!(matches!(stop.failure, HopFailure::Malformed { .. }));
    let c = echo(b"other");
    let stop = pool
        .run(&[at(&a), at(&c)], b"tok", &heads, Vec::new(), 1, timeout)
        .unwrap_err();
    assert_eq!(stop.station, 1);
    assert!(matches!(
        stop.failure,
        HopFailure::Refused { status: 401, .. }
    ));
    let gone = at(&b);
    b.close();
    drop(b);
    let stop = pool
        .run(&[at(&a), gone], b"tok", &heads, Vec::new(), 1, timeout)
        .unwrap_err();
    assert_eq!(stop.station, 1);
    assert!(matches!(
        stop.failure,
        HopFailure::NoAnswer { timeout: false, .. }
    ));
}

#[test]
fn a_prompt_piece_before_the_last_runs_fast_and_every_other_is_pythons() {
    let prompt = [&PROMPT[..], &[7, 8, 9]].concat();
    let n = PROMPT.len();
    let piece = |start: usize, tokens: &[u32], extra: serde_json::Value| {
        let mut e = serde_json::json!({"session_id": SID, "start": start, "tokens": tokens,
                                       "kind": "prefill"});
        e.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::json!({"entries": [e]}).to_string().into_bytes()
    };
    let none = serde_json::json!({});
    // A middle station (hidden rows in), the exit (no logits for a piece), the entry (ids).
    for (lo, hi) in [(1, 2), (2, 3), (0, 1)] {
        let rows: Vec<f32> = (0..3 * tiny_config().hidden)
            .map(|i| (i as f32 * 0.11).cos())
            .collect();
        let payload = |k: usize| {
            if lo == 0 {
                Vec::new()
            } else {
                f32_bytes(&rows[..k * tiny_config().hidden])
            }
        };
        let (fast, hop, mut twin) = fast_with_prompt(lo, hi, &prompt, None, 64);
        let clock = || hop.ring.lock().unwrap().clock();
        let declined = |head: &[u8], k: usize| fast.try_step(head, &payload(k), 0.0).is_none();
        // Python's: the prompt's last piece, tokens not the prompt's, not at the clock.
        assert!(declined(
            &piece(n, &[7, 8, 9], serde_json::json!({"last": true})),
            3
        ));
        assert!(
            declined(&piece(n, &[7, 8, 9], none.clone()), 3),
            "ends the prompt"
        );
        assert!(
            declined(&piece(n, &[7, 6], none.clone()), 2),
            "not the prompt"
        );
        assert!(
            declined(&piece(n - 1, &[65, 7], none.clone()), 2),
            "behind the clock"
        );
        assert!(declined(
            &piece(n, &[7, 8], serde_json::json!({"prompt_logprobs": 1})),
            2
        ));
        // A capture of the head in this piece (a prompt longer than the longest prefix).
        fast.set_max_prefix_len(6);
        assert!(declined(
            &piece(n, &[7, 8], serde_json::json!({"capture": true})),
            2
        ));
        assert_eq!((clock(), fast.steps()), (n as u64, 0));
        // A head that ends elsewhere: the piece runs here, bit-identical to the ring alone.
        fast.set_max_prefix_len(4);
        let answer = fast
            .try_step(
                &piece(n, &[7, 8], serde_json::json!({"capture": true})),
                &payload(2),
                0.0,
            )
            .expect("a piece before the last runs fast");
        let input = if lo == 0 {
            ChunkInput::Tokens(&[7, 8])
        } else {
            ChunkInput::Hidden(&rows[..2 * tiny_config().hidden])
        };
        let (mut want, mut l) = (Vec::new(), Vec::new());
        twin.forward(input, SpanType::User, LogitsWanted::None, &mut want, &mut l)
            .unwrap();
        let head: serde_json::Value = serde_json::from_slice(&answer.head).unwrap();
        let entry = &head["entries"][0];
        assert_eq!(answer.status, 200);
        assert_eq!(entry["emitted"], serde_json::json!([]));
        assert_eq!(entry["captured"], 0);
        assert_eq!(clock(), n as u64 + 2);
        if hi == 3 {
            assert!(answer.payload.is_empty(), "the exit answers no rows");
            assert_eq!(entry["rows"], 0);
        } else {
            assert_eq!(answer.payload, f32_bytes(&want), "bit-identical");
            assert_eq!(entry["rows"], 2);
        }
    }
}
