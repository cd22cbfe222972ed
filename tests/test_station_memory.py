"""A station holds only its own layers (SPEC §15): over a real 3-station mesh of the bundled
model, each station's ``/healthz`` reports what it holds (its layers' tensors, plus the
embedding at the entry and the final norm and head at the exit, counted here from the GGUF
header by ggml-org's own reader) and what is resident, and the resident weights are its
share, not the model. A range that does not fit the memory it may use is refused at start,
with the bytes it needs."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from amplituhedron_rs import InputError, MeshError, ModelError
from amplituhedron_rs.bench.memory import measure_memory, memory_table
from amplituhedron_rs.mesh.launcher import (
    WHOLE_HOST_STATION_BYTES,
    LocalMesh,
    MeshSpec,
    station_threads,
)
from amplituhedron_rs.runtime.gguf_file import read_model_file
from amplituhedron_rs.runtime.weights import load_weights

pytestmark = [pytest.mark.model, pytest.mark.mesh]

BUDGET_ENV = "AMPLITUHEDRON_MEMORY_BUDGET"
#: The most a station's mapping may hold beyond its tensors: what the kernel maps around a
#: faulted page of a file mapping is a 64 KiB window, or a whole page-cache folio (a freshly
#: written file on ext4, Linux 6.16+), up to 2 MiB, at either end of the two matrices a
#: station may read in place (the embedding and an untied head; norms and biases are copied).
MAPPED_SLACK = 2 * 2 * 2 * 1024 * 1024


@pytest.fixture(scope="module")
def mesh() -> Iterator[MeshSpec]:
    with LocalMesh(3) as spec:
        yield spec


def tensor_bytes(path: Path) -> dict[str, int]:
    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}


def blocks_of(sizes: dict[str, int], lo: int, hi: int) -> list[str]:
    return [n for n in sizes if n.startswith("blk.") and lo <= int(n.split(".")[1]) < hi]


def held_by(sizes: dict[str, int], lo: int, hi: int, n_layers: int) -> int:
    """The bytes a range holds: its blocks, the embedding at the entry, the final norm and
    the head (the tied embedding when the file has no ``output.weight``) at the exit."""
    total = sum(sizes[n] for n in blocks_of(sizes, lo, hi))
    if lo == 0:
        total += sizes["token_embd.weight"]
    if hi == n_layers:
        total += sizes["output_norm.weight"] + sizes.get("output.weight", 0)
        if "output.weight" not in sizes:
            total += sizes["token_embd.weight"]
    return total


def test_each_station_holds_its_share_and_reports_it(mesh: MeshSpec, model_path: Path) -> None:
    sizes = tensor_bytes(model_path)
    n_layers = mesh.n_layers
    report = measure_memory(mesh, str(model_path))
    stations = report["stations"]
    assert [(s["layer_lo"], s["layer_hi"]) for s in stations] == [(0, 10), (10, 20), (20, 30)]
    for s in stations:
        lo, hi = s["layer_lo"], s["layer_hi"]
        assert s["weights_held"] == held_by(sizes, lo, hi, n_layers), s
        assert s["weights_resident"] == s["weights_copied"] + s["weights_mapped"], s
        blocks = sum(sizes[n] for n in blocks_of(sizes, lo, hi))
        # Its layers are resident (copied, or touched in place at load)...
        assert s["weights_resident"] >= blocks, s
        # ...and not the other stations' layers.
        assert s["weights_resident"] <= s["weights_held"] + MAPPED_SLACK, s
        assert s["rss"] >= s["weights_resident"] and s["baseline"] > 0, s
        assert s["rss"] > s["baseline"], s
    # The middle station holds no embedding and no head: a third of the blocks, not the model.
    middle = stations[1]
    assert middle["weights_held"] < report["file_bytes"] / 2
    # Summed, the stations hold every tensor once, and the tied head twice (entry and exit).
    total = report["sum"]
    assert total["stations"] == 3
    tied = 0 if "output.weight" in sizes else sizes["token_embd.weight"]
    assert total["weights_held"] == sum(sizes.values()) + tied
    assert total["weights_resident"] <= 1.1 * report["file_bytes"] + sizes["token_embd.weight"]
    # The bench's table shows every station and the sum.
    assert memory_table(report).row_count == 4


def test_a_range_that_does_not_fit_is_refused_with_the_bytes_it_needs(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_file = read_model_file(str(model_path))
    sizes = tensor_bytes(model_path)
    need = held_by(sizes, 10, 20, 30)
    monkeypatch.setenv(BUDGET_ENV, str(need - 1))
    with pytest.raises(ModelError, match=f"layers 10:20 need {need} bytes") as exc:
        load_weights(model_file, layers=(10, 20))
    assert f"{BUDGET_ENV} is {need - 1} bytes" in str(exc.value)
    # Exactly the bytes it needs is enough.
    monkeypatch.setenv(BUDGET_ENV, str(need))
    assert load_weights(model_file, layers=(10, 20)).memory()["held"] == need
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(InputError, match="not a byte count"):
        load_weights(model_file, layers=(10, 20))


def test_a_station_that_cannot_fit_its_range_refuses_at_start(model_path: Path) -> None:
    need = held_by(tensor_bytes(model_path), 0, 15, 30)
    mesh = LocalMesh(2, station_env={0: {BUDGET_ENV: str(need // 2)}}, startup_timeout=60)
    with pytest.raises(MeshError) as exc:
        mesh.start()
    mesh.close()
    message = " ".join(str(exc.value).split())  # the station's log wraps long lines
    assert "exited with code" in message, message
    assert re.search(rf"layers 0:15 with the token embedding need {need} bytes", message), message


def test_small_stations_share_the_cores_and_large_ones_get_them_all() -> None:
    # SmolLM2 over 28 stations (3.5 MB each) on 2 cores: one thread each, spins and wake-ups
    # of idle stations would take the busy one's core; qwen2-7b's single layers (172 MB): the
    # pass streams them from DRAM, both cores. A few stations (≤ 2 per core) get every core.
    assert station_threads(28, cores=2, station_bytes=98_362_432 // 28) == 1
    assert station_threads(2, cores=8, station_bytes=98_362_432 // 2) == 8
    assert station_threads(4, cores=2, station_bytes=98_362_432 // 4) == 2
    assert station_threads(5, cores=2, station_bytes=98_362_432 // 5) == 1
    assert station_threads(20, cores=8, station_bytes=98_362_432 // 20) == 1
    assert station_threads(28, cores=2, station_bytes=4_834_032_064 // 28) == 2
    assert station_threads(5, cores=2, station_bytes=WHOLE_HOST_STATION_BYTES) == 2
    assert station_threads(5, cores=2, station_bytes=WHOLE_HOST_STATION_BYTES - 1) == 1
