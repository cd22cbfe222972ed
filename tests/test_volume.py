"""The volume cache through the Python surface: round trips, rules, bad input, policies."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

import amplituhedron_rs as ar

F32 = NDArray[np.float32]


@dataclass
class Vol:
    """A capture request: owned arrays in the documented layout."""

    tokens: list[int]
    layer_lo: int = 0
    layer_hi: int = 2
    kv_heads: int = 2
    head_dim: int = 4
    fingerprint: int = 1
    salt: str | None = None
    tail: F32 = field(default_factory=lambda: np.array([1.0, 0, 0, 0, 0, 0, 0, 0], np.float32))
    logits: F32 | None = field(default_factory=lambda: np.array([0.5, -1.0, 2.0], np.float32))
    kv_keys: F32 = field(init=False)
    kv_vals: F32 = field(init=False)

    def __post_init__(self) -> None:
        # As a model's KV: position p depends on the ids up to p only (prompts sharing a
        # prefix share its KV), and on the absolute layer, the head and the dimension.
        h, prefix = 0, []
        for t in self.tokens:
            h = (h * 31 + t + 7) % 2**32
            prefix.append(h % 997)
        layers = np.arange(self.layer_lo, self.layer_hi)[:, None, None, None]
        heads = np.arange(self.kv_heads)[None, :, None, None]
        dims = np.arange(self.head_dim)[None, None, None, :]
        p = np.array(prefix, dtype=np.float32)[None, None, :, None]
        self.kv_keys = (p * 0.25 + (layers * 7 + heads * 3 + dims) * 0.125).astype(np.float32)
        self.kv_vals = -self.kv_keys - 1.0

    @property
    def nbytes(self) -> int:
        """The documented formula: f32 slabs, tail and logits, u32 token ids."""
        logits = 0 if self.logits is None else self.logits.size
        return 4 * (self.kv_keys.size * 2 + self.tail.size + logits + len(self.tokens))

    def capture(self, cache: ar.AmplituhedronCache, **override: Any) -> int:
        args: dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "tokens": self.tokens,
            "layer_lo": self.layer_lo,
            "layer_hi": self.layer_hi,
            "tail": self.tail,
            "kv_keys": self.kv_keys,
            "kv_vals": self.kv_vals,
            "logits": self.logits,
            "salt": self.salt,
        }
        args.update(override)
        return cache.capture(**args)

    def replay(self, cache: ar.AmplituhedronCache) -> ar.AmplituhedronVolume | None:
        return cache.replay(
            self.fingerprint, self.tokens, self.layer_lo, self.layer_hi, salt=self.salt
        )

    def damage(self, cache: ar.AmplituhedronCache, position: int) -> str:
        return cache.report_damage(
            self.fingerprint, self.tokens, self.layer_lo, self.layer_hi, position, salt=self.salt
        )

    def assert_is(self, v: ar.AmplituhedronVolume | None) -> None:
        assert v is not None
        assert (v.prefix_len, v.kv_len) == (len(self.tokens), len(self.tokens))
        assert (v.layer_lo, v.layer_hi) == (self.layer_lo, self.layer_hi)
        assert (v.kv_heads, v.head_dim) == (self.kv_heads, self.head_dim)
        assert v.model_fingerprint == self.fingerprint
        assert v.kv_dtype == "f32"  # f32 arrays in, f32 stored (f16 is what f16 sessions give)
        assert v.nbytes == self.nbytes
        assert v.tokens.tolist() == self.tokens
        np.testing.assert_array_equal(v.kv_keys, self.kv_keys)
        np.testing.assert_array_equal(v.kv_vals, self.kv_vals)
        assert v.tail is not None
        np.testing.assert_array_equal(v.tail, self.tail)
        if self.logits is None:
            assert v.logits is None
        else:
            assert v.logits is not None
            np.testing.assert_array_equal(v.logits, self.logits)


# ---- prefix_hash -------------------------------------------------------------------------


def test_prefix_hash_accepts_sequences_and_integer_arrays_alike() -> None:
    ids = [0, 1, 2**32 - 1, 49151]
    h = ar.prefix_hash(ids)
    assert 0 <= h < 2**64
    assert ar.prefix_hash(tuple(ids)) == h
    for dtype in (np.uint32, np.int64, np.uint64):
        assert ar.prefix_hash(np.array(ids, dtype=dtype)) == h
    assert ar.prefix_hash(np.array(ids, dtype=np.int64)[::-1][::-1]) == h
    assert ar.prefix_hash(np.array([3, 4], dtype=np.int8)) == ar.prefix_hash([3, 4])
    assert ar.prefix_hash([np.int64(3), 4]) == ar.prefix_hash([3, 4])
    assert ar.prefix_hash(ids[:-1]) != h
    assert ar.prefix_hash([1, 0]) != ar.prefix_hash([0, 1])


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, -1], "does not fit u32"),
        ([2**32], "does not fit u32"),
        ([2**70], "does not fit u32"),
        (np.array([5, -3], dtype=np.int32), "does not fit u32"),
        (np.array([2**40], dtype=np.uint64), "does not fit u32"),
        ([1, 2.5], "not an integer"),
        (["a"], "not an integer"),
        ("abc", "not a string"),
        (np.zeros((2, 2), dtype=np.uint32), "1-D"),
        (np.zeros(3, dtype=np.float32), "integers"),
        (np.zeros(3, dtype=bool), "integers"),
        (7, "sequence"),
    ],
)
def test_prefix_hash_rejects_ids_that_do_not_fit_u32(tokens: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ar.prefix_hash(tokens)


# ---- round trips -------------------------------------------------------------------------


def test_capture_replay_round_trip_and_stats() -> None:
    cache = ar.AmplituhedronCache()
    assert (cache.max_entries, cache.max_prefix_len, cache.max_bytes) == (4, 512, None)
    assert cache.policy == "gdsf" and cache.enabled
    v = Vol([10, 20, 30])
    assert v.capture(cache) == v.nbytes
    # nbytes = 4 × (2 × prefix_len × layers × kv_heads × head_dim + tail + logits + ids)
    assert v.nbytes == 4 * (2 * 3 * 2 * 2 * 4 + 8 + 3 + 3)
    got = v.replay(cache)
    v.assert_is(got)
    assert got is not None
    assert got.prefix_hash == ar.prefix_hash(v.tokens)
    assert got.kv_keys.shape == (2, 2, 3, 4)
    assert got.kv_keys.dtype == np.float32 and got.tail is not None
    assert got.tail.dtype == np.float32 and not got.salted
    assert got.drift == 0.0
    assert v.replay(cache) is not None
    assert Vol([10, 20]).replay(cache) is None
    stats = cache.stats()
    assert {k: stats[k] for k in ("hits", "misses", "evictions", "entries", "bytes")} == {
        "hits": 2,
        "misses": 1,
        "evictions": 0,
        "entries": 1,
        "bytes": v.nbytes,
    }
    assert stats["captures"] == 1 and len(cache) == 1
    assert "prefix_len=3" in repr(got)
    # Logits are optional.
    w = Vol([4, 5], logits=None)
    assert w.capture(cache) == w.nbytes
    w.assert_is(w.replay(cache))


def test_views_are_zero_copy_read_only_and_outlive_the_cache_entry() -> None:
    cache = ar.AmplituhedronCache()
    v = Vol([1, 2, 3, 4])
    v.capture(cache)
    a = v.replay(cache)
    b = v.replay(cache)
    assert a is not None and b is not None
    keys = a.kv_keys
    # Two replays hand out the same cached buffers: the views alias, nothing was copied.
    assert np.shares_memory(keys, b.kv_keys)
    assert np.shares_memory(a.kv_vals, b.kv_vals)
    assert a.tail is not None and b.tail is not None
    assert np.shares_memory(a.tail, b.tail)
    assert a.logits is not None and b.logits is not None
    assert np.shares_memory(a.logits, b.logits)
    assert cast(object, keys.base) is a
    # The cache copied the input once: the caller's array is not aliased.
    assert not np.shares_memory(keys, v.kv_keys)
    for arr in (keys, a.kv_vals, a.tail, a.logits, a.tokens):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[...] = 0
        with pytest.raises(ValueError):
            arr.setflags(write=True)
    # The view keeps the volume alive after the cache drops it.
    cache.clear()
    del a, b
    np.testing.assert_array_equal(keys, v.kv_keys)


def test_strided_inputs_are_stored_in_logical_order() -> None:
    cache = ar.AmplituhedronCache()
    v = Vol([7, 8, 9])
    fortran_keys = np.asfortranarray(v.kv_keys)
    strided_vals = np.repeat(v.kv_vals, 2, axis=3)[..., ::2]
    assert not fortran_keys.flags.c_contiguous and not strided_vals.flags.c_contiguous
    tail = np.repeat(v.tail, 2)[::2]
    assert v.capture(cache, kv_keys=fortran_keys, kv_vals=strided_vals, tail=tail) == v.nbytes
    v.assert_is(v.replay(cache))


# ---- bad input ---------------------------------------------------------------------------


def _snapshot(cache: ar.AmplituhedronCache, resident: Vol) -> tuple[dict[str, int], int]:
    stats = cache.stats()
    resident.assert_is(resident.replay(cache))
    return stats, len(cache)


GOOD = Vol([9, 8, 7])
NAN_KEYS = GOOD.kv_keys.copy()
NAN_KEYS[1, 1, 2, 3] = np.nan
INF_VALS = GOOD.kv_vals.copy()
INF_VALS[0, 0, 0, 0] = np.inf

BAD_CAPTURES: list[tuple[str, dict[str, Any], str]] = [
    ("empty tokens", {"tokens": []}, "empty prefix"),
    ("negative token", {"tokens": [1, -2, 3]}, "does not fit u32"),
    ("token too big", {"tokens": [1, 2**32, 3]}, "does not fit u32"),
    ("string tokens", {"tokens": "abc"}, "not a string"),
    ("float tokens", {"tokens": [1.0, 2.0, 3.0]}, "not an integer"),
    ("2-D token array", {"tokens": np.array([[1, 2, 3]])}, "1-D"),
    ("layer_lo == layer_hi", {"layer_lo": 2, "layer_hi": 2}, "layer_lo"),
    ("layer_lo > layer_hi", {"layer_lo": 3, "layer_hi": 1}, "layer_lo"),
    ("negative layer", {"layer_lo": -1}, "layer_lo must be an integer"),
    ("layer above u16", {"layer_hi": 70000}, "layer_hi must be an integer"),
    ("negative fingerprint", {"fingerprint": -5}, "fingerprint"),
    ("fingerprint above u64", {"fingerprint": 2**64}, "fingerprint"),
    ("layer range vs dim 0", {"layer_hi": 3}, "layers"),
    ("prefix_len vs dim 2", {"tokens": [9, 8, 7, 6]}, "prefix_len"),
    ("kv_vals shape", {"kv_vals": GOOD.kv_vals[:, :, :2]}, "differs from kv_keys"),
    (
        "zero kv_heads",
        {
            "kv_keys": np.zeros((2, 0, 3, 4), np.float32),
            "kv_vals": np.zeros((2, 0, 3, 4), np.float32),
        },
        "kv_heads",
    ),
    (
        "zero head_dim",
        {
            "kv_keys": np.zeros((2, 2, 3, 0), np.float32),
            "kv_vals": np.zeros((2, 2, 3, 0), np.float32),
        },
        "head_dim",
    ),
    ("float64 keys", {"kv_keys": GOOD.kv_keys.astype(np.float64)}, "float32"),
    ("big-endian keys", {"kv_keys": GOOD.kv_keys.astype(">f4")}, "float32"),
    ("3-D keys", {"kv_keys": GOOD.kv_keys[0]}, "4-D"),
    ("list keys", {"kv_keys": GOOD.kv_keys.tolist()}, "numpy"),
    ("non-finite tail", {"tail": np.array([1, np.nan], np.float32)}, "tail"),
    ("empty tail", {"tail": np.zeros(0, np.float32)}, "tail"),
    ("2-D tail", {"tail": np.zeros((1, 8), np.float32)}, "tail must be 1-D"),
    ("non-finite logits", {"logits": np.array([np.inf], np.float32)}, "logits"),
    ("float64 logits", {"logits": np.zeros(3)}, "logits must have dtype float32"),
    ("NaN in keys", {"kv_keys": NAN_KEYS}, "kv_keys .* layer 1, head 1, position 2"),
    ("inf in vals", {"kv_vals": INF_VALS}, "kv_vals .* layer 0, head 0, position 0"),
]


@pytest.mark.parametrize(
    ("override", "message"),
    [(o, m) for _, o, m in BAD_CAPTURES],
    ids=[name for name, _, _ in BAD_CAPTURES],
)
def test_bad_capture_raises_value_error_and_changes_nothing(
    override: dict[str, Any], message: str
) -> None:
    cache = ar.AmplituhedronCache(max_entries=2)
    resident = Vol([1, 2, 3, 4])
    other = Vol([5, 6])
    resident.capture(cache)
    other.capture(cache)  # full: a stored capture would have to evict
    before = _snapshot(cache, resident)
    with pytest.raises(ValueError, match=message):
        GOOD.capture(cache, **override)
    after = _snapshot(cache, resident)
    assert after[0] == {**before[0], "hits": before[0]["hits"] + 1}
    assert after[1] == before[1] == 2
    other.assert_is(other.replay(cache))


def test_damaged_capture_of_a_drifted_key_clears_nothing() -> None:
    cache = ar.AmplituhedronCache()
    v = Vol([1, 2, 3])
    v.capture(cache)
    new_model = Vol([1, 2, 3], fingerprint=2)
    bad = new_model.kv_keys.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        new_model.capture(cache, kv_keys=bad)
    assert cache.stats()["drift_clears"] == 0
    v.assert_is(v.replay(cache))


def test_bad_replay_damage_and_config_arguments_raise_value_error() -> None:
    cache = ar.AmplituhedronCache()
    v = Vol([1, 2])
    v.capture(cache)
    before = cache.stats()
    with pytest.raises(ValueError, match="empty prefix"):
        cache.replay(1, [], 0, 2)
    with pytest.raises(ValueError, match="layer_lo"):
        cache.replay(1, [1, 2], 2, 0)
    with pytest.raises(ValueError, match="outside"):
        v.damage(cache, 2)
    with pytest.raises(ValueError, match="position"):
        v.damage(cache, -1)
    with pytest.raises(ValueError, match="prefix_hash"):
        cache.tail(-1)
    for setter in (cache.set_max_entries, cache.set_max_prefix_len, cache.set_max_bytes):
        for n in (0, -3):
            with pytest.raises(ValueError, match="at least 1"):
                setter(n)
    assert cache.stats() == before
    assert (cache.max_entries, cache.max_prefix_len, cache.max_bytes) == (4, 512, None)
    bad: list[dict[str, Any]] = [{"max_entries": 0}, {"max_prefix_len": -1}, {"max_bytes": 0}]
    for kwargs in bad:
        with pytest.raises(ValueError, match="at least 1"):
            ar.AmplituhedronCache(**kwargs)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        ar.AmplituhedronCache(policy="fifo")  # type: ignore[arg-type]


# ---- outcomes that store nothing ---------------------------------------------------------


def test_too_long_too_large_and_disabled_return_zero() -> None:
    cache = ar.AmplituhedronCache(max_prefix_len=3)
    assert Vol([1, 2, 3, 4]).capture(cache) == 0
    assert cache.stats()["skipped_too_long"] == 1 and len(cache) == 0
    fits = Vol([1, 2, 3])
    assert fits.capture(cache) == fits.nbytes
    cache.set_max_bytes(fits.nbytes + 4)
    assert cache.max_bytes == fits.nbytes + 4
    assert Vol([5, 5], layer_hi=6).capture(cache) == 0
    assert cache.stats()["skipped_too_large"] == 1 and len(cache) == 1
    cache.set_max_bytes(None)
    cache.set_max_prefix_len(8)
    assert cache.max_prefix_len == 8

    cache.enable(False)
    assert not cache.enabled
    before = cache.stats()
    assert Vol([6]).capture(cache) == 0
    assert fits.replay(cache) is None
    assert cache.stats() == before, "a disabled cache counts nothing"
    cache.enable(True)
    fits.assert_is(fits.replay(cache))


def test_same_content_twice_is_a_no_op() -> None:
    cache = ar.AmplituhedronCache()
    v = Vol([3, 3, 3])
    assert v.capture(cache) == v.nbytes
    before = cache.stats()
    assert v.capture(cache) == v.nbytes
    assert cache.stats() == before


# ---- what decides a hit ------------------------------------------------------------------


def test_fingerprint_change_misses_and_drift_clears_the_old_model() -> None:
    cache = ar.AmplituhedronCache(max_entries=8)
    a, b = Vol([1, 2]), Vol([3, 4])
    a.capture(cache)
    b.capture(cache)
    a2 = Vol([1, 2], fingerprint=2)
    assert a2.replay(cache) is None
    assert Vol([1, 2], layer_lo=1, layer_hi=3).replay(cache) is None
    assert a2.capture(cache) == a2.nbytes
    assert cache.stats()["drift_clears"] == 2
    assert a.replay(cache) is None and b.replay(cache) is None
    a2.assert_is(a2.replay(cache))


def test_salts_isolate_tenants() -> None:
    cache = ar.AmplituhedronCache(max_entries=8)
    plain = Vol([42, 43])
    t1 = Vol([42, 43], salt="tenant-1")
    t2 = Vol([42, 43], salt="tenant-2")
    plain.capture(cache)
    assert t1.replay(cache) is None
    t1.capture(cache)
    assert t2.replay(cache) is None
    assert Vol([42, 43], salt="").replay(cache) is None
    got = t1.replay(cache)
    assert got is not None and got.salted
    assert got.prefix_hash != ar.prefix_hash(plain.tokens)
    plain_got = plain.replay(cache)
    assert plain_got is not None and not plain_got.salted
    assert len(cache) == 2


def test_ten_thousand_random_prompts_give_zero_false_hits() -> None:
    rng = np.random.default_rng(1234)
    prompts: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    while len(prompts) < 10_000:
        vocab = 8 if len(prompts) % 2 else 2**32
        p = tuple(int(t) for t in rng.integers(0, vocab, size=int(rng.integers(1, 12))))
        if p not in seen:
            seen.add(p)
            prompts.append(p)
    captured = 32
    cache = ar.AmplituhedronCache(max_entries=captured)
    one = np.ones(1, np.float32)
    for p in prompts[:captured]:
        slab = np.zeros((1, 1, len(p), 1), np.float32)
        assert cache.capture(9, list(p), 0, 1, one, slab, slab) > 0
    hits = 0
    for i, p in enumerate(prompts):
        v = cache.replay(9, np.array(p, dtype=np.uint32), 0, 1)
        if v is not None:
            assert i < captured, f"false hit for prompt {i}"
            assert tuple(v.tokens.tolist()) == p
            hits += 1
        else:
            assert i >= captured
    assert hits == captured
    assert cache.stats()["misses"] == len(prompts) - captured


# ---- longest-prefix replay and shared blocks ----------------------------------------------

SYSTEM = list(range(100, 140))  # a 40-id "system prompt": two full 16-position blocks


def test_replay_longest_reuses_the_longest_shared_prefix() -> None:
    cache = ar.AmplituhedronCache(max_entries=8)
    a = Vol([*SYSTEM, 1, 2, 3])
    a.capture(cache)
    b = [*SYSTEM, 7, 8, 9, 10]
    assert cache.replay(1, b, 0, 2) is None
    got = cache.replay_longest(1, b, 0, 2)
    assert got is not None
    vol, n = got
    assert n == 40 and vol.tokens.tolist() == a.tokens
    np.testing.assert_array_equal(vol.kv_keys[:, :, :n], a.kv_keys[:, :, :n])
    assert cache.replay_longest(1, np.array(b, dtype=np.uint32), 0, 2, min_len=40) is not None
    assert cache.replay_longest(1, b, 0, 2, min_len=41) is None
    # A strict prefix of a cached prompt reuses all but its last position.
    short = cache.replay_longest(1, a.tokens[:30], 0, 2)
    assert short is not None and short[1] == 29
    # Another tenant, model or layer range, or nothing in common: no reuse.
    assert cache.replay_longest(1, b, 0, 2, salt="tenant") is None
    assert cache.replay_longest(2, b, 0, 2) is None
    assert cache.replay_longest(1, b, 0, 1) is None
    assert cache.replay_longest(1, [999] * 50, 0, 2) is None
    assert cache.stats()["prefix_hits"] == 3
    cache.enable(False)
    assert cache.replay_longest(1, b, 0, 2) is None
    cache.enable(True)
    before = cache.stats()
    for fingerprint, tokens, lo, hi, min_len, message in [
        (1, b, 0, 2, 0, "min_len"),
        (1, [], 0, 2, 16, "empty prefix"),
        (1, b, 2, 0, 16, "layer_lo"),
        (-1, b, 0, 2, 16, "fingerprint"),
        (1, [1, -1], 0, 2, 16, "does not fit u32"),
    ]:
        with pytest.raises(ValueError, match=message):
            cache.replay_longest(fingerprint, tokens, lo, hi, min_len=min_len)
    assert cache.stats() == before


def test_prompts_sharing_a_system_prompt_hold_its_blocks_once() -> None:
    cache = ar.AmplituhedronCache(max_entries=8)
    a, c = Vol([*SYSTEM, 1, 2, 3]), Vol([*SYSTEM, *range(500, 520)])
    a.capture(cache)
    c.capture(cache)
    a.assert_is(a.replay(cache))
    c.assert_is(c.replay(cache))
    block = 4 * 2 * (2 * 2 * 16 * 4)  # keys and values of 2 layers × 2 heads × 16 × 4
    assert cache.stats()["bytes"] == a.nbytes + c.nbytes - 2 * block


# ---- a cache directory ---------------------------------------------------------------------


def test_a_cache_directory_keeps_volumes_across_instances(tmp_path: Path) -> None:
    where = tmp_path / "volumes"
    cache = ar.AmplituhedronCache(cache_dir=where, max_disk_bytes=10**6)
    assert (cache.cache_dir, cache.max_disk_bytes) == (where, 10**6)
    vols = [Vol([*SYSTEM, i]) for i in range(3)]
    for v in vols:
        v.capture(cache)
    cache.flush()  # files are written behind the captures
    assert cache.stats()["disk_writes"] == 3
    with pytest.raises(ValueError, match="in use"):
        ar.AmplituhedronCache(cache_dir=where)
    del cache
    reopened = ar.AmplituhedronCache(cache_dir=str(where))
    stats = reopened.stats()
    assert (stats["entries"], stats["disk_entries"]) == (0, 3)
    for v in vols:
        v.assert_is(v.replay(reopened))
    assert reopened.stats()["disk_hits"] == 3
    assert ar.AmplituhedronCache().cache_dir is None


def test_bad_cache_directory_arguments_raise_value_error(tmp_path: Path) -> None:
    plain = tmp_path / "a-file"
    plain.write_text("not a directory")
    with pytest.raises(ValueError, match="cannot open the cache directory"):
        ar.AmplituhedronCache(cache_dir=plain)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_disk_bytes must be at least 1"):
            ar.AmplituhedronCache(cache_dir=tmp_path / "x", max_disk_bytes=bad)
    with pytest.raises(TypeError):
        ar.AmplituhedronCache(cache_dir=3)  # type: ignore[arg-type]


# ---- erasure and tail --------------------------------------------------------------------


def test_erasure_trims_once_then_clears_and_spares_other_entries() -> None:
    cache = ar.AmplituhedronCache(max_entries=8)
    a, b = Vol([1, 2, 3, 4]), Vol([5, 6, 7])
    a.capture(cache)
    b.capture(cache)
    held = a.replay(cache)
    assert a.damage(cache, 3) == "trimmed"
    t = a.replay(cache)
    assert t is not None
    assert (t.prefix_len, t.kv_len) == (4, 3)
    assert t.tail is None and t.logits is None
    assert t.kv_keys.shape == (2, 2, 3, 4)
    np.testing.assert_array_equal(t.kv_keys, a.kv_keys[:, :, :3])
    np.testing.assert_array_equal(t.kv_vals, a.kv_vals[:, :, :3])
    assert t.first_non_finite_position() is None
    a.assert_is(held)  # a handle taken before the erasure is unchanged
    # A fresh capture restores the full volume; erase it again for the rest of the test.
    assert a.capture(cache) == a.nbytes
    a.assert_is(a.replay(cache))
    assert a.damage(cache, 3) == "trimmed"
    assert a.damage(cache, 2) == "cleared"
    assert a.replay(cache) is None
    b.assert_is(b.replay(cache))
    assert a.damage(cache, 0) == "absent"
    assert b.damage(cache, 0) == "cleared", "damage before the trailing position clears"
    assert cache.stats()["erasures"] == 4 and len(cache) == 0


def test_tail_answers_for_the_last_verified_hit() -> None:
    cache = ar.AmplituhedronCache()
    v = Vol([1, 2, 3], tail=np.full(8, 0.25, np.float32))
    h = ar.prefix_hash(v.tokens)
    v.capture(cache)
    assert cache.tail(h) is None
    v.replay(cache)
    tail = cache.tail(h)
    assert tail is not None
    np.testing.assert_array_equal(tail, v.tail)
    assert cache.tail(h ^ 1) is None
    cache.clear()
    assert cache.tail(h) is None
    assert cache.stats()["entries"] == 0 and cache.stats()["bytes"] == 0


# ---- bounds and policies -----------------------------------------------------------------


def test_set_limits_evict_at_once() -> None:
    cache = ar.AmplituhedronCache(policy="lru")
    vols = [Vol([i, i + 1]) for i in range(4)]
    for v in vols:
        v.capture(cache)
    cache.set_max_entries(2)
    assert len(cache) == 2 and cache.stats()["evictions"] == 2
    assert vols[0].replay(cache) is None and vols[1].replay(cache) is None
    vols[2].assert_is(vols[2].replay(cache))
    vols[3].assert_is(vols[3].replay(cache))
    cache.set_max_bytes(vols[0].nbytes)
    assert len(cache) == 1
    vols[3].assert_is(vols[3].replay(cache))


#: Bytes of each volume in the policy tests: 2 positions of 1 layer × 1 head × head_dim 1
#: (keys and values), a 1-float tail, no logits, 2 ids — 7 words.
MODEL_ENTRY_BYTES = 4 * (2 * 2 + 1 + 2)
#: Prefill a hit on one of them saves: 2 positions × 1 layer.
MODEL_ENTRY_COST = 2.0


@dataclass
class Entry:
    drift: float
    last_used: int
    value: float  # prefill cost plus what every hit saved
    priority: float  # cost-aware: inflation at last use + value / bytes


@dataclass
class Model:
    """Reference model of the cache's bookkeeping: logical ticks, drift, last use, and the
    cost-aware policy's value, priority and inflation."""

    policy: str
    max_entries: int
    tick: int = 0
    inflation: float = 0.0
    entries: dict[int, Entry] = field(default_factory=dict)  # prompt -> entry
    evictions: int = 0

    def _use(self, e: Entry, saved: float) -> None:
        e.last_used = self.tick
        e.value += saved
        e.priority = self.inflation + e.value / MODEL_ENTRY_BYTES

    def replay(self, prompt: int) -> bool:
        self.tick += 1
        if prompt in self.entries:
            self._use(self.entries[prompt], MODEL_ENTRY_COST)
            return True
        return False

    def capture(self, prompt: int, drift: float) -> None:
        self.tick += 1
        if prompt in self.entries:
            self._use(self.entries[prompt], 0.0)
            return
        while len(self.entries) + 1 > self.max_entries:
            victim = self.victim()
            if self.policy == "gdsf":
                self.inflation = max(self.inflation, self.entries[victim].priority)
            del self.entries[victim]
            self.evictions += 1
        value = MODEL_ENTRY_COST
        self.entries[prompt] = Entry(
            drift, self.tick, value, self.inflation + value / MODEL_ENTRY_BYTES
        )

    def victim(self) -> int:
        def key(item: tuple[int, Entry]) -> tuple[float, int]:
            e = item[1]
            if self.policy == "pisot":
                score = e.drift * (self.tick - e.last_used)
            elif self.policy == "gdsf":
                score = -e.priority
            else:
                score = 0.0
            return (score, -e.last_used)  # largest score, then the oldest

        return max(self.entries.items(), key=key)[0]


OPS = st.lists(
    st.tuples(st.sampled_from(["capture", "replay"]), st.integers(0, 5), st.integers(0, 3)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, policy=st.sampled_from(["pisot", "lru", "gdsf"]), max_entries=st.integers(1, 4))
def test_victim_choice_matches_the_policy(
    ops: list[tuple[str, int, int]], policy: str, max_entries: int
) -> None:
    cache = ar.AmplituhedronCache(max_entries=max_entries, policy=policy)  # type: ignore[arg-type]
    model = Model(policy, max_entries)
    slab = np.zeros((1, 1, 2, 1), np.float32)
    for op, prompt, drift in ops:
        tokens = [prompt, prompt]
        if op == "capture":
            # ‖[1 + d]‖ - 1 = d exactly: small integer drifts make score ties common.
            tail = np.array([1.0 + drift], np.float32)
            cache.capture(1, tokens, 0, 1, tail, slab, slab)
            model.capture(prompt, float(drift))
        else:
            assert (cache.replay(1, tokens, 0, 1) is not None) == model.replay(prompt)
        assert cache.stats()["evictions"] == model.evictions
        assert len(cache) == len(model.entries)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["capture", "replay", "damage", "entries", "bytes", "clear"]),
            st.integers(0, 5),
            st.integers(1, 4),
        ),
        min_size=1,
        max_size=50,
    ),
    policy=st.sampled_from(["pisot", "lru", "gdsf"]),
)
def test_random_operations_never_exceed_the_bounds(
    ops: list[tuple[str, int, int]], policy: str
) -> None:
    cache = ar.AmplituhedronCache(max_entries=3, max_bytes=2000, policy=policy)  # type: ignore[arg-type]
    for op, prompt, n in ops:
        v = Vol([prompt] * n, layer_hi=1 + prompt % 2, kv_heads=1, head_dim=2, logits=None)
        if op == "capture":
            v.capture(cache, tail=np.array([1.0 + prompt], np.float32))
        elif op == "replay":
            got = v.replay(cache)
            assert got is None or got.tokens.tolist() == v.tokens
        elif op == "damage":
            try:
                v.damage(cache, n - 1)
            except ValueError as e:  # the trailing position of a trimmed volume
                assert "outside" in str(e)
        elif op == "entries":
            cache.set_max_entries(n)
        elif op == "bytes":
            cache.set_max_bytes(None if n == 4 else 150 * n)
        else:
            cache.clear()
        stats = cache.stats()
        assert stats["entries"] == len(cache) <= cache.max_entries
        assert cache.max_bytes is None or stats["bytes"] <= cache.max_bytes


def test_concurrent_threads_keep_the_counters_consistent() -> None:
    cache = ar.AmplituhedronCache(max_entries=3)
    vols = [Vol([i, i, i], layer_hi=4, kv_heads=4, head_dim=64) for i in range(6)]
    replays_per_thread = 150
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(replays_per_thread):
                v = vols[int(rng.integers(0, len(vols)))]
                v.capture(cache)
                got = v.replay(cache)
                if got is not None:
                    np.testing.assert_array_equal(got.kv_keys, v.kv_keys)
        except BaseException as e:  # surfaced to the main thread below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] == 4 * replays_per_thread
    assert stats["entries"] == len(cache) <= 3
