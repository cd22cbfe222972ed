"""MatVecMemo through the Python surface: off by default, exact match, bounds, policies."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amplituhedron_rs import _core

KEY_BYTES = 41  # encoded memo key: tag + weight id + BLAKE3 digest


def vec(*values: float) -> np.ndarray[Any, np.dtype[np.float32]]:
    return np.array(values, dtype=np.float32)


def enabled(**kwargs: Any) -> _core.MatVecMemo:
    memo = _core.MatVecMemo(**kwargs)
    memo.enable(True)
    return memo


def test_off_by_default_and_inert_while_off() -> None:
    memo = _core.MatVecMemo()
    assert not memo.enabled and memo.policy == "pisot"
    assert memo.insert(1, vec(1.0), vec(2.0)) == 0
    assert memo.get(1, vec(1.0)) is None
    assert memo.stats() == {"hits": 0, "misses": 0, "evictions": 0, "entries": 0, "bytes": 0}


def test_exact_match_round_trip() -> None:
    memo = enabled()
    x, y = vec(0.5, -1.0, 3.25), vec(1.0, 2.0)
    assert memo.get(7, x) is None
    assert memo.insert(7, x, y) == KEY_BYTES + 4 * 2
    got = memo.get(7, x)
    assert got is not None and got.dtype == np.float32
    np.testing.assert_array_equal(got, y)
    # A fresh array each time: the caller may keep or modify it.
    assert got.flags.writeable and not np.shares_memory(got, y)
    got[0] = 99.0
    again = memo.get(7, x)
    assert again is not None and again[0] == 1.0
    # Another weight, a one-ulp change, or -0.0 for 0.0: all misses (bytes decide).
    assert memo.get(8, x) is None
    assert memo.get(7, np.nextafter(x, np.float32(np.inf))) is None
    memo.insert(7, vec(0.0), vec(1.0))
    assert memo.get(7, vec(-0.0)) is None
    # Strided x hashes its logical values.
    assert memo.get(7, np.repeat(x, 2)[::2]) is not None
    assert memo.insert(7, x, y) == KEY_BYTES + 8, "already present"
    stats = memo.stats()
    assert (stats["hits"], stats["misses"], stats["entries"]) == (3, 4, 2)
    assert stats["bytes"] == 2 * KEY_BYTES + 8 + 4 and len(memo) == 2
    memo.clear()
    assert memo.get(7, x) is None and len(memo) == 0 and memo.stats()["bytes"] == 0


@pytest.mark.parametrize(
    ("weight_id", "x", "y", "message"),
    [
        (1, vec(1.0), vec(0.0, np.nan), "non-finite value at index 1"),
        (1, vec(1.0), vec(np.inf), "non-finite"),
        (-1, vec(1.0), vec(1.0), "weight_id"),
        (2**64, vec(1.0), vec(1.0), "weight_id"),
        (1, np.array([1.0]), vec(1.0), "x must have dtype float32"),
        (1, vec(1.0), np.array([1], dtype=np.int32), "y must have dtype float32"),
        (1, np.zeros((2, 2), np.float32), vec(1.0), "x must be 1-D"),
        (1, [1.0], vec(1.0), "x must be a float32 numpy array"),
    ],
)
def test_bad_insert_raises_value_error_and_changes_nothing(
    weight_id: int, x: Any, y: Any, message: str
) -> None:
    memo = enabled()
    memo.insert(5, vec(1.0), vec(1.0))
    before = memo.stats()
    with pytest.raises(ValueError, match=message):
        memo.insert(weight_id, x, y)
    assert memo.stats() == before
    got = memo.get(5, vec(1.0))
    assert got is not None and got.tolist() == [1.0]


def test_bad_config_raises_value_error() -> None:
    bad: list[dict[str, Any]] = [{"max_entries": 0}, {"max_entries": -2}, {"max_bytes": 0}]
    for kwargs in bad:
        with pytest.raises(ValueError, match="at least 1"):
            _core.MatVecMemo(**kwargs)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        _core.MatVecMemo(policy="random")  # type: ignore[arg-type]
    memo = enabled()
    with pytest.raises(ValueError, match="at least 1"):
        memo.set_max_entries(0)
    with pytest.raises(ValueError, match="weight_id"):
        memo.get(-1, vec(1.0))


def test_too_large_skips_and_limits_evict_at_once() -> None:
    memo = enabled(max_entries=8, max_bytes=100, policy="lru")
    assert memo.insert(1, vec(1.0), np.zeros(20, np.float32)) == 0
    for w in range(4):
        memo.insert(w, vec(1.0), vec(1.0))  # 45 bytes each: two fit
    stats = memo.stats()
    assert (stats["entries"], stats["evictions"]) == (2, 2)
    assert memo.get(2, vec(1.0)) is not None and memo.get(3, vec(1.0)) is not None
    memo.set_max_entries(1)
    assert len(memo) == 1
    assert memo.get(3, vec(1.0)) is not None, "LRU kept the most recently used"
    memo.set_max_bytes(None)


def _victim(entries: dict[int, tuple[float, int]], tick: int, policy: str) -> int:
    def key(item: tuple[int, tuple[float, int]]) -> tuple[float, int]:
        drift, last = item[1]
        return (drift * (tick - last) if policy == "pisot" else 0.0, -last)

    return max(entries.items(), key=key)[0]


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=60
    ),
    policy=st.sampled_from(["pisot", "lru"]),
    max_entries=st.integers(1, 4),
)
def test_victim_choice_and_bounds_match_a_reference_model(
    ops: list[tuple[bool, int, int]], policy: str, max_entries: int
) -> None:
    memo = enabled(max_entries=max_entries, policy=policy)
    entries: dict[int, tuple[float, int]] = {}  # weight id -> (drift, last_used)
    evictions = 0
    x = vec(0.25)
    for tick, (is_insert, w, drift) in enumerate(ops, start=1):
        if is_insert:
            # y = [1 + d] has drift |‖y‖ - 1| = d exactly.
            memo.insert(w, x, vec(1.0 + drift))
            if w in entries:
                entries[w] = (entries[w][0], tick)
            else:
                while len(entries) + 1 > max_entries:
                    del entries[_victim(entries, tick, policy)]
                    evictions += 1
                entries[w] = (float(drift), tick)
        else:
            assert (memo.get(w, x) is not None) == (w in entries)
            if w in entries:
                entries[w] = (entries[w][0], tick)
        stats = memo.stats()
        assert stats["entries"] == len(entries) <= max_entries
        assert stats["evictions"] == evictions
        assert stats["bytes"] == len(entries) * (KEY_BYTES + 4)
