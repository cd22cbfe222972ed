"""Replicas and failover on a real mesh (SPEC §13): 2 layer ranges × 2 replicas, separate
station processes on loopback, real HTTP, stations killed with SIGKILL. After a failover the
tokens equal the single-process runtime's (greedy and seeded), whether the station died at an
open, a replay, a prefill chunk, a decode step or the step that captures the prompt's
volume; a range with no live replica fails clearly and emits no wrong token; a killed station
that comes back is taken back. The rebuild's premise — re-prefilling and re-decoding the kept
tokens reproduces the KV bit for bit — is checked on the core first."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from amplituhedron_rs import MeshError, Model, _core
from amplituhedron_rs.mesh import sessions
from amplituhedron_rs.mesh.coordinator import Coordinator
from amplituhedron_rs.mesh.engine import mesh_link
from amplituhedron_rs.mesh.executor import MeshExecutor
from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec, StationInfo
from amplituhedron_rs.mesh.station.drill import DIE_ON_ENV, parse, phase_of

pytestmark = [pytest.mark.model, pytest.mark.mesh]

TOKEN = "failover-test-token"
#: Station indices in the mesh (range-major): range 0 = stations 0, 1; range 1 = 2, 3.
ENTRY, ENTRY_SPARE, EXIT, EXIT_SPARE = 0, 1, 2, 3
PROMPT = [1, 504, 3458, 282, 4195, 314, 9581, 28, 16, 901, 38, 52, 2743, 418, 28, 88, 19, 7306]
SEEDED: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 7}


# --- the mesh file -------------------------------------------------------------------------
def test_a_mesh_file_lists_replicas_of_each_range() -> None:
    a, b = StationInfo("http://a", 0, 15), StationInfo("http://b", 0, 15)
    c, d = StationInfo("http://c", 15, 30), StationInfo("http://d", 15, 30)
    spec = MeshSpec.from_json({"stations": [vars(s) for s in (c, a, d, b)]})
    assert spec.ranges == ((a, b), (c, d))
    assert spec.chain == (a, c) and spec.replicas == 2 and spec.n_layers == 30
    with pytest.raises(MeshError, match="tile"):  # part of another replica's range
        MeshSpec((a, StationInfo("http://e", 0, 10), c))
    with pytest.raises(MeshError, match="tile"):  # layer 15 missing
        MeshSpec((a, b, StationInfo("http://e", 16, 30)))
    with pytest.raises(MeshError, match="twice"):
        MeshSpec((a, a, c))


def test_the_drill_is_off_unless_armed_and_classifies_phases() -> None:
    assert parse("capture:2") == ("capture", 2)
    with pytest.raises(ValueError):
        parse("lunch:1")

    def step(**entry: Any) -> bytes:
        import json

        head = json.dumps({"entries": [entry]}).encode()
        return len(head).to_bytes(4, "little") + head

    assert phase_of("POST", "/sessions", b"{}") == "open"
    assert phase_of("POST", "/amplituhedron/replay", b"{}") == "replay"
    last = step(kind="prefill", capture=True, last=True)
    assert phase_of("POST", "/batch/step", last) == "capture"
    # Every chunk of a cached prompt carries `capture` (for a long prompt's head).
    assert phase_of("POST", "/batch/step", step(kind="prefill", capture=True)) == "prefill"
    assert phase_of("POST", "/batch/step", step(kind="prefill")) == "prefill"
    assert phase_of("POST", "/batch/step", step(kind="decode")) == "decode"
    assert phase_of("GET", "/healthz", b"") is None


# --- the premise of the rebuild, on the core -------------------------------------------------
def test_re_prefill_and_re_decode_reproduce_the_kv_bit_for_bit(model: Model) -> None:
    """An undisturbed run (the prompt in chunks of 5, then one-row decode steps) and a
    rebuild (the prompt whole, then every emitted token as ONE multi-row decode entry) leave
    KV from which the next steps' hidden rows and logits are identical, at both ranges."""
    lo, mid, hi = 0, 15, 30
    emitted = [28, 16, 901, 38, 52, 2743, 418]
    after = [88, 19]  # steps after the rebuild point
    resp = _core.SpanType.RESPONSE_SENTENCE
    entry = _core.BatchForward(model.weights, lo, mid)
    exit_ = _core.BatchForward(model.weights, mid, hi)

    def run(chunks: list[list[int]], decode_rows: list[list[int]]) -> list[bytes]:
        e, x = model.new_session(lo, mid), model.new_session(mid, hi)
        for c in chunks:
            ((h, _),) = entry.run([e], [c], ["none"])
            exit_.run([x], [h], ["last"])
        for rows in decode_rows:
            ((h, _),) = entry.run([e], [rows], ["none"], [resp])
            exit_.run([x], [h], ["all"], [resp])
        out = []
        for t in after:
            ((h, _),) = entry.run([e], [[t]], ["none"], [resp])
            ((h2, logits),) = exit_.run([x], [h], ["last"], [resp])
            assert logits is not None
            out += [h.tobytes(), h2.tobytes(), logits.tobytes()]
        assert e.clock == x.clock == len(PROMPT) + len(emitted) + len(after)
        return out

    undisturbed = run([PROMPT[i : i + 5] for i in range(0, len(PROMPT), 5)], [[t] for t in emitted])
    rebuilt = run([PROMPT], [emitted])
    assert undisturbed == rebuilt


# --- failover on a live mesh -----------------------------------------------------------------
@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    m = LocalMesh(2, replicas=2, token=TOKEN)
    m.start()
    yield m
    m.close()


@pytest.fixture(scope="module")
def references(model: Model) -> dict[str, list[int]]:
    """What the single-process runtime emits for each request of the drills."""
    return {
        "greedy": model.generate(PROMPT, 12, use_cache=False, stop_at_eos=False).output_ids,
        "seeded": model.generate(
            PROMPT, 12, use_cache=False, stop_at_eos=False, **SEEDED
        ).output_ids,
        "greedy-short": model.generate(
            PROMPT[:9], 12, use_cache=False, stop_at_eos=False
        ).output_ids,
    }


def restore(mesh: LocalMesh) -> None:
    """Every station of the module's mesh running, unarmed (after a drill)."""
    for i in range(len(mesh.processes)):
        if not mesh.alive(i):
            mesh.restart_station(i, env={})


async def three_requests(spec: MeshSpec, *, chunk: int = 64, **kw: Any) -> tuple[Any, ...]:
    """A greedy, a seeded and a shorter greedy request in one batch; the outputs and the
    coordinator's failover stats."""
    async with Coordinator(spec, chunk=chunk, **kw) as c:
        gens = await asyncio.gather(
            c.generate(PROMPT, 12),
            c.generate(PROMPT, 12, **SEEDED),
            c.generate(PROMPT[:9], 12),
        )
        return [g.output_ids for g in gens], c.failover_stats()


@pytest.mark.parametrize(
    ("station", "phase"),
    [
        (ENTRY, "open:2"),
        (EXIT, "replay:1"),
        (ENTRY, "prefill:2"),
        (EXIT, "prefill:1"),
        (ENTRY, "capture:1"),
        (EXIT, "capture:1"),
        (ENTRY, "decode:3"),
        (EXIT, "decode:5"),
    ],
)
def test_a_station_killed_at_any_phase_fails_over_bit_identically(
    mesh: LocalMesh, references: dict[str, list[int]], station: int, phase: str
) -> None:
    """The primary of a range SIGKILLs itself on the n-th request of a phase (after doing
    the work, before answering); the replica takes over and every request of the batch
    emits exactly the single-process tokens."""
    assert mesh.spec is not None
    mesh.kill_station(station)
    mesh.restart_station(station, env={DIE_ON_ENV: phase})
    try:
        # A small chunk: the prompts take several prefill steps.
        outputs, stats = asyncio.run(three_requests(mesh.spec, chunk=4))
        assert not mesh.alive(station), "the drill did not fire"
        assert outputs == [references["greedy"], references["seeded"], references["greedy-short"]]
        assert stats["failovers"] == 1 and stats["stations_down"] >= 1
        if not phase.startswith(("open", "replay")):
            assert stats["rebuilt_sequences"] >= 1 and stats["added_ms_max"] > 0
    finally:
        restore(mesh)


def test_warm_cache_failover_replays_on_the_replica(
    mesh: LocalMesh, references: dict[str, list[int]]
) -> None:
    """Both replicas of the exit range hold the prompt's volume (each served it once); the
    exit primary dies mid-decode; the rebuild replays the volume on the spare instead of
    re-prefilling, and the tokens are still the single-process ones."""
    assert mesh.spec is not None
    spec = mesh.spec
    # Warm both replicas of range 1: one run on each (the other one down meanwhile).
    for down in (EXIT_SPARE, EXIT):
        mesh.kill_station(down)
        asyncio.run(three_requests(spec))
        mesh.restart_station(down, env={})
    mesh.kill_station(EXIT)
    mesh.restart_station(EXIT, env={DIE_ON_ENV: "decode:4"})
    try:
        outputs, stats = asyncio.run(three_requests(spec))
        assert not mesh.alive(EXIT)
        assert outputs == [references["greedy"], references["seeded"], references["greedy-short"]]
        assert stats["failovers"] == 1 and stats["rebuilt_sequences"] == 3
    finally:
        restore(mesh)


def test_a_range_with_no_live_replica_fails_clearly_then_comes_back(
    mesh: LocalMesh, references: dict[str, list[int]]
) -> None:
    """Both replicas of the exit range die mid-decode: the request fails with a MeshError
    naming the range, and every token it emitted before is the single-process one. Once a
    replica restarts on its port, the health checks take it back and the same coordinator
    serves again."""
    assert mesh.spec is not None
    spec = mesh.spec
    emitted: list[int] = []

    def kill_both(token: int) -> None:
        emitted.append(token)
        if len(emitted) == 3:
            mesh.kill_station(EXIT)
            mesh.kill_station(EXIT_SPARE)

    async def go() -> None:
        async with Coordinator(spec) as c:
            with pytest.raises(MeshError, match="no live replica of layers 15:30") as err:
                await c.generate(PROMPT, 12, on_token=kill_both)
            assert "decode step" in str(err.value)
            assert emitted == references["greedy"][:3]  # nothing after the failure
            stats = c.failover_stats()
            assert stats["stations_down"] == 2
            # The station comes back on its port: taken back, and serving again.
            await asyncio.to_thread(mesh.restart_station, EXIT_SPARE, env={})
            link = c._link
            assert await asyncio.to_thread(link.replicas.wait_live, spec.stations[3].url, 15)
            g = await c.generate(PROMPT, 12)
            assert g.output_ids == references["greedy"]
            assert c.failover_stats()["revivals"] >= 1

    try:
        asyncio.run(go())
    finally:
        restore(mesh)


def test_a_revived_station_is_taken_back_into_rotation(
    mesh: LocalMesh, references: dict[str, list[int]]
) -> None:
    """Entry primary dies → the spare serves; the primary restarts and is health-checked
    back; then the spare dies → the range fails over back to the revived station."""
    assert mesh.spec is not None
    spec = mesh.spec
    emitted: list[int] = []

    async def go() -> None:
        async with Coordinator(spec) as c:

            def kill(token: int) -> None:
                emitted.append(token)
                if len(emitted) == 2:
                    mesh.kill_station(ENTRY)

            g = await c.generate(PROMPT, 12, on_token=kill)
            assert g.output_ids == references["greedy"]
            await asyncio.to_thread(mesh.restart_station, ENTRY, env={})
            assert await asyncio.to_thread(c._link.replicas.wait_live, spec.stations[0].url, 15)
            emitted.clear()

            def kill_spare(token: int) -> None:
                emitted.append(token)
                if len(emitted) == 4:
                    mesh.kill_station(ENTRY_SPARE)

            g = await c.generate(PROMPT, 12, **SEEDED, on_token=kill_spare)
            assert g.output_ids == references["seeded"]
            assert c._link.chain().stations[0] == spec.stations[ENTRY]
            assert c.failover_stats()["failovers"] == 2

    try:
        asyncio.run(go())
    finally:
        restore(mesh)


def test_a_station_bounced_between_steps_changes_no_token(
    mesh: LocalMesh, references: dict[str, list[int]]
) -> None:
    """The entry primary is killed and restarted between two steps, before anyone sees it
    down (its pooled connections die with it, so the range fails over)."""
    assert mesh.spec is not None
    spec = mesh.spec
    emitted: list[int] = []

    def bounce(token: int) -> None:
        emitted.append(token)
        if len(emitted) == 3:
            # Blocks the coordinator's loop: no step runs until the station is back.
            mesh.kill_station(ENTRY)
            mesh.restart_station(ENTRY, env={})

    async def go() -> None:
        async with Coordinator(spec) as c:
            g = await c.generate(PROMPT, 12, **SEEDED, on_token=bounce)
            assert g.output_ids == references["seeded"]
            assert c.failover_stats()["failovers"] == 1

    try:
        asyncio.run(go())
    finally:
        restore(mesh)


def test_a_station_that_lost_a_session_rebuilds_it_in_place(
    mesh: LocalMesh, references: dict[str, list[int]]
) -> None:
    """The entry station no longer holds the sequence's session (as after a restart nobody
    saw, or an idle expiry): it answers 404, and the sequence is rebuilt on the same chain
    — no station is marked down, no replica needed — with the same tokens."""
    assert mesh.spec is not None
    spec = mesh.spec
    emitted: list[int] = []

    async def go() -> None:
        async with Coordinator(spec) as c:
            executor = c._engine.executor

            def drop(token: int) -> None:
                emitted.append(token)
                if len(emitted) == 3:
                    (state,) = executor.seqs.values()
                    url = f"{spec.stations[ENTRY].url}/sessions/{state.ids()[0]}"
                    auth = {"Authorization": f"Bearer {TOKEN}"}
                    req = urllib.request.Request(url, method="DELETE", headers=auth)
                    assert urllib.request.urlopen(req, timeout=10).status == 200

            g = await c.generate(PROMPT, 12, on_token=drop)
            assert g.output_ids == references["greedy"]
            stats = c.failover_stats()
            assert stats["failovers"] == 1 and stats["rebuilt_sequences"] == 1
            assert stats["stations_down"] == 0  # rebuilt in place
            assert c._link.chain().stations[0] == spec.stations[ENTRY]

    asyncio.run(go())


def test_a_mesh_checked_with_a_replica_down_starts_on_the_others(
    mesh: LocalMesh, references: dict[str, list[int]]
) -> None:
    assert mesh.spec is not None
    mesh.kill_station(ENTRY)
    try:
        started = time.monotonic()
        outputs, stats = asyncio.run(three_requests(mesh.spec))
        assert outputs[0] == references["greedy"]
        assert stats["failovers"] == 0 and stats["stations_down"] == 1
        assert time.monotonic() - started < 30
    finally:
        restore(mesh)


def test_logits_after_a_failover_equal_the_single_process_ones(
    mesh: LocalMesh, model: Model, references: dict[str, list[int]]
) -> None:
    """Stepping the executor by hand (no concurrency): the exit primary dies mid-decode; once
    the sequence is rebuilt on the replica, the next row forwarded through its sessions has
    the single-process logits bit for bit; then generation goes on to the reference tokens
    (the engine's next step rolls the probed row back on every station)."""
    assert mesh.spec is not None
    spec = mesh.spec
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def probe(chain: tuple[StationInfo, ...], sids: list[str], token: int) -> np.ndarray:
        body = np.asarray([token], dtype="<u4").tobytes()
        with httpx.Client(timeout=60, headers=auth) as h:
            for i, (s, sid) in enumerate(zip(chain, sids, strict=True)):
                last = i == len(chain) - 1
                r = h.post(
                    f"{s.url}/sessions/{sid}/forward",
                    content=body,
                    params={
                        "logits": "all" if last else "none",
                        "hidden": "none" if last else "all",
                    },
                    headers={"Content-Type": "application/octet-stream"},
                )
                r.raise_for_status()
                body = r.content
        return np.frombuffer(body, dtype="<f4")

    async def go() -> None:
        engine = _core.Engine.external(max_running=4, max_queue=8, step_tokens=64)
        ex = MeshExecutor(engine, mesh_link(spec, None, 60.0))
        ex.link.http.open()
        try:
            await sessions.check_mesh(ex.link)
            seq = engine.submit(PROMPT, 12, greedy=True, seed=0, use_cache=False)
            out: list[int] = []
            probed = False
            while engine.has_work:
                for ev in await ex.step():
                    if ev.kind == "token" and ev.token is not None:
                        out.append(ev.token)
                if len(out) == 4 and mesh.alive(EXIT):
                    mesh.kill_station(EXIT)
                if len(out) >= 7 and not probed and seq in ex.seqs:
                    state = ex.seqs[seq]
                    assert state.chain is not None
                    assert state.chain.stations[1] == spec.stations[EXIT_SPARE]  # rebuilt
                    tokens = list(state.tokens)
                    got = await asyncio.to_thread(
                        probe, state.chain.stations, state.ids(), tokens[-1]
                    )
                    np.testing.assert_array_equal(got, model.logits_all(tokens)[-1])
                    probed = True
            assert probed and out == references["greedy"]
            assert ex.stats()["failovers"] == 1
        finally:
            await ex.close()
            ex.link.replicas.close()
            await ex.link.http.close()

    try:
        asyncio.run(go())
    finally:
        restore(mesh)


def opens(url: str) -> int:
    """Sessions a station has opened (from its own /metrics)."""
    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    return sum(
        int(float(line.split()[-1]))
        for line in text.splitlines()
        if line.startswith("amplituhedron_requests_total")
        and 'endpoint="/sessions"' in line
        and 'status="201"' in line
    )


def test_an_entry_failover_keeps_the_later_ranges_sessions(
    mesh: LocalMesh, references: dict[str, list[int]]
) -> None:
    """The entry primary dies mid-decode: only range 0 is rebuilt (on its replica); the exit
    station keeps the three sequences' sessions (no session reopened there) and never
    recomputes their positions, and the tokens are still the single-process ones."""
    assert mesh.spec is not None
    spec = mesh.spec
    mesh.kill_station(ENTRY)
    mesh.restart_station(ENTRY, env={DIE_ON_ENV: "decode:5"})
    before = opens(spec.stations[EXIT].url)
    try:
        outputs, stats = asyncio.run(three_requests(spec))
        assert not mesh.alive(ENTRY)
        assert outputs == [references["greedy"], references["seeded"], references["greedy-short"]]
        assert stats["failovers"] == 1 and stats["rebuilt_sequences"] == 3
        assert opens(spec.stations[EXIT].url) - before == 3  # one per sequence, none again
    finally:
        restore(mesh)
