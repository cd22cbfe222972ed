"""A bounded soak of the OpenAI server (issue 45): 16 concurrent clients over real HTTP,
mixing good requests (plain and streamed), clients that disconnect mid-stream, and bad
requests of every kind. Afterwards: no 5xx anywhere, no request hung, every good request's
reply equals the same request run alone (greedy: batched ≡ alone), no sequence left holding
KV, and RSS flat after warm-up.

CI runs a 20-second form; the full two minutes is

    AMPLITUHEDRON_SOAK_S=120 .venv/bin/pytest -m soak -s tests/test_serve_soak.py
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from test_serve import KEY, Server, start_server
from test_soak import SECONDS, rss_mb

pytestmark = [pytest.mark.model, pytest.mark.serve, pytest.mark.soak]

CLIENTS = 16
AUTH = {"Authorization": f"Bearer {KEY}"}
USERS = [
    "Is it windy in Lyon today?",
    "Name three rivers.",
    "Summarise the forecast in one word.",
    "What should I wear when it rains?",
]
SYSTEM = "You are a careful assistant for a weather service. Answer briefly."
#: Bodies every one of which must be refused with a 4xx.
BAD: list[bytes] = [
    b"{not json",
    b'{"model": "m", "messages": []}',
    b'{"messages": [{"role": "user", "content": "a\\ud800"}], "model": "%s"}',
    b'{"messages": [{"role": "user", "content": "x"}], "model": "%s", "temperature": NaN}',
    b'{"prompt": "x", "model": "%s", "top_k": 4294967295, "temperature": 1}',
    b'{"prompt": "x", "model": "%s", "max_tokens": 100000000}',
    b'{"prompt": [99999999], "model": "%s"}',
    b'{"prompt": "x", "model": "%s", "n": 3}',
    b'{"prompt": "x", "model": "no-such-model"}',
]


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    with start_server("--max-batch", "8", "--max-queue", "64") as server:
        yield server


def body_of(model: str, user: str, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 12,
        "stream": stream,
    }


async def reply(c: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[int, str]:
    """Status and text of a chat completion, plain or streamed (SSE assembled)."""
    if not body["stream"]:
        r = await c.post(f"{url}/v1/chat/completions", json=body)
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
        return r.status_code, text
    parts: list[str] = []
    async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            for choice in event["choices"]:
                parts.append(choice["delta"].get("content") or "")
    return 200, "".join(parts)


def test_soak_16_clients_with_disconnects_and_bad_requests(srv: Server) -> None:
    model = srv.model()
    counts = {"good": 0, "cut": 0, "bad": 0}
    statuses: dict[int, int] = {}
    rss: list[float] = []

    async def run() -> dict[str, str]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
            # Each prompt alone first: the reference every batched reply must equal.
            alone = {u: (await reply(c, srv.url, body_of(model, u, False)))[1] for u in USERS}
            stop = time.monotonic() + SECONDS
            await asyncio.gather(watch(stop), *(client(i, c, stop, alone) for i in range(CLIENTS)))
            return alone

    async def watch(stop: float) -> None:
        while time.monotonic() < stop:
            rss.append(rss_mb(srv.process.pid))
            await asyncio.sleep(0.25)

    async def client(seed: int, c: httpx.AsyncClient, stop: float, alone: dict[str, str]) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            roll = rng.random()
            if roll < 0.2:
                raw = rng.choice(BAD).replace(b"%s", model.encode())
                r = await c.post(
                    f"{srv.url}/v1/chat/completions"
                    if b"messages" in raw
                    else f"{srv.url}/v1/completions",
                    content=raw,
                    headers={"Content-Type": "application/json"},
                )
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert 400 <= r.status_code < 500, (raw, r.status_code, r.text)
                counts["bad"] += 1
                continue
            user = rng.choice(USERS)
            body = body_of(model, user, stream=rng.random() < 0.5)
            if roll < 0.45:
                # A client that leaves mid-generation: the connection is dropped.
                try:
                    await asyncio.wait_for(
                        reply(c, srv.url, {**body, "stream": True}), rng.uniform(0.02, 0.3)
                    )
                except TimeoutError:
                    counts["cut"] += 1
                continue
            status, text = await asyncio.wait_for(reply(c, srv.url, body), 120)
            statuses[status] = statuses.get(status, 0) + 1
            assert status == 200, text
            assert text == alone[user], (user, text, alone[user])
            counts["good"] += 1

    asyncio.run(run())
    live = 1.0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        live = srv.metric("amplituhedron:live_sequences")
        if live == 0:
            break
        time.sleep(0.25)
    third = max(1, len(rss) // 3)
    warm, late = max(rss[third : 2 * third]), max(rss[2 * third :])
    print(f"\nserver soak {SECONDS:.0f} s: {counts}; statuses {statuses}; RSS {warm} → {late} MB")
    assert counts["good"] >= CLIENTS and counts["cut"] > 0 and counts["bad"] > 0, counts
    assert all(s < 500 for s in statuses), statuses
    assert live == 0, f"{live} sequences still hold KV"
    assert late <= warm * 1.10 + 32, (warm, late)
    health = httpx.get(f"{srv.url}/health", timeout=10)
    assert health.status_code == 200, health.text
