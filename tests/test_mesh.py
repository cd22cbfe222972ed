"""A real 3-station mesh on loopback (separate processes, real HTTP) against the
single-process runtime: identical tokens and logits, the all-hit branch, unique prompts,
a station killed mid-session, and the erasure path over the wire."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from amplituhedron_rs import MeshError, Model
from amplituhedron_rs.mesh.coordinator import Coordinator, MeshGeneration
from amplituhedron_rs.mesh.launcher import (
    LocalMesh,
    MeshSpec,
    get_json,
    split_layers,
    wait_healthy,
)
from amplituhedron_rs.mesh.station.stream import ENDPOINT as STREAM_ENDPOINT

pytestmark = [pytest.mark.model, pytest.mark.mesh]

TOKEN = "mesh-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def mesh() -> Iterator[MeshSpec]:
    with LocalMesh(3, token=TOKEN, station_args=["--fault-injection"]) as spec:
        yield spec


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _generate(mesh: MeshSpec, ids: list[int], n: int, **kw: Any) -> MeshGeneration:
    async with Coordinator(mesh) as c:  # the mesh carries its token
        return await c.generate(ids, n, **kw)


async def _clear(mesh: MeshSpec) -> None:
    async with Coordinator(mesh) as c:  # the mesh carries its token
        await c.clear()


def step_requests(mesh: MeshSpec) -> int:
    """Batched steps that reached any station, from the stations' own /metrics."""
    total = 0
    for s in mesh.stations:
        request = urllib.request.Request(f"{s.url}/metrics", headers=AUTH)
        text = urllib.request.urlopen(request).read().decode()
        for line in text.splitlines():
            if line.startswith("amplituhedron_requests_total") and any(
                f'endpoint="{e}"' in line for e in ("/batch/step", STREAM_ENDPOINT)
            ):
                total += int(float(line.split()[-1]))
    return total


def test_split_layers_tiles_the_model() -> None:
    assert split_layers(30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(MeshError):
        split_layers(30, 31)
    with pytest.raises(MeshError, match="tile"):
        MeshSpec.from_json({"stations": [{"url": "http://a", "layer_lo": 1, "layer_hi": 30}]})


def test_mesh_equals_single_process_cache_off_and_on(
    mesh: MeshSpec, model: Model, prompts: dict[str, Any]
) -> None:
    ids = prompts["chat"]["token_ids"]
    single = model.generate(ids, 16, use_cache=False, stop_at_eos=False)
    run(_clear(mesh))
    cold = run(_generate(mesh, ids, 16, use_cache=False))
    first = run(_generate(mesh, ids, 16))
    warm = run(_generate(mesh, ids, 16))
    assert cold.output_ids == first.output_ids == warm.output_ids == single.output_ids
    assert [v.replay for v in first.stations] == ["miss"] * 3
    assert [v.replay for v in warm.stations] == ["hit"] * 3 and warm.cache_hit


def test_mesh_logits_are_bit_identical(
    mesh: MeshSpec, model: Model, prompts: dict[str, Any]
) -> None:
    """Drive the stations by hand: the exit station's logits equal the single process's."""
    import httpx

    ids = prompts["rust"]["token_ids"]
    with httpx.Client(timeout=60, headers=AUTH) as c:
        sids = []
        for s in mesh.stations:
            r = c.post(f"{s.url}/sessions", json={"prompt_tokens": ids})
            r.raise_for_status()
            sids.append(r.json()["session_id"])
        body = np.asarray(ids, dtype="<u4").tobytes()
        for i, (s, sid) in enumerate(zip(mesh.stations, sids, strict=True)):
            last = i == len(mesh.stations) - 1
            r = c.post(
                f"{s.url}/sessions/{sid}/forward",
                content=body,
                params={"logits": "all" if last else "none", "hidden": "none" if last else "all"},
                headers={"Content-Type": "application/octet-stream"},
            )
            r.raise_for_status()
            body = r.content
        logits = np.frombuffer(body, dtype="<f4").reshape(len(ids), -1)
        for s, sid in zip(mesh.stations, sids, strict=True):
            c.delete(f"{s.url}/sessions/{sid}")
    np.testing.assert_array_equal(logits, model.logits_all(ids))


def test_second_session_takes_the_all_hit_branch_without_prefill(
    mesh: MeshSpec, prompts: dict[str, Any]
) -> None:
    ids = prompts["json"]["token_ids"]
    run(_clear(mesh))
    first = run(_generate(mesh, ids, 4))
    before = step_requests(mesh)
    second = run(_generate(mesh, ids, 4))
    assert not first.cache_hit and second.cache_hit
    assert all(v.prefill_requests == 0 for v in second.stations)
    assert all(v.prefill_requests > 0 for v in first.stations)
    # Only the 3 decode steps reached the stations (the first token came from the cached
    # logits), one request per station per step.
    assert step_requests(mesh) - before == 3 * len(mesh.stations), "a prefill step ran"
    assert second.output_ids == first.output_ids

    async def stats() -> list[dict[str, Any]]:
        async with Coordinator(mesh) as c:
            return await c.stats()

    assert all(s["hits"] >= 1 for s in run(stats()))


def test_unique_prompts_never_hit(mesh: MeshSpec) -> None:
    run(_clear(mesh))
    for k in range(4):
        g = run(_generate(mesh, [100 + k, 200 + k, 300 + k, 400], 2))
        assert not g.cache_hit and all(v.replay == "miss" for v in g.stations)


def test_erasure_over_the_wire(mesh: MeshSpec, model: Model, prompts: dict[str, Any]) -> None:
    import httpx

    ids = prompts["sentence"]["token_ids"]
    run(_clear(mesh))
    reference = run(_generate(mesh, ids, 6))
    # Damage the trailing position of the middle station's volume.
    r = httpx.post(
        f"{mesh.stations[1].url}/debug/damage",
        json={"prompt_tokens": ids, "position": len(ids) - 1},
        headers=AUTH,
    )
    assert r.status_code == 200 and r.json() == {"damaged": True}
    g = run(_generate(mesh, ids, 6))
    assert [v.replay for v in g.stations][1] == "partial"
    assert g.replayed_tokens == len(ids) - 1 and not g.cache_hit
    assert g.output_ids == reference.output_ids


def test_a_station_killed_mid_session_fails_clearly() -> None:
    # A dedicated mesh: this test kills one of its stations.
    mesh = LocalMesh(3)
    spec = mesh.start()
    try:
        killed: list[int] = []

        def kill_after_two(token: int) -> None:
            killed.append(token)
            if len(killed) == 2:
                mesh.kill_station(1)

        with pytest.raises(MeshError, match=re.escape(spec.stations[1].url)) as err:
            run(_generate(spec, [12615, 36411, 418, 582, 3822], 8, on_token=kill_after_two))
        assert "decode step" in str(err.value)
        assert len(killed) == 2  # no token was emitted after the failure
    finally:
        mesh.close()


def test_sampled_generation_matches_single_process(
    mesh: MeshSpec, model: Model, prompts: dict[str, Any]
) -> None:
    ids = prompts["sentence"]["token_ids"]
    kw: dict[str, Any] = {
        "temperature": 0.8,
        "top_k": 30,
        "top_p": 0.9,
        "seed": 42,
    }
    single = model.generate(ids, 10, use_cache=False, stop_at_eos=False, **kw)
    g = run(_generate(mesh, ids, 10, **kw))
    assert g.output_ids == single.output_ids


def test_longest_prefix_replay_over_the_wire(
    mesh: MeshSpec, model: Model, prompts: dict[str, Any]
) -> None:
    system = prompts["long"]["text"][:600]
    first = model.chat_ids(system, "What does the keeper do every evening?")
    second = model.chat_ids(system, "Why is the lens polished?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    run(_clear(mesh))
    cold = model.generate(second, 6, use_cache=False, stop_at_eos=False)
    run(_generate(mesh, first, 2))
    g = run(_generate(mesh, second, 6))
    assert [v.replay for v in g.stations] == ["partial"] * 3
    assert g.replayed_tokens == shared and not g.cache_hit
    assert g.output_ids == cold.output_ids
    assert all(v.captured_bytes > 0 for v in g.stations)  # the full second chat is captured


def test_generate_no_cache_over_a_mesh_skips_the_cache_for_that_run_only(
    mesh: MeshSpec, capsys: pytest.CaptureFixture[str]
) -> None:
    from amplituhedron_rs.cli import main

    ids = [12615, 36411, 418, 582, 3822, 5027]
    run(_clear(mesh))
    urls = ",".join(s.url for s in mesh.stations)
    argv = ["generate", "--mesh", urls, "--token", TOKEN, "--prompt-ids", ",".join(map(str, ids))]
    assert main([*argv, "--max-tokens", "3", "--json", "--no-cache"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert [v["replay"] for v in json.loads(line)["cache"]["stations"]] == ["off"] * 3
    # The stations' caches are still on: the next runs capture, then replay.
    first = run(_generate(mesh, ids, 3))
    second = run(_generate(mesh, ids, 3))
    assert not first.cache_hit and all(v.captured_bytes > 0 for v in first.stations)
    assert second.cache_hit and second.output_ids == first.output_ids


def test_a_local_mesh_keeps_no_descriptor_of_its_station_logs(mesh: MeshSpec) -> None:
    """The station processes own their log files; the launcher closed its copies."""
    fds = Path("/proc/self/fd")
    targets = []
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            targets.append(os.readlink(fd))
    assert not [t for t in targets if "amplituhedron-mesh-" in t and t.endswith(".log")]


def test_speculation_over_the_mesh_equals_plain_decoding(mesh: MeshSpec, model: Model) -> None:
    """Verify steps carry k+1 rows through each station in one hop; rejected drafts are
    rolled back on every station; the greedy tokens are plain decoding's."""
    text = "\n".join(f"- step {i}: open the valve, wait, close the valve" for i in range(10))
    ids = model.tokenizer.encode(text + "\n- step 10:")
    single = model.generate(ids, 40, use_cache=False, stop_at_eos=False)
    plain = run(_generate(mesh, ids, 40, use_cache=False))
    spec = run(_generate(mesh, ids, 40, use_cache=False, draft="prompt-lookup"))
    assert spec.output_ids == plain.output_ids == single.output_ids
    assert 0 < spec.draft_accepted < spec.draft_proposed, (spec.draft_accepted, spec.draft_proposed)
    assert spec.verify_steps < len(spec.output_ids) - 1  # fewer hops than tokens


def test_a_reply_that_is_not_http_is_a_station_not_yet_healthy() -> None:
    """A socket polling an ephemeral loopback port before its station listens can connect to
    itself and read back its own request line: health polls treat that as "not up yet" and
    keep polling (a clear MeshError at the deadline), never an unhandled BadStatusLine."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"

        def echo_requests() -> None:
            # Answers every connection with the bytes it sent, as a self-connected socket does.
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = server.accept()
                    with conn:
                        conn.sendall(conn.recv(4096))

        threading.Thread(target=echo_requests, daemon=True).start()
        with pytest.raises(ConnectionError, match="did not answer in HTTP"):
            get_json(f"{url}/healthz", timeout=2)
        with pytest.raises(MeshError, match="not healthy after"):
            wait_healthy([url], timeout=0.5)
