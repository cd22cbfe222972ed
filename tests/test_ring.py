"""The ring-buffer KV cache through its Python surface: geometry, spans, rollback, recall,
volume round trips, and bad input (ValueError, state unchanged)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

import amplituhedron_rs as ar

LAYERS, KV_HEADS, HEAD_DIM = 2, 3, 16
Snapshot = tuple[int, bytes, list[ar.SemanticSpan], list[bytes]]


def slab(n: int, seed: int) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """Random K and V, exact in f16 (so round trips are exact whatever the ring stores)."""
    rng = np.random.default_rng(seed)
    shape = (LAYERS, KV_HEADS, n, HEAD_DIM)
    return (
        rng.standard_normal(shape, dtype=np.float32).astype(np.float16).astype(np.float32),
        rng.standard_normal(shape, dtype=np.float32).astype(np.float16).astype(np.float32),
    )


def snapshot(ring: ar.RingBuffer) -> Snapshot:
    layers = [ring.layer_keys(i).tobytes() + ring.layer_vals(i).tobytes() for i in range(LAYERS)]
    return ring.clock, ring.active_slots().tobytes(), ring.spans(), layers


def make(kv_dtype: Literal["f16", "f32"] = "f16", **kw: int) -> ar.RingBuffer:
    defaults = {"slots": 64, "recall": 4, "n_sys": 4, "undo_capacity": 16}
    defaults.update(kw)
    return ar.RingBuffer(LAYERS, KV_HEADS, HEAD_DIM, **defaults, kv_dtype=kv_dtype)


def attention(ring: ar.RingBuffer, layer: int, seed: int) -> bytes:
    """Output of a fixed query over the ring's active slots (all positions are visible)."""
    q = np.random.default_rng(seed).standard_normal((6, HEAD_DIM), dtype=np.float32)
    out = ar.attend(q, ring.layer_keys(layer), ring.layer_vals(layer), ring.active_slots(), 3)
    return out.tobytes()


def test_geometry_and_slot_formula() -> None:
    ring = make()
    assert (ring.n_sys, ring.window_end, ring.window_len, ring.slots) == (4, 60, 56, 64)
    for clock in [0, 3, 4, 59, 60, 61, 10**12, 2**63]:
        expected = clock if clock < 4 else 4 + (clock - 4) % 56
        assert ring.physical_slot(clock) == expected
    assert ring.cache_pos(10) == 10
    assert ring.cache_pos(10**9) == 59
    default = ar.RingBuffer(30, 3, 64)
    assert (default.slots, default.window_end, default.n_sys) == (4096, 3968, 0)


def test_tiers_and_table_order() -> None:
    ring = make()
    ring.append(*slab(4, 0), span=ar.SpanType.SYSTEM)
    ring.inject_recall(*slab(2, 1))
    ring.append(*slab(30, 2), span=ar.SpanType.USER)
    ring.append(*slab(30, 3), span=ar.SpanType.THOUGHT)  # wraps: the USER span leaves whole
    active = ring.active_slots()
    assert active.dtype == np.uint32
    assert list(active[:2]) == [60, 61]  # recall
    assert list(active[2:6]) == [0, 1, 2, 3]  # anchors
    window = [ring.physical_slot(c) for c in range(34, 64)]
    assert list(active[6:]) == window
    assert list(ring.fixed_slots()) == [60, 61, 0, 1, 2, 3]
    spans = ring.spans()
    assert [s.span_type for s in spans] == [ar.SpanType.SYSTEM, ar.SpanType.THOUGHT]
    assert (spans[1].start_clock, spans[1].end_clock, spans[1].slot_count) == (34, 64, 30)
    # Anchors and recall rows are exactly what was written.
    k, _ = slab(4, 0)
    np.testing.assert_array_equal(ring.layer_keys(1)[:4], k[1].transpose(1, 0, 2))
    rk, _ = slab(2, 1)
    np.testing.assert_array_equal(ring.layer_keys(0)[60:62], rk[0].transpose(1, 0, 2))


def test_rollback_after_probe_tokens_is_bit_identical_across_a_wrap() -> None:
    ring = make()
    ring.append(*slab(4, 0), span=ar.SpanType.SYSTEM)
    ring.append(*slab(50, 1), span=ar.SpanType.USER)
    before = snapshot(ring)
    out_before = [attention(ring, layer, 7) for layer in range(LAYERS)]
    saved = ring.clock
    # 12 probe tokens: the window wraps, overwriting rows and evicting the USER span.
    for i in range(12):
        ring.append(*slab(1, 100 + i), span=ar.SpanType.THOUGHT, new_span=i == 0)
    assert ring.spans()[-1].span_type == ar.SpanType.THOUGHT
    assert snapshot(ring) != before
    ring.rollback_clock(saved)
    assert snapshot(ring) == before
    assert [attention(ring, layer, 7) for layer in range(LAYERS)] == out_before


SPAN_TYPES = [ar.SpanType.USER, ar.SpanType.THOUGHT, ar.SpanType.TOOL_CALL, ar.SpanType.TURN_END]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=12),
    prune=st.lists(st.integers(0, 30), max_size=4),
)
def test_pruning_and_eviction_never_split_a_span(lengths: list[int], prune: list[int]) -> None:
    ring = make(n_sys=2)
    ring.append(*slab(2, 0), span=ar.SpanType.SYSTEM)
    for i, n in enumerate(lengths):
        ring.append(*slab(n, i + 1), span=SPAN_TYPES[i % len(SPAN_TYPES)])
        if i < len(prune):
            evicted = ring.prune_oldest_spans(prune[i])
            assert evicted >= prune[i] or len(ring.window_slots()) == 0
        # Every visible span is whole: the window table is exactly the spans' slots.
        spans = [s for s in ring.spans() if s.start_clock >= 2]
        covered = [ring.physical_slot(c) for s in spans for c in range(s.start_clock, s.end_clock)]
        assert list(ring.window_slots()) == covered
        for s in spans:
            assert s.slot_count == s.end_clock - s.start_clock == n_of(s, lengths)


def n_of(span: ar.SemanticSpan, lengths: list[int]) -> int:
    """Length of the appended span that starts at `span.start_clock`."""
    start = 2
    for n in lengths:
        if start == span.start_clock:
            return n
        start += n
    raise AssertionError(f"no appended span starts at {span.start_clock}")


def test_read_logical_and_splice_round_trip() -> None:
    ring = make()
    ring.append(*slab(4, 0), span=ar.SpanType.SYSTEM)
    ring.append(*slab(20, 1), span=ar.SpanType.USER)
    keys, vals = ring.read_logical(24)
    assert keys.shape == (LAYERS, KV_HEADS, 24, HEAD_DIM)
    np.testing.assert_array_equal(keys[:, :, 4:], slab(20, 1)[0])
    fresh = make()
    fresh.splice(keys, vals)
    assert fresh.clock == 24
    assert snapshot(fresh)[3] == snapshot(ring)[3]
    sub_k, _ = ring.read_logical(10, layer_lo=1, layer_hi=2)
    np.testing.assert_array_equal(sub_k, keys[1:2, :, :10])


def test_f16_rings_round_once_saturate_and_read_back_exactly() -> None:
    rng = np.random.default_rng(5)
    shape = (LAYERS, KV_HEADS, 6, HEAD_DIM)
    keys = rng.standard_normal(shape, dtype=np.float32) * 3
    vals = rng.standard_normal(shape, dtype=np.float32)
    keys[0, 0, 0, :2] = [1e6, -1e6]  # beyond f16: saturated, never infinite
    half, full = make(), make("f32")
    half.splice(keys, vals)
    full.splice(keys, vals)
    k32, v32 = full.read_logical(6)
    np.testing.assert_array_equal(k32, keys)
    np.testing.assert_array_equal(v32, vals)
    k16, v16 = half.read_logical(6)
    assert k16[0, 0, 0, :2].tolist() == [65504.0, -65504.0]
    as_f16 = np.clip(keys, -65504, 65504).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(k16, as_f16)
    np.testing.assert_array_equal(v16, vals.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(half.layer_keys(0)[:6], as_f16[0].transpose(1, 0, 2))
    # Stored values are fixed points: writing them back changes no bit.
    again = make()
    again.splice(k16, v16)
    assert snapshot(again)[3] == snapshot(half)[3]


def test_an_unknown_kv_dtype_is_an_input_error() -> None:
    with pytest.raises(ar.InputError, match=r"kv_dtype must be 'f16' or 'f32', got \"bf16\""):
        ar.RingBuffer(LAYERS, KV_HEADS, HEAD_DIM, kv_dtype="bf16")  # type: ignore[arg-type]


def test_splice_reports_first_non_finite_position_and_changes_nothing() -> None:
    ring = make()
    keys, vals = slab(10, 0)
    keys[1, 2, 7, 3] = np.nan
    vals[0, 0, 5, 0] = np.inf
    before = snapshot(ring)
    with pytest.raises(ValueError, match="non-finite value at logical position 5"):
        ring.splice(keys, vals)
    assert snapshot(ring) == before
    ring.splice(keys, vals, checked=False)  # the caller's choice: no scan
    assert ring.clock == 10


BadCase = Callable[[ar.RingBuffer], object]
IN, RG = ar.InputError, ar.RingError


def _bad_cases() -> list[tuple[str, BadCase, type[Exception], str]]:
    k, v = slab(3, 9)
    return [
        ("dtype", lambda r: r.append(k.astype(np.float64), v), IN, "dtype float32"),
        ("ndim", lambda r: r.append(k[0], v[0]), IN, "4 dimensions"),
        ("layers", lambda r: r.append(k[:1], v[:1]), IN, "keys must have shape"),
        ("vals_shape", lambda r: r.append(k, v[:, :, :2]), IN, "vals must have shape"),
        ("not_array", lambda r: r.append(k.tolist(), v), IN, "keys must be a numpy array"),
        ("span_too_long", lambda r: r.append(*slab(57, 1)), RG, "longer than the window"),
        ("future", lambda r: r.rollback_clock(r.clock + 1), RG, "after the current clock"),
        ("negative", lambda r: r.rollback_clock(-1), IN, "non-negative"),
        ("beyond_journal", lambda r: r.rollback_clock(0), RG, "history reaches back only"),
        ("recall_overflow", lambda r: r.inject_recall(*slab(5, 2)), RG, "recall overflow"),
        ("recall_dtype", lambda r: r.inject_recall(k.astype(np.float16), v), IN, "dtype float32"),
        ("overwritten", lambda r: r.read_logical(10), RG, "overwritten"),
        ("unwritten", lambda r: r.read_logical(r.clock + 1), RG, "has not been written"),
        ("layer", lambda r: r.layer_keys(2), IN, "layer 2 out of range"),
        ("prune_negative", lambda r: r.prune_oldest_spans(-3), IN, "non-negative"),
    ]


@pytest.mark.parametrize(
    ("name", "call", "error", "message"), _bad_cases(), ids=[c[0] for c in _bad_cases()]
)
def test_refusals_raise_their_type_and_change_nothing(
    name: str, call: BadCase, error: type[Exception], message: str
) -> None:
    """Bad arguments raise InputError (still a ValueError); valid arguments the ring's state
    refuses raise RingError (not a ValueError)."""
    ring = make(undo_capacity=2)
    ring.append(*slab(4, 0), span=ar.SpanType.SYSTEM)
    ring.append(*slab(50, 1), span=ar.SpanType.USER)
    ring.append(*slab(20, 2), span=ar.SpanType.THOUGHT)  # wrapped: 14 overwrites, journal 2
    before = snapshot(ring)
    with pytest.raises(ar.AmplituhedronError, match=message) as raised:
        call(ring)
    assert type(raised.value) is error
    assert isinstance(raised.value, ValueError) == (error is ar.InputError)
    assert snapshot(ring) == before


def test_extending_without_an_open_span_is_an_error() -> None:
    ring = make(n_sys=0)
    with pytest.raises(ar.RingError, match="no open span"):
        ring.append(*slab(1, 0), new_span=False)
    assert ring.clock == 0
    ring.append(*slab(3, 0))
    ring.prune_oldest_spans(1)
    with pytest.raises(ar.RingError, match="no open span"):
        ring.append(*slab(1, 0), new_span=False)


def test_invalid_config_is_an_input_error() -> None:
    with pytest.raises(ar.InputError, match="n_sys = 60 must be below window_end"):
        ar.RingBuffer(1, 1, 8, slots=64, recall=4, n_sys=60)
    with pytest.raises(ar.InputError, match="max_chunk"):
        ar.RingBuffer(1, 1, 8, slots=64, recall=4, max_chunk=100)
