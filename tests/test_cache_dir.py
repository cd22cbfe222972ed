"""Persistent volumes through the product's own entry points: ``load_model(cache_dir=…)``
in one process and then another, and a station started with ``--cache-dir`` that is
stopped and started again. Each restart must serve its first request from disk, with the
tokens of a run that never cached anything."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import amplituhedron_rs as ar
from amplituhedron_rs.mesh.launcher import LocalMesh

pytestmark = [pytest.mark.model]

QUESTION = ("You are a terse assistant for a library.", "Which shelf holds atlases?")

# One process: load with a cache directory, generate once, report what happened.
CHILD = textwrap.dedent(
    """
    import json, sys
    import amplituhedron_rs as ar

    m = ar.load_model(cache_dir=sys.argv[1])
    g = m.generate(m.chat_ids(*json.loads(sys.argv[2])), 6)
    print(json.dumps({"hit": g.cache_hit, "ids": g.output_ids, "stats": m.cache_stats()}))
    """
)


def run_child(cache_dir: Path) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache_dir), json.dumps(QUESTION)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_new_process_serves_its_first_request_from_the_cache_dir(
    model: ar.Model, tmp_path: Path
) -> None:
    plain = model.generate(model.chat_ids(*QUESTION), 6, use_cache=False).output_ids
    first = run_child(tmp_path)
    assert first["hit"] is False and first["ids"] == plain
    # One subdirectory per model fingerprint, one per layer range under it.
    (range_dir,) = (tmp_path / f"{model.fingerprint:016x}").iterdir()
    assert range_dir.name == f"layers-0-{model.n_layers}"
    assert list(range_dir.glob("*.vol"))
    second = run_child(tmp_path)
    assert second["hit"] is True and second["ids"] == plain


def test_a_restarted_station_replays_from_its_cache_dir(model: ar.Model, tmp_path: Path) -> None:
    ids = model.chat_ids(*QUESTION)
    plain = model.generate(ids, 6, use_cache=False).output_ids

    async def once(mesh: ar.MeshSpec) -> tuple[bool, list[int]]:
        async with ar.Coordinator(mesh) as c:
            g = await c.generate(ids, 6)
            return g.cache_hit, g.output_ids

    disk = ["--cache-dir", str(tmp_path)]
    with LocalMesh(2, station_args=disk) as mesh:
        assert asyncio.run(once(mesh)) == (False, plain)
    # Both stations persisted their own range of the same model.
    ranges = sorted(p.name for p in (tmp_path / f"{model.fingerprint:016x}").iterdir())
    assert len(ranges) == 2
    with LocalMesh(2, station_args=disk) as mesh:
        assert asyncio.run(once(mesh)) == (True, plain)
