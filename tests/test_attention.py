"""Attention over active slots against a numpy reference, and its input validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

import amplituhedron_rs as ar


def reference(
    q: NDArray[np.float32],
    keys: NDArray[np.float32],
    vals: NDArray[np.float32],
    slots: NDArray[np.uint32],
    n_kv_heads: int,
) -> NDArray[np.float64]:
    """Plain float64 softmax attention with grouped KV heads."""
    n_q_heads, head_dim = q.shape
    group = n_q_heads // n_kv_heads
    k = keys[slots].astype(np.float64)  # (n, kv_heads, head_dim)
    v = vals[slots].astype(np.float64)
    out = np.empty((n_q_heads, head_dim))
    for h in range(n_q_heads):
        g = h // group
        scores = k[:, g, :] @ q[h].astype(np.float64) / np.sqrt(head_dim)
        p = np.exp(scores - scores.max())
        out[h] = (p[:, None] * v[:, g, :]).sum(axis=0) / p.sum()
    return out


@settings(max_examples=60, deadline=None)
@given(
    n_kv_heads=st.integers(1, 4),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([1, 8, 16, 17, 64, 80]),
    slots=st.integers(1, 300),
    active_fraction=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_numpy_reference(
    n_kv_heads: int, group: int, head_dim: int, slots: int, active_fraction: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    n_q_heads = n_kv_heads * group
    q = rng.standard_normal((n_q_heads, head_dim), dtype=np.float32)
    keys = rng.standard_normal((slots, n_kv_heads, head_dim), dtype=np.float32)
    vals = rng.standard_normal((slots, n_kv_heads, head_dim), dtype=np.float32)
    active = max(1, int(slots * active_fraction))
    table = rng.permutation(slots)[:active].astype(np.uint32)
    got = ar.attend(q, keys, vals, table, n_kv_heads)
    assert got.dtype == np.float32
    assert got.shape == (n_q_heads, head_dim)
    np.testing.assert_allclose(got, reference(q, keys, vals, table, n_kv_heads), rtol=0, atol=1e-5)


def test_slot_order_only_changes_rounding() -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((9, 64), dtype=np.float32)
    keys = rng.standard_normal((512, 3, 64), dtype=np.float32)
    vals = rng.standard_normal((512, 3, 64), dtype=np.float32)
    table = rng.permutation(512).astype(np.uint32)
    a = ar.attend(q, keys, vals, table, 3)
    b = ar.attend(q, keys, vals, table[::-1].copy(), 3)
    np.testing.assert_allclose(a, b, atol=1e-6)
    # Same table, same bits: the kernel is deterministic.
    assert ar.attend(q, keys, vals, table, 3).tobytes() == a.tobytes()


def test_accepts_lists_and_non_contiguous_arrays() -> None:
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, 32), dtype=np.float32)[:, ::2]  # non-contiguous (4, 16)
    keys = rng.standard_normal((10, 2, 16), dtype=np.float32)
    vals = rng.standard_normal((10, 2, 16), dtype=np.float32)
    got = ar.attend(q, keys, vals, [3, 1, 4], 2)
    expected = reference(np.ascontiguousarray(q), keys, vals, np.array([3, 1, 4], np.uint32), 2)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def _good() -> tuple[
    NDArray[np.float32], NDArray[np.float32], NDArray[np.float32], NDArray[np.uint32]
]:
    rng = np.random.default_rng(3)
    q = rng.standard_normal((6, 8), dtype=np.float32)
    keys = rng.standard_normal((5, 3, 8), dtype=np.float32)
    vals = rng.standard_normal((5, 3, 8), dtype=np.float32)
    return q, keys, vals, np.array([0, 4, 2], np.uint32)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("q_float64", "q must have dtype float32"),
        ("q_1d", "q must have 2 dimensions"),
        ("keys_not_array", "keys must be a numpy array"),
        ("kv_heads_mismatch", "keys must have shape"),
        ("vals_shape", "vals must have shape"),
        ("slot_too_big", "slot 5 out of range: the ring has 5 slots"),
        ("slot_negative", "slot -1 out of range"),
        ("slots_not_ints", "active_slots must be a 1-D sequence of integers"),
        ("no_slots", "no keys to attend to"),
        ("heads_not_divisible", "n_kv_heads dividing n_q_heads"),
    ],
)
def test_bad_input_raises_value_error(case: str, message: str) -> None:
    q, keys, vals, table = _good()
    n_kv: int = 3
    slots: object = table
    q_arg: object = q
    keys_arg: object = keys
    vals_arg: object = vals
    if case == "q_float64":
        q_arg = q.astype(np.float64)
    elif case == "q_1d":
        q_arg = q.ravel()
    elif case == "keys_not_array":
        keys_arg = keys.tolist()
    elif case == "kv_heads_mismatch":
        n_kv = 2
    elif case == "vals_shape":
        vals_arg = vals[:4]
    elif case == "slot_too_big":
        slots = np.array([0, 5], np.uint32)
    elif case == "slot_negative":
        slots = [0, -1]
    elif case == "slots_not_ints":
        slots = np.array([0.5, 1.0])
    elif case == "no_slots":
        slots = np.array([], np.uint32)
    elif case == "heads_not_divisible":
        q_arg = q[:5]
    with pytest.raises(ValueError, match=message):
        ar.attend(q_arg, keys_arg, vals_arg, slots, n_kv)  # type: ignore[arg-type]
