"""Volumes on disk through the extension, against real failures: a writer process killed
with SIGKILL mid-write, a full filesystem, corrupted files, a restart.

Every volume the tests write is a deterministic function of its index, so whatever a cache
serves after a failure is compared bit for bit with what was captured.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

import amplituhedron_rs as ar

FINGERPRINT = 77
LAYERS, HEADS, HEAD_DIM = 4, 4, 64

# The volume of index i, shared by the tests and the writer child (which gets this source).
VOLUME_SOURCE = textwrap.dedent(
    """
    import numpy as np

    def volume_tokens(i, positions):
        return [(i * 7919 + t) % 49152 for t in range(positions)]

    def volume(i, positions):
        tokens = volume_tokens(i, positions)
        shape = (LAYERS, HEADS, positions, HEAD_DIM)
        base = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) % 251
        keys = (base * 0.001 + i).astype(np.float32)
        vals = (-keys).astype(np.float32)
        tail = np.full(16, 1.0 / 4.0, np.float32)
        return tokens, keys, vals, tail
    """
)
namespace: dict[str, object] = {"LAYERS": LAYERS, "HEADS": HEADS, "HEAD_DIM": HEAD_DIM}
exec(VOLUME_SOURCE, namespace)  # the same definition the child process runs


def volume(
    i: int, positions: int
) -> tuple[list[int], NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]:
    fn = namespace["volume"]
    assert callable(fn)
    return fn(i, positions)  # type: ignore[no-any-return]


def capture(cache: ar.AmplituhedronCache, i: int, positions: int) -> int:
    tokens, keys, vals, tail = volume(i, positions)
    return cache.capture(FINGERPRINT, tokens, 0, LAYERS, tail, keys, vals)


def served_intact(cache: ar.AmplituhedronCache, i: int, positions: int) -> bool:
    """Whether volume i is served, asserting it is bit-exact when it is."""
    tokens_of = namespace["volume_tokens"]
    assert callable(tokens_of)
    got = cache.replay(FINGERPRINT, tokens_of(i, positions), 0, LAYERS)
    if got is None:
        return False
    tokens, keys, vals, tail = volume(i, positions)
    assert got.tokens.tolist() == tokens
    np.testing.assert_array_equal(got.kv_keys, keys)
    np.testing.assert_array_equal(got.kv_vals, vals)
    assert got.tail is not None
    np.testing.assert_array_equal(got.tail, tail)
    return True


def child_script(path: Path, template: str, positions: int) -> Path:
    """Writes a child process's script: ``template`` with the shared volume definition."""
    path.write_text(
        template.format(
            volume_source=VOLUME_SOURCE,
            layers=LAYERS,
            heads=HEADS,
            head_dim=HEAD_DIM,
            positions=positions,
            fingerprint=FINGERPRINT,
        )
    )
    return path


def leftovers(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.part"))


def volume_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.vol"))


# ---- kill -9 mid-write ------------------------------------------------------------------

WRITER = """
import sys
import amplituhedron_rs as ar
{volume_source}
LAYERS, HEADS, HEAD_DIM = {layers}, {heads}, {head_dim}
cache = ar.AmplituhedronCache(
    max_entries=2, max_prefix_len=4096, cache_dir=sys.argv[1], max_disk_bytes=48 * 2**20
)
print("ready", flush=True)
i = int(sys.argv[2])
while True:
    tokens, keys, vals, tail = volume(i, {positions})
    cache.capture({fingerprint}, tokens, 0, LAYERS, tail, keys, vals)
    i += 1
"""

WRITER_POSITIONS = 512  # 4 MiB of K+V per volume: each write takes a while


def test_a_writer_killed_mid_write_never_leaves_a_served_torn_volume(tmp_path: Path) -> None:
    directory = tmp_path / "volumes"
    script = child_script(tmp_path / "writer.py", WRITER, WRITER_POSITIONS)
    rng = np.random.default_rng(9)
    torn_kills = 0
    next_index = 0
    for round_ in range(12):
        child = subprocess.Popen(
            [sys.executable, str(script), str(directory), str(next_index)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        if round_ % 2:
            time.sleep(float(rng.uniform(0.05, 0.4)))  # wherever it happens to be
        else:
            # As soon as a write has begun (its temporary file exists), after a random delay.
            deadline = time.monotonic() + 10
            while not leftovers(directory) and time.monotonic() < deadline:
                time.sleep(0.0005)
            time.sleep(float(rng.uniform(0.0, 0.002)))
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        if leftovers(directory):
            torn_kills += 1  # killed between creating the temporary file and the rename
        files = len(volume_files(directory))
        # A new cache on the directory: the torn write is deleted, every file it keeps is
        # whole, and every volume it serves is bit-exact.
        cache = ar.AmplituhedronCache(max_prefix_len=4096, cache_dir=directory)
        assert leftovers(directory) == []
        stats = cache.stats()
        assert stats["disk_entries"] == files
        served = [i for i in range(next_index + 200) if served_intact(cache, i, WRITER_POSITIONS)]
        assert len(served) == files
        assert cache.stats()["disk_rejected"] == stats["disk_rejected"], "no file failed a hit"
        next_index = max(served, default=next_index - 1) + 1
        del cache
    assert torn_kills >= 3, f"only {torn_kills} of 12 kills landed mid-write"


# ---- a full disk ------------------------------------------------------------------------


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A 3 MiB filesystem if this process may mount one (tmpfs, else a loop-mounted ext4
    image); otherwise a directory in which the writer runs with a 1 MiB file-size limit
    (RLIMIT_FSIZE), which fails writes the same way at the OS level."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = (
        shutil.which("mount") is not None
        and os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
            capture_output=True,
        ).returncode
        == 0
    )
    mode = "tmpfs size=3m" if mounted else ""
    if not mounted and os.geteuid() == 0 and shutil.which("mkfs.ext4"):
        image = tmp_path / "small.img"
        with image.open("wb") as f:
            f.truncate(4 * 2**20)
        subprocess.run(["mkfs.ext4", "-q", str(image)], check=True, capture_output=True)
        mounted = (
            subprocess.run(
                ["mount", "-o", "loop", str(image), str(mount_point)], capture_output=True
            ).returncode
            == 0
        )
        mode = "loop-mounted 4 MiB ext4 image" if mounted else ""
    if not mounted:
        mode = "RLIMIT_FSIZE 1 MiB (no filesystem could be mounted)"
    print(f"\nfull-disk test runs on: {mode}", file=sys.stderr)
    try:
        yield mount_point / uuid.uuid4().hex, mode
    finally:
        if mounted:
            subprocess.run(["umount", str(mount_point)], check=True)


FULL_DISK_RUN = """
import json, resource, signal, sys
import amplituhedron_rs as ar
if sys.argv[2] == "limit":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
{volume_source}
LAYERS, HEADS, HEAD_DIM = {layers}, {heads}, {head_dim}
cache = ar.AmplituhedronCache(max_entries=64, max_prefix_len=4096, cache_dir=sys.argv[1])
outcomes = []
for i in range(8):
    tokens, keys, vals, tail = volume(i, {positions})
    outcomes.append(cache.capture({fingerprint}, tokens, 0, LAYERS, tail, keys, vals))
served = [cache.replay({fingerprint}, volume(i, {positions})[0], 0, LAYERS) is not None
          for i in range(8)]
cache.flush()  # writes run behind the captures: wait for their outcomes
print(json.dumps({{"outcomes": outcomes, "served": served, "stats": cache.stats()}}))
"""

FULL_DISK_POSITIONS = 160  # ≈ 1.3 MiB per file: a few fit in 3 MiB, none under 1 MiB


def test_a_full_disk_fails_writes_cleanly_and_the_cache_keeps_serving(
    tmp_path: Path, small_filesystem: tuple[Path, str]
) -> None:
    directory, mode = small_filesystem
    script = child_script(tmp_path / "fill.py", FULL_DISK_RUN, FULL_DISK_POSITIONS)
    limit = "limit" if mode.startswith("RLIMIT") else "none"
    run = subprocess.run(
        [sys.executable, str(script), str(directory), limit],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(run.stdout)
    stats = result["stats"]
    # Every capture stored its volume in memory and every volume is served, whatever the
    # disk did; the failed writes are counted and left nothing behind.
    assert all(b > 0 for b in result["outcomes"]), mode
    assert all(result["served"]), mode
    assert stats["disk_write_failures"] >= 1, f"{mode}: the disk never filled"
    assert stats["disk_writes"] + stats["disk_write_failures"] == 8, mode
    assert leftovers(directory) == [], mode
    assert len(volume_files(directory)) == stats["disk_writes"], mode
    # A restart serves exactly the files that were written, bit for bit.
    cache = ar.AmplituhedronCache(max_prefix_len=4096, cache_dir=directory)
    served = [i for i in range(8) if served_intact(cache, i, FULL_DISK_POSITIONS)]
    assert len(served) == stats["disk_writes"], mode
    assert cache.stats()["disk_rejected"] == 0, mode
    del cache


# ---- corruption and restart --------------------------------------------------------------


def test_corrupted_files_are_never_served(tmp_path: Path) -> None:
    directory = tmp_path / "volumes"
    cache = ar.AmplituhedronCache(max_entries=8, cache_dir=directory)
    for i in range(4):
        capture(cache, i, 40)
    del cache
    files = volume_files(directory)
    assert len(files) == 4
    sizes = [f.stat().st_size for f in files]
    # One header byte flipped, one payload byte flipped, one file truncated.
    for path, offset in ((files[0], 20), (files[1], sizes[1] - 100)):
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x40
        path.write_bytes(bytes(data))
    with files[2].open("r+b") as f:
        f.truncate(sizes[2] - 1)
    cache = ar.AmplituhedronCache(max_entries=8, cache_dir=directory)
    served = [i for i in range(4) if served_intact(cache, i, 40)]
    assert len(served) == 1
    stats = cache.stats()
    assert stats["disk_rejected"] == 3
    assert stats["misses"] == 3
    assert volume_files(directory) == [f for f in files if f.exists()]
    assert len(volume_files(directory)) == 1


def test_captures_write_behind_and_flush_waits_for_the_files(tmp_path: Path) -> None:
    """A capture returns before its file is written (the writer thread does it); ``flush``
    waits for every queued write, after which the stats and the directory agree."""
    directory = tmp_path / "volumes"
    cache = ar.AmplituhedronCache(max_entries=16, max_prefix_len=4096, cache_dir=directory)
    for i in range(6):
        capture(cache, i, 64)
        assert served_intact(cache, i, 64), "served from memory while its file is written"
    cache.flush()
    stats = cache.stats()
    assert stats["disk_writes"] == stats["disk_entries"] == 6
    assert len(volume_files(directory)) == 6 and leftovers(directory) == []
    cache.flush()  # nothing queued: returns at once
    del cache
    reopened = ar.AmplituhedronCache(max_entries=16, max_prefix_len=4096, cache_dir=directory)
    assert all(served_intact(reopened, i, 64) for i in range(6))
