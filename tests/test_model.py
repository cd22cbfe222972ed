"""The runtime on the real SmolLM2-135M-Instruct GGUF.

Parity against independent implementations (tests/refdata: HF transformers and llama.cpp on
the same file), and the bit-exact invariants: cache-on = cache-off, chunked = unchunked,
probe + rollback = no probe, split ranges = one range.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from typing import Any, Literal

import numpy as np
import pytest

import amplituhedron_rs as ar
from amplituhedron_rs import InputError, Model, SessionOptions, _core
from amplituhedron_rs.runtime.tokenizer import StreamDecoder

pytestmark = pytest.mark.model

PROMPT_NAMES = ["sentence", "rust", "json", "chat", "multilingual", "long"]
CONFIDENT = 0.3  # reference top-2 margin above which both implementations must agree
LOGIT_TOLERANCE = 1.0  # max |Δlogit| vs transformers (llama.cpp itself is 0.40–0.75 away)


# --- tokenizer and template ------------------------------------------------------------


@pytest.mark.parametrize("name", PROMPT_NAMES)
def test_tokenization_equals_reference(model: Model, prompts: dict[str, Any], name: str) -> None:
    p = prompts[name]
    ids = model.tokenize(p["text"])
    assert ids == p["token_ids"]
    assert model.detokenize(ids) == p["text"]


def test_chat_template_reproduces_reference_prompt(model: Model, prompts: dict[str, Any]) -> None:
    text = prompts["chat"]["text"]
    system = text.split("<|im_start|>system\n")[1].split("<|im_end|>")[0]
    user = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    assert model.chat_ids(system, user) == prompts["chat"]["token_ids"]


# --- parity with transformers ----------------------------------------------------------


@pytest.mark.parametrize("name", PROMPT_NAMES)
def test_argmax_agrees_at_every_confident_position(
    model: Model, prompts: dict[str, Any], name: str
) -> None:
    p = prompts[name]
    logits = model.logits_all(p["token_ids"])
    assert logits.shape == (p["n_tokens"], model.vocab_size)
    ours = logits.argmax(axis=1)
    checked = 0
    for pos, (ref, margin) in enumerate(
        zip(p["hf_argmax_per_position"], p["hf_top2_margin_per_position"], strict=True)
    ):
        if margin >= CONFIDENT:
            assert ours[pos] == ref, f"position {pos}: {ours[pos]} vs {ref} (margin {margin})"
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("name", PROMPT_NAMES)
def test_last_logits_within_tolerance_of_transformers(
    model: Model,
    prompts: dict[str, Any],
    hf_last_logits: dict[str, np.ndarray[Any, np.dtype[np.float32]]],
    name: str,
) -> None:
    ours = model.logits(prompts[name]["token_ids"])
    diff = np.abs(ours.astype(np.float64) - hf_last_logits[name])
    assert diff.max() <= LOGIT_TOLERANCE, f"max |Δ| = {diff.max():.3f}, mean {diff.mean():.3f}"
    assert int(ours.argmax()) == prompts[name]["hf_top5_ids"][0]


@pytest.mark.parametrize("name", PROMPT_NAMES)
def test_greedy_continuation_matches_until_the_first_near_tie(
    model: Model, prompts: dict[str, Any], name: str
) -> None:
    p = prompts[name]
    margins = p["hf_greedy16_top2_margins"]
    clear = next((i for i, m in enumerate(margins) if m < CONFIDENT), len(margins))
    g = model.generate(p["token_ids"], 16, use_cache=False, stop_at_eos=False)
    assert g.output_ids[:clear] == p["hf_greedy16_ids"][:clear]


# --- bit-exact invariants ----------------------------------------------------------------


def test_cache_on_equals_cache_off(any_kv_model: Model, prompts: dict[str, Any]) -> None:
    model = any_kv_model
    ids = prompts["chat"]["token_ids"]
    model.clear_cache()
    cold = model.generate(ids, 12, use_cache=False, stop_at_eos=False)
    first = model.generate(ids, 12, stop_at_eos=False)
    warm = model.generate(ids, 12, stop_at_eos=False)
    assert not first.cache_hit
    assert warm.cache_hit and warm.replayed_tokens == len(ids)
    assert cold.output_ids == first.output_ids == warm.output_ids
    # The cached logits are the cold run's logits, bit for bit.
    session = model.new_session(0, model.n_layers)
    replay = model.pipeline.amplituhedron_replay(session, ids)
    assert replay is not None and replay.status == "hit" and replay.logits is not None
    np.testing.assert_array_equal(replay.logits, model.logits(ids))
    # … and decoding after a replay continues exactly as after a prefill.
    cold_session = model.new_session(0, model.n_layers)
    cold_session.forward_tokens(ids)
    _, a = cold_session.forward_tokens([cold.output_ids[0]])
    _, b = session.forward_tokens([cold.output_ids[0]])
    assert a is not None and b is not None
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_whole_prompt(
    any_kv_model: Model, prompts: dict[str, Any], chunk: int
) -> None:
    model = any_kv_model
    ids = prompts["chat"]["token_ids"]
    whole = model.new_session(0, model.n_layers, SessionOptions(max_chunk=256))
    chunked = model.new_session(0, model.n_layers, SessionOptions(max_chunk=chunk))
    _, a = whole.forward_tokens(ids, logits="all")
    _, b = chunked.forward_tokens(ids, logits="all")
    assert a is not None and b is not None
    np.testing.assert_array_equal(a, b)


def test_kv_storage_types_are_told_apart_and_agree_closely(
    model: Model, model_f32: Model, prompts: dict[str, Any]
) -> None:
    assert (model.weights.kv_dtype, model_f32.weights.kv_dtype) == ("f16", "f32")
    # The storage type changes every later position's attention, so it is part of the
    # fingerprint: volumes (and cache directories) of one never serve the other.
    assert model.fingerprint != model_f32.fingerprint
    ids = prompts["long"]["token_ids"]
    half, full = model.logits(ids), model_f32.logits(ids)
    assert not np.array_equal(half, full), "the f16 model did not round its KV"
    assert float(np.abs(half - full).max()) < 0.25
    assert int(np.argmax(half)) == int(np.argmax(full))


def test_an_f16_session_captures_its_kv_as_f16_at_half_the_bytes(
    model: Model, model_f32: Model, prompts: dict[str, Any]
) -> None:
    # An f16 session's volume keeps the ring's own bit patterns (2 bytes a value, replayed
    # as a copy); an f32 session's keeps f32. Tail, logits and ids stay 4 bytes either way.
    ids = prompts["sentence"]["token_ids"]
    w = model.weights
    kv_values = 2 * w.n_layers * w.n_kv_heads * len(ids) * w.head_dim
    nbytes = {}
    for m in (model, model_f32):
        m.clear_cache()
        session = m.new_session(0, m.n_layers)
        hidden, logits = session.forward_tokens(ids)
        assert logits is not None
        nbytes[m.weights.kv_dtype] = m.pipeline.amplituhedron_capture(
            session, ids, hidden[-1], logits[-1]
        )
        assert m.cache_stats()["bytes"] == nbytes[m.weights.kv_dtype]
        m.clear_cache()
    rest = 4 * (w.hidden + w.vocab + len(ids))
    assert nbytes == {"f16": 2 * kv_values + rest, "f32": 4 * kv_values + rest}


def test_probe_then_rollback_gives_identical_next_logits(
    model: Model, prompts: dict[str, Any]
) -> None:
    ids = prompts["sentence"]["token_ids"]
    probed = model.new_session(0, model.n_layers)
    plain = model.new_session(0, model.n_layers)
    probed.forward_tokens(ids)
    plain.forward_tokens(ids)
    saved = probed.clock
    probed.forward_tokens([1, 2, 3, 4, 5], span=ar.SpanType.THOUGHT)
    probed.rollback(saved)
    assert probed.clock == saved
    _, a = probed.forward_tokens([416])
    _, b = plain.forward_tokens([416])
    assert a is not None and b is not None
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cuts", [[0, 15, 30], [0, 10, 20, 30], [0, 1, 29, 30]])
def test_split_ranges_equal_one_process(
    model: Model, prompts: dict[str, Any], cuts: list[int]
) -> None:
    ids = prompts["json"]["token_ids"]
    hidden: np.ndarray[Any, np.dtype[np.float32]] | None = None
    logits = None
    for lo, hi in itertools.pairwise(cuts):
        s = model.new_session(lo, hi)
        want: Literal["all", "none"] = "all" if hi == model.n_layers else "none"
        if lo == 0:
            hidden, logits = s.forward_tokens(ids, logits=want)
        else:
            assert hidden is not None
            hidden, logits = s.forward_hidden(hidden, logits=want)
    assert logits is not None
    np.testing.assert_array_equal(logits, model.logits_all(ids))


# --- sampling and generation -------------------------------------------------------------


def test_seeded_sampling_is_reproducible(model: Model, prompts: dict[str, Any]) -> None:
    ids = prompts["sentence"]["token_ids"]
    kw: dict[str, Any] = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "stop_at_eos": False}
    a = model.generate(ids, 12, seed=7, use_cache=False, **kw)
    b = model.generate(ids, 12, seed=7, **kw)
    c = model.generate(ids, 12, seed=7, **kw)  # a cache hit: same tokens
    d = model.generate(ids, 12, seed=8, use_cache=False, **kw)
    assert a.output_ids == b.output_ids == c.output_ids
    assert c.cache_hit
    assert a.output_ids != d.output_ids


def test_logprobs_are_those_of_the_rows_the_tokens_come_from(
    model: Model, prompts: dict[str, Any]
) -> None:
    """Each output token's log-probability and alternatives, from the logits row it was
    picked from: equal to the same values computed from a whole-sequence forward pass, with
    and without speculation or the cache; sampled tokens report the model's distribution."""
    ids = prompts["json"]["token_ids"]
    plain = model.generate(ids, 10, use_cache=False, stop_at_eos=False, logprobs=4)
    assert plain.logprobs is not None and len(plain.logprobs) == 10
    rows = model.logits_all(ids + plain.output_ids[:-1])[len(ids) - 1 :]
    for lp, row, token in zip(plain.logprobs, rows, plain.output_ids, strict=True):
        shifted = row.astype(np.float64) - row.max()
        reference = shifted - np.log(np.exp(shifted).sum())
        assert lp.token == token and len(lp.top) == 4
        assert lp.logprob == pytest.approx(reference[token], abs=1e-5)
        assert lp.top[0] == (token, lp.logprob), "greedy takes the likeliest token"
        assert [t for t, _ in lp.top] == list(np.argsort(-row, kind="stable")[:4])
    kw: dict[str, Any] = {"stop_at_eos": False, "logprobs": 4}
    spec = model.generate(ids, 10, use_cache=False, draft="prompt-lookup", **kw)
    model.generate(ids, 10, **kw)
    cached = model.generate(ids, 10, **kw)
    assert cached.cache_hit
    for other in (spec, cached):
        assert other.logprobs is not None
        assert [(t.token, t.logprob, t.top) for t in other.logprobs] == [
            (t.token, t.logprob, t.top) for t in plain.logprobs
        ]
    sampled = model.generate(ids, 6, temperature=1.5, seed=3, logprobs=0, stop_at_eos=False)
    assert sampled.logprobs is not None
    assert [t.token for t in sampled.logprobs] == sampled.output_ids
    assert all(t.top == [] and t.logprob <= 0 for t in sampled.logprobs)
    assert model.generate(ids, 2).logprobs is None


def test_prompt_logprobs_score_every_prompt_token(model: Model, prompts: dict[str, Any]) -> None:
    """Each prompt token after the first, scored by the logits row before it: the values of
    a whole-sequence forward pass, whether or not the prompt is cached (it is then computed,
    not replayed), with or without output tokens; the output is unchanged."""
    ids = prompts["json"]["token_ids"]
    rows = model.logits_all(ids)
    expected = [(t, _core.token_logprobs(row, t, 3)) for row, t in zip(rows, ids[1:], strict=False)]

    def flat(entries: list[_core.TokenLogprobs] | None) -> list[tuple[Any, ...]]:
        assert entries is not None
        return [(e.token, e.logprob, e.top) for e in entries]

    reference = flat([e for _, e in expected])
    assert [t for t, _ in expected] == ids[1:]
    plain = model.generate(ids, 4, stop_at_eos=False)
    assert plain.prompt_logprobs is None
    for use_cache in (False, True, True):
        g = model.generate(ids, 4, stop_at_eos=False, use_cache=use_cache, prompt_logprobs=3)
        assert flat(g.prompt_logprobs) == reference
        assert g.output_ids == plain.output_ids
        assert g.replayed_tokens == 0 and not g.cache_hit
    scored = model.generate(ids, 0, prompt_logprobs=0)
    assert scored.output_ids == [] and scored.prompt_logprobs is not None
    assert [(e.token, e.logprob) for e in scored.prompt_logprobs] == [r[:2] for r in reference]
    assert all(e.top == [] for e in scored.prompt_logprobs)
    with pytest.raises(InputError, match="prompt_logprobs"):
        model.generate(ids, 2, prompt_logprobs=21)


def test_generation_stops_at_a_stop_id(model: Model, prompts: dict[str, Any]) -> None:
    ids = prompts["sentence"]["token_ids"]
    first = prompts["sentence"]["hf_greedy16_ids"][0]
    g = model.generate(ids, 16, stop_ids=[first])
    assert g.output_ids == [first]
    assert g.stop_reason == "stop"


def test_streaming_yields_the_generated_text(model: Model, prompts: dict[str, Any]) -> None:
    pieces: list[str] = []
    g = model.generate(prompts["rust"]["token_ids"], 10, stream=pieces.append, stop_at_eos=False)
    assert "".join(pieces) == g.text == model.tokenizer.decode(g.output_ids, skip_special=True)


def test_bad_input_is_refused_and_changes_nothing(model: Model) -> None:
    before = model.cache_stats()
    with pytest.raises(ValueError, match="empty"):
        model.generate([], 4)
    with pytest.raises(ValueError, match="vocabulary"):
        model.generate([1, 2, model.vocab_size], 4)
    with pytest.raises(ar.InputError, match="temperature"):
        model.generate([1, 2], 4, temperature=-1.0)
    for logprobs in (-1, 21):
        with pytest.raises(ar.InputError, match="logprobs"):
            model.generate([1, 2], 4, logprobs=logprobs)
    s = model.new_session(0, model.n_layers)
    with pytest.raises(ValueError, match="token ids"):
        s.forward_hidden(np.zeros((1, 576), dtype=np.float32))
    assert s.clock == 0
    mid = model.new_session(5, 10)
    bad = np.zeros((2, 576), dtype=np.float32)
    bad[1, 3] = np.inf
    with pytest.raises(ValueError, match="not finite"):
        mid.forward_hidden(bad)
    assert mid.clock == 0
    with pytest.raises(ValueError, match="slots"):
        model.new_session(0, model.n_layers, SessionOptions(slots=9000))
    assert model.cache_stats() == before


def test_cli_generate_json(model_path: Any) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "amplituhedron_rs.cli",
            "generate",
            "--prompt-ids",
            "12615,36411,418,582",
            "--max-tokens",
            "3",
            "--json",
            "--repeat",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    runs = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(runs) == 2
    for r in runs:
        assert set(r) >= {"prompt_ids", "output_ids", "text", "prefill_ms", "decode_ms", "cache"}
        assert r["prompt_ids"] == [12615, 36411, 418, 582] and len(r["output_ids"]) == 3
    assert runs[0]["output_ids"] == runs[1]["output_ids"]
    assert runs[1]["cache_hit"] and runs[1]["cache"]["hits"] == 1


def test_a_new_question_under_a_cached_system_prompt_prefills_only_itself(
    model: Model, prompts: dict[str, Any]
) -> None:
    """Longest-prefix replay: the shared system turn comes from the cache, bit-exactly."""
    system = prompts["long"]["text"][:600]
    first = model.chat_ids(system, "What does the keeper do every evening?")
    second = model.chat_ids(system, "Why is the lens polished?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 16
    model.clear_cache()
    cold = model.generate(second, 8, use_cache=False, stop_at_eos=False)
    model.generate(first, 2, stop_at_eos=False)  # captures the first chat
    warm = model.generate(second, 8, stop_at_eos=False)
    assert not warm.cache_hit and warm.replayed_tokens == shared
    assert warm.output_ids == cold.output_ids
    assert model.cache_stats()["prefix_hits"] == 1


@pytest.mark.parametrize("name", ["multilingual", "rust", "long"])
def test_streaming_is_incremental_and_exact(
    model: Model, prompts: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pushing ids one by one gives exactly the full decode, and each push decodes only a
    few recent ids (never the whole stream)."""
    ids = model.tokenize(prompts[name]["text"])
    tokenizer = model.tokenizer
    decode = tokenizer.decode
    widths: list[int] = []

    def spy(window: Any, *, skip_special: bool = False) -> str:
        window = list(window)
        widths.append(len(window))
        return decode(window, skip_special=skip_special)

    decoder = StreamDecoder(tokenizer)
    with monkeypatch.context() as patch:
        patch.setattr(tokenizer, "decode", spy)
        pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special=True)
    assert len(ids) > 20 and max(widths) <= 8


def test_the_pipeline_reports_what_its_cache_refuses_as_a_cache_error(
    model: Model, prompts: dict[str, Any]
) -> None:
    ids = prompts["sentence"]["token_ids"]
    model.clear_cache()  # a volume already present would be declined before any check
    session = model.new_session(0, model.n_layers)
    hidden, logits = session.forward_tokens(ids)
    assert logits is not None
    tail = hidden[-1].copy()
    tail[3] = np.nan
    before = model.cache_stats()
    with pytest.raises(ar.CacheError, match="non-finite"):
        model.pipeline.amplituhedron_capture(session, ids, tail, logits[-1])
    assert model.cache_stats() == before
    with pytest.raises(ar.RingError, match="after the current clock"):
        session.rollback(session.clock + 1)
