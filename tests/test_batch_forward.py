"""The batched station step of the core (``_core.BatchForward``) on the real model: many
sessions in one pass equal each session run alone, bit for bit, at the entry, a middle and
the exit range; refusals change no ring. And ``Sampler.verify``, the exit station's draft
verification."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from amplituhedron_rs import InputError, Model, _core
from amplituhedron_rs.mesh.station.memory import process_rss

pytestmark = pytest.mark.model

SPLIT = (0, 12, 30)  # entry 0:12, exit 12:30


def _session(model: Model, lo: int, hi: int) -> _core.RangeSession:
    return model.new_session(lo, hi)


def test_a_batched_step_equals_each_session_alone(model: Model) -> None:
    prompts = [[1, 504, 3458, 282, 4195, 314, 9581], [1, 7306], [1, 38, 52, 2743, 418, 28, 88, 19]]
    decode = [[28], [16], [901]]
    lo, mid, hi = SPLIT
    # Alone: each prompt, then one decode row, through entry then exit.
    alone: list[list[Any]] = []
    for p, d in zip(prompts, decode, strict=True):
        e, x = _session(model, lo, mid), _session(model, mid, hi)
        h1, _ = e.forward_tokens(p, logits="none")
        h2, l2 = x.forward_hidden(h1, logits="all")
        h3, _ = e.forward_tokens(d, logits="none", span=_core.SpanType.RESPONSE_SENTENCE)
        h4, l4 = x.forward_hidden(h3, logits="last", span=_core.SpanType.RESPONSE_SENTENCE)
        alone.append([h1, h2, l2, h3, h4, l4])
    entry = _core.BatchForward(model.weights, lo, mid)
    exit_ = _core.BatchForward(model.weights, mid, hi)
    assert entry.layer_range == (lo, mid)
    es = [_session(model, lo, mid) for _ in prompts]
    xs = [_session(model, mid, hi) for _ in prompts]
    n = len(prompts)
    step1 = entry.run(es, prompts, ["none"] * n)
    step2 = exit_.run(xs, [h for h, _ in step1], ["all"] * n)
    spans = [_core.SpanType.RESPONSE_SENTENCE] * n
    step3 = entry.run(es, decode, ["none"] * n, spans)
    step4 = exit_.run(xs, [h for h, _ in step3], ["last"] * n, spans)
    for i in range(n):
        got = [step1[i][0], step2[i][0], step2[i][1], step3[i][0], step4[i][0], step4[i][1]]
        for a, b in zip(got, alone[i], strict=True):
            assert a is not None and b is not None
            assert a.shape == b.shape and a.tobytes() == b.tobytes(), f"session {i} differs"
        assert step1[i][1] is None
        assert xs[i].clock == es[i].clock == len(prompts[i]) + 1


def test_refusals_change_no_ring(model: Model) -> None:
    lo, mid, hi = SPLIT
    entry = _core.BatchForward(model.weights, lo, mid)
    a, b = _session(model, lo, mid), _session(model, lo, mid)
    entry.run([a], [[1, 2, 3]], ["none"])
    assert a.clock == 3
    cases: list[tuple[list[Any], list[Any], list[Any], str]] = [
        ([a, a], [[5], [6]], ["none", "none"], "twice"),
        ([a, b], [[5]], ["none", "none"], "as many"),
        ([a, b], [[5], [10**7]], ["none", "none"], "vocabulary"),
        ([a, b], [[5], []], ["none", "none"], "no tokens"),
        ([a, b], [[5], [6]], ["none", "sometimes"], "logits"),
        ([a, _session(model, mid, hi)], [[5], [6]], ["none", "none"], "layers"),
        ([a], [np.zeros((1, int(model.weights.hidden)), np.float32)], ["none"], "token ids"),
    ]
    for sessions, inputs, logits, words in cases:
        with pytest.raises(InputError, match=words):
            entry.run(sessions, inputs, logits)
        assert (a.clock, b.clock) == (3, 0), words
    exit_ = _core.BatchForward(model.weights, mid, hi)
    x = _session(model, mid, hi)
    with pytest.raises(InputError, match="columns"):
        exit_.run([x], [np.zeros((1, 7), np.float32)], ["last"])
    assert x.clock == 0
    # Other weights (even of the same file) are another mapping: refused.
    other = Model(model.file)
    with pytest.raises(InputError, match="other weights"):
        entry.run([other.new_session(lo, mid)], [[1]], ["none"])


def test_verify_emits_accepted_drafts_then_the_models_token() -> None:
    vocab = 6
    rows = np.full((3, vocab), -5.0, np.float32)
    rows[0, 2] = rows[1, 4] = rows[2, 1] = 5.0  # argmax 2, then 4, then 1
    greedy = _core.Sampler()
    assert greedy.verify(rows, [2, 4], 10) == [2, 4, 1]  # both accepted, then the bonus
    assert greedy.verify(rows, [2, 3], 10) == [2, 4]  # the correction at the first rejection
    assert greedy.verify(rows[:1], [], 10) == [2]  # no drafts: plain decoding
    with pytest.raises(InputError):
        greedy.verify(rows, [2], 10)  # 3 rows for 1 draft
    # Sampled: position-keyed, so the same call gives the same tokens.
    sampled = _core.Sampler(greedy=False, temperature=0.8, seed=7)
    first = sampled.verify(rows, [2, 4], 3)
    assert sampled.verify(rows, [2, 4], 3) == first
    assert 1 <= len(first) <= 3


def _drain(engine: _core.Engine) -> dict[int, tuple[list[int], list[bytes]]]:
    out: dict[int, tuple[list[int], list[bytes]]] = {}
    while engine.has_work:
        for ev in engine.step():
            tokens, logits = out.setdefault(ev.seq, ([], []))
            if ev.kind == "token":
                assert ev.token is not None and ev.logits is not None
                tokens.append(ev.token)
                logits.append(ev.logits.tobytes())
    return out


@pytest.mark.parametrize("which", ["model", "model_f32", "gemma"])
def test_requests_sharing_a_system_prompt_equal_each_alone(
    which: str, request: pytest.FixtureRequest
) -> None:
    """Batched, requests with one long system prompt read its K/V from the first one's ring
    (SmolLM2 with f16 and f32 KV; Gemma 3, with sliding layers too); every token and logits
    row equals the request run alone (cache off), whether the batch replays the system
    prompt from the cache or computes it."""
    m: Model = request.getfixturevalue(which)
    system = " ".join(["The archive keeps every letter the lighthouse keepers wrote."] * 12)
    prompts = [m.chat_ids(system, f"Question {i}: what did keeper {i} write?") for i in range(5)]
    assert min(len(p) for p in prompts) > 140
    sampling: list[dict[str, Any]] = [
        {} if i % 2 == 0 else {"greedy": False, "temperature": 0.8, "top_p": 0.9, "seed": i}
        for i in range(5)
    ]
    engine = m.engine
    alone = []
    for p, kw in zip(prompts, sampling, strict=True):
        seq = engine.submit(p, 6, use_cache=False, want_logits=True, **kw)
        alone.append(_drain(engine)[seq])
    for use_cache in (False, True):
        seqs = [
            engine.submit(p, 6, use_cache=use_cache, want_logits=True, **kw)
            for p, kw in zip(prompts, sampling, strict=True)
        ]
        together = _drain(engine)
        for i, seq in enumerate(seqs):
            assert together[seq] == alone[i], f"request {i} (cache {'on' if use_cache else 'off'})"


def _rss() -> int:
    rss = process_rss()
    assert rss is not None, "no /proc/self/status here"
    return rss


def test_released_step_buffers_leave_the_resident_set_and_change_no_result(
    model: Model,
) -> None:
    # A 256-row step at the exit range with every row's logits grows the step buffers by
    # 256 x 49,152 floats (48 MiB) of logits alone; an idle station releases them.
    _, mid, hi = SPLIT
    exit_ = _core.BatchForward(model.weights, mid, hi)
    rows = np.random.default_rng(0).standard_normal((256, int(model.weights.hidden)))
    hidden = rows.astype(np.float32) * 0.1
    first = exit_.run([_session(model, mid, hi)], [hidden], ["all"])
    logits = first[0][1]
    assert logits is not None
    del first
    grown = _rss()
    assert exit_.release_buffers() is True
    released = _rss()
    assert grown - released > 40 * 2**20, (grown, released)
    # The next step grows them again and computes the same bits.
    again = exit_.run([_session(model, mid, hi)], [hidden], ["all"])
    assert again[0][1] is not None and again[0][1].tobytes() == logits.tobytes()
