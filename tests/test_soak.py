"""A bounded soak of a real 2-station mesh (issue 10): 16 concurrent clients generating
through the coordinator, a quarter of their calls cut off mid-flight (the connection drops,
as when a client dies), and some sessions simply abandoned. Afterwards: no 5xx in the
stations' own request counters, no session left once the idle timeout has passed, RSS flat
after warm-up, and /healthz fast throughout.

CI runs a 20-second form; the full two minutes is

    AMPLITUHEDRON_SOAK_S=120 .venv/bin/pytest -m soak -s tests/test_soak.py
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from amplituhedron_rs.mesh.coordinator import Coordinator
from amplituhedron_rs.mesh.launcher import LocalMesh

pytestmark = [pytest.mark.model, pytest.mark.mesh, pytest.mark.soak]

CLIENTS = 16
# Generous: the soak runs on shared CI machines, where a process may stall for seconds.
IDLE_S = 10
SECONDS = float(os.environ.get("AMPLITUHEDRON_SOAK_S", "20"))
PROMPTS = [
    [12615, 36411, 418, 582, 3822, 5027, 20590, 418],
    [1, 12615, 36411, 418, 582, 3822, 5027, 20590, 418, 314, 253, 1345] * 3,
    [504, 3458, 282, 253, 1345, 314],
]


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    # Room for every client plus the sessions left behind until the idle sweep (abandoned
    # ones, and opens whose caller was cut off before reading the answer): no 503 is
    # expected (back-pressure has its own test, test_station_security's failed-open test).
    args = ["--max-sessions", str(4 * CLIENTS), "--session-idle", str(IDLE_S)]
    m = LocalMesh(2, station_args=args)
    m.start()
    yield m
    m.close()


PROBE = """
import sys, time, httpx
stop = time.monotonic() + float(sys.argv[1])
with httpx.Client(timeout=10) as c:
    while time.monotonic() < stop:
        for url in sys.argv[2:]:
            t = time.perf_counter()
            assert c.get(url + "/healthz").status_code == 200
            print(time.perf_counter() - t, flush=True)
        time.sleep(0.1)
"""


def rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+) kB", text)
    assert match is not None
    return int(match.group(1)) / 1024


def server_errors(c: httpx.Client, url: str) -> dict[str, float]:
    """5xx answers by endpoint, from the station's own counters (every response it sent,
    including those no client stayed to read)."""
    out: dict[str, float] = {}
    for line in c.get(f"{url}/metrics").text.splitlines():
        m = re.match(
            r'amplituhedron_requests_total\{endpoint="([^"]*)",status="(5\d\d)"\} (.*)', line
        )
        if m and float(m.group(3)) > 0:
            out[f"{m.group(1)} {m.group(2)}"] = float(m.group(3))
    return out


def test_soak_16_clients_with_random_disconnects(mesh: LocalMesh) -> None:
    spec = mesh.spec
    assert spec is not None and spec.token is not None
    auth = {"Authorization": f"Bearer {spec.token}"}
    counts = {"done": 0, "cut": 0, "abandoned": 0}
    rss: list[list[float]] = []

    async def client(seed: int, coordinator: Coordinator, stop: float) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(timeout=30, headers=auth) as raw:
            while time.monotonic() < stop:
                prompt = rng.choice(PROMPTS)
                if rng.random() < 0.3:  # a unique tail: misses, prefills, captures
                    prompt = [*prompt, rng.randrange(100, 40000)]
                call = coordinator.generate(
                    prompt, rng.randint(1, 12), use_cache=rng.random() < 0.8
                )
                roll = rng.random()
                try:
                    if roll < 0.25:
                        # Cut off mid-flight: the in-flight request's connection is dropped.
                        await asyncio.wait_for(call, timeout=rng.uniform(0.01, 0.3))
                    else:
                        await call
                    counts["done"] += 1
                except TimeoutError:
                    counts["cut"] += 1
                if roll > 0.95:
                    # A client that opens a session and vanishes (the idle sweep's job).
                    r = await raw.post(
                        f"{spec.stations[0].url}/sessions", json={"prompt_tokens": [1]}
                    )
                    assert r.status_code == 201, r.text
                    counts["abandoned"] += 1

    async def watch(stop: float) -> None:
        while time.monotonic() < stop:
            rss.append([rss_mb(p.pid) for p in mesh.processes])
            await asyncio.sleep(0.25)

    async def run() -> None:
        stop = time.monotonic() + SECONDS
        async with Coordinator(spec, timeout=60, open_deadline=30) as coordinator:
            await asyncio.gather(
                watch(stop), *(client(i, coordinator, stop) for i in range(CLIENTS))
            )

    # /healthz is timed from its own process: the clients' event loop would add its delays.
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE, str(SECONDS), *(s.url for s in spec.stations)],
        stdout=subprocess.PIPE,
        text=True,
    )
    asyncio.run(run())
    out, _ = probe.communicate(timeout=60)
    healthz = [float(x) for x in out.split()]
    with httpx.Client(timeout=30, headers=auth) as c:
        errors = {s.url: server_errors(c, s.url) for s in spec.stations}
        deadline = time.monotonic() + IDLE_S + 10
        while time.monotonic() < deadline:
            left = [c.get(f"{s.url}/sessions").json()["live"] for s in spec.stations]
            if left == [0, 0]:
                break
            time.sleep(0.25)
    third = max(1, len(rss) // 3)
    warm = [max(col) for col in zip(*rss[third : 2 * third], strict=True)]
    late = [max(col) for col in zip(*rss[2 * third :], strict=True)]
    lat = sorted(healthz)
    p50, p90, worst = lat[len(lat) // 2], lat[int(len(lat) * 0.9)], lat[-1]
    print(
        f"\nsoak {SECONDS:.0f} s, {CLIENTS} clients: {counts}; RSS MB warm {warm} late {late}; "
        f"/healthz p50 {p50 * 1e3:.1f} ms p90 {p90 * 1e3:.1f} ms max {worst * 1e3:.1f} ms"
    )
    assert counts["done"] >= CLIENTS and counts["cut"] > 0
    assert errors == {s.url: {} for s in spec.stations}, errors
    assert left == [0, 0], f"sessions leaked: {left}"
    for w, late_mb in zip(warm, late, strict=True):
        assert late_mb <= w * 1.10 + 32, (warm, late)
    # The median, not every probe: on a loaded shared machine the whole process can stall
    # (an event loop that waits on a session lock fails this at once: issue 10 saw 12.5 s).
    assert p50 <= 0.05, lat
