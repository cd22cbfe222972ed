"""The step stream (framed batched steps on persistent TCP, mesh/protocol.py) over raw
sockets to real station processes: the edge rules of the HTTP surface hold (the token on
every frame, checked before a byte of the body is read; lengths refused before they are read;
a connection cap), a refused step changes nothing and leaves the connection usable, and the
mesh emits the single-process tokens over the stream, over HTTP only, and with a prompt cut
into pipelined pieces."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from amplituhedron_rs import Model
from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh.coordinator import Coordinator
from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec
from amplituhedron_rs.mesh.pipeline import cut, merge

pytestmark = [pytest.mark.model, pytest.mark.mesh]

PROMPT = [12615, 36411, 418, 582, 3822, 5027, 20590, 418, 314, 253, 1345, 28, 16, 901]
MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    # One thread per station, as in a mesh of many small stations: a station's stream thread
    # then runs its passes itself (the two-thread case is every other mesh test's).
    m = LocalMesh(2, station_args=["--max-connections", str(MAX_CONNECTIONS)], threads=1)
    m.start()
    yield m
    m.close()


def spec_of(m: LocalMesh) -> MeshSpec:
    assert m.spec is not None
    return m.spec


def stream_port(url: str) -> int:
    port = httpx.get(f"{url}/healthz").json()["stream_port"]
    assert isinstance(port, int) and port > 0
    return port


def connect(url: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", stream_port(url)), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def answer(s: socket.socket) -> tuple[int, Any, bytes]:
    """One answer frame: status, JSON header, payload."""
    data = b""
    while len(data) < wire.STREAM_PREFIX.size:
        chunk = s.recv(65536)
        assert chunk, "the station closed the connection without an answer"
        data += chunk
    magic, status, n_head, n_payload = wire.STREAM_PREFIX.unpack_from(data)
    assert magic == wire.STREAM_MAGIC
    end = wire.STREAM_PREFIX.size + n_head + n_payload
    while len(data) < end:
        chunk = s.recv(65536)
        assert chunk
        data += chunk
    head = data[wire.STREAM_PREFIX.size : wire.STREAM_PREFIX.size + n_head]
    return status, json.loads(head), data[wire.STREAM_PREFIX.size + n_head : end]


def closed(s: socket.socket) -> bool:
    s.settimeout(10)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def step(token: str, entries: list[dict[str, Any]], payload: bytes = b"") -> bytes:
    head = json.dumps({"entries": entries}).encode()
    return wire.stream_request(token.encode(), head, payload)


def open_session(url: str, token: str) -> str:
    r = httpx.post(
        f"{url}/sessions",
        json={"prompt_tokens": PROMPT},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 201, r.text
    sid: str = r.json()["session_id"]
    return sid


def test_the_step_stream_refuses_the_attacks(mesh: LocalMesh) -> None:
    spec = spec_of(mesh)
    entry, token = spec.stations[0], spec.token
    assert token is not None
    sid = open_session(entry.url, token)
    whole = {"session_id": sid, "start": 0, "tokens": PROMPT, "kind": "prefill"}
    whole |= {"last": True}
    # No token, a wrong one, one longer than any token: 401 and the connection closes. The
    # prefix declares a 1 MiB payload that never comes: the refusal does not wait for it.
    big = 1 << 20
    for given in (b"", b"wrong", b"x" * (wire.MAX_TOKEN_BYTES + 1)):
        with connect(entry.url) as s:
            s.sendall(wire.STREAM_PREFIX.pack(wire.STREAM_MAGIC, len(given), 10, big) + given)
            status, body, _ = answer(s)
            assert status == 401 and "token" in body["detail"]
            assert closed(s)
    # Lengths past the limits: 413 before a byte of the body is read.
    for n_head, n_payload in ((2 << 20, 0), (100, 17 << 20)):
        with connect(entry.url) as s:
            prefix = wire.STREAM_PREFIX.pack(wire.STREAM_MAGIC, len(token), n_head, n_payload)
            s.sendall(prefix + token.encode())
            status, body, _ = answer(s)
            assert status == 413 and "limit" in body["detail"]
            assert closed(s)
    # Not a frame (an HTTP request to the stream port): 400 and closed.
    with connect(entry.url) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body, _ = answer(s)
        assert status == 400 and "frame" in body["detail"]
        assert closed(s)
    # Refused steps keep the connection (each frame was read whole) and change nothing.
    with connect(entry.url) as s:
        s.sendall(wire.stream_request(token.encode(), b"{not json"))
        status, body, _ = answer(s)
        assert status == 400 and "header" in body["detail"]
        s.sendall(step(token, [{**whole, "session_id": "A" * 32}]))
        assert answer(s)[0] == 404
        s.sendall(step(token, [{**whole, "tokens": [*PROMPT[:-1], 7000]}]))
        status, body, _ = answer(s)
        assert status == 409 and "prompt" in body["detail"]
        s.sendall(step(token, [{**whole, "tokens": [1] * 257, "last": False}]))
        status, body, _ = answer(s)
        assert status == 413 and "rows per entry" in body["detail"]
        s.sendall(step(token, [whole], payload=b"\0" * 8))
        status, body, _ = answer(s)
        assert status == 400 and "payload" in body["detail"]
        # Then the same connection runs the step: the session held none of the above.
        s.sendall(step(token, [whole]))
        status, body, rows = answer(s)
        assert status == 200, body
        assert body["entries"][0]["clock"] == len(PROMPT)
        assert len(rows) == len(PROMPT) * 576 * 4  # the entry station's hidden rows
    metrics = httpx.get(f"{entry.url}/metrics", headers={"Authorization": f"Bearer {token}"})
    assert 'endpoint="stream:/batch/step",status="401"' in metrics.text
    httpx.delete(f"{entry.url}/sessions/{sid}", headers={"Authorization": f"Bearer {token}"})


def fast_steps(url: str, token: str) -> float:
    """The station's count of steps the stream answered without Python (its metrics)."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}).text
    line = next(x for x in text.splitlines() if x.startswith("amplituhedron_stream_fast_steps"))
    return float(line.split()[-1])


def test_a_non_exit_station_decodes_without_python_exactly_as_python_does(
    mesh: LocalMesh,
) -> None:
    """The entry station (not the exit) answers decode steps on the stream without Python;
    the rows equal what its Python route computes for the same position, a step it declines
    (a conflict) is answered by Python and changes nothing, and a closed session is gone."""
    entry, token = spec_of(mesh).stations[0], spec_of(mesh).token
    assert token is not None
    auth = {"Authorization": f"Bearer {token}"}
    sid = open_session(entry.url, token)
    n = len(PROMPT)
    prompt = {"session_id": sid, "start": 0, "tokens": PROMPT, "kind": "prefill", "last": True}
    decode = {"session_id": sid, "start": n, "tokens": [901], "kind": "decode"}
    with connect(entry.url) as s:
        before = fast_steps(entry.url, token)
        s.sendall(step(token, [prompt]))
        assert answer(s)[0] == 200
        assert fast_steps(entry.url, token) == before  # a prefill is Python's
        s.sendall(step(token, [decode]))
        status, body, rows = answer(s)
        assert status == 200, body
        assert body["entries"][0] == {**body["entries"][0], "clock": n + 1, "rows": 1}
        assert fast_steps(entry.url, token) == before + 1
        # Python's route at the same position (rolled back first): the same rows, bit for bit.
        r = httpx.post(f"{entry.url}/sessions/{sid}/rollback", json={"clock": n}, headers=auth)
        assert r.json()["clock"] == n
        r = httpx.post(
            f"{entry.url}/sessions/{sid}/decode?logits=none",
            content=struct.pack("<I", 901),
            headers={**auth, "Content-Type": wire.OCTETS},
        )
        assert r.status_code == 200 and r.content == rows
        # Again on the stream: it rolls back to `start` itself.
        s.sendall(step(token, [decode]))
        assert answer(s)[2] == rows
        # Inside the prompt: declined, answered by Python (409), nothing changed.
        s.sendall(step(token, [{**decode, "start": n - 1}]))
        status, body, _ = answer(s)
        assert status == 409 and "after the" in body["detail"]
        assert fast_steps(entry.url, token) == before + 2
        httpx.delete(f"{entry.url}/sessions/{sid}", headers=auth)
        s.sendall(step(token, [decode]))
        assert answer(s)[0] == 404


def test_idle_stream_connections_make_room_under_the_cap(mesh: LocalMesh) -> None:
    """At the cap the oldest idle connection is closed for a new one."""
    entry, token = spec_of(mesh).stations[0], spec_of(mesh).token
    assert token is not None
    held = [connect(entry.url) for _ in range(MAX_CONNECTIONS)]
    try:
        newest = connect(entry.url)
        assert closed(held[0])
        newest.sendall(wire.stream_request(token.encode(), b"{}"))
        assert answer(newest)[0] == 400  # served (an empty step is refused, not the socket)
        newest.close()
    finally:
        for s in held:
            s.close()


def test_the_mesh_emits_the_single_process_tokens_over_every_transport(
    mesh: LocalMesh, model: Model
) -> None:
    """Stream and HTTP-only steps, a prompt cut into pipelined pieces of 3 rows, greedy and
    seeded: every run emits what one process emits."""
    spec = spec_of(mesh)
    seeded: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "seed": 11}
    want = model.generate(PROMPT, 10, use_cache=False, stop_at_eos=False).output_ids
    want_seeded = model.generate(
        PROMPT, 10, use_cache=False, stop_at_eos=False, **seeded
    ).output_ids

    async def go(transport: Any, chunk: int) -> tuple[list[int], list[int], list[int], int]:
        async with Coordinator(spec, chunk=chunk, transport=transport) as c:
            c.time_hops()
            g = await c.generate(PROMPT, 10, use_cache=False)
            s = await c.generate(PROMPT, 10, use_cache=False, **seeded)
            prefill = c.hop_times().get("prefill step")
            hops = 0 if prefill is None else prefill.hops
            d = await c.generate(PROMPT, 10, use_cache=False, draft="prompt-lookup")
            return g.output_ids, s.output_ids, d.output_ids, hops

    token = spec.token
    assert token is not None
    exit_url = spec.stations[-1].url
    for transport, chunk in (("stream", 64), ("http", 64), ("stream", 3)):
        before = fast_steps(exit_url, token)
        greedy, sampled, drafted, prefill_hops = asyncio.run(go(transport, chunk))
        assert greedy == want and sampled == want_seeded, (transport, chunk)
        assert drafted == want, (transport, chunk)
        # Pieces: one request per piece per station (5 pieces of ≤ 3 rows, 2 stations).
        assert prefill_hops == 2 * (1 if chunk == 64 else 5) * 2
        # The exit station ran the decode steps on the stream without Python (9 per plain
        # run, at least one with drafts), and with pieces of 3 rows every piece but a
        # prompt's last (4 per run); none over HTTP.
        fast = fast_steps(exit_url, token) - before
        least = 19 + (3 * 4 if chunk == 3 else 0)
        assert fast >= least if transport == "stream" else fast == 0, (transport, fast)


def test_a_station_without_a_stream_takes_steps_over_http(model: Model) -> None:
    with LocalMesh(1, station_args=["--no-stream"]) as spec:
        assert httpx.get(f"{spec.stations[0].url}/healthz").json()["stream_port"] is None

        async def go() -> list[int]:
            async with Coordinator(spec) as c:
                return (await c.generate(PROMPT, 6, use_cache=False)).output_ids

        want = model.generate(PROMPT, 6, use_cache=False, stop_at_eos=False).output_ids
        assert asyncio.run(go()) == want


def test_pieces_cover_each_prompt_entry_once_and_end_it_once() -> None:
    def spec(**kw: Any) -> wire.BatchEntrySpec:
        return wire.BatchEntrySpec.model_validate({"session_id": "s" * 16, **kw})

    prompt = spec(start=4, tokens=list(range(10)), kind="prefill", last=True, emit=True)
    middle = spec(start=0, tokens=[1, 2], kind="prefill", capture=True)
    decode = spec(start=30, tokens=[5, 6], kind="decode")
    steps = cut([prompt, middle, decode], 4)
    assert [s.entries for s in steps] == [[0, 1, 2], [0], [0]]
    pieces = [p for s in steps for k, p in s.parts if k == 0]
    assert [(p.start, p.tokens) for p in pieces] == [
        (4, [0, 1, 2, 3]),
        (8, [4, 5, 6, 7]),
        (12, [8, 9]),
    ]
    assert [(p.last, p.emit) for p in pieces] == [(False, False), (False, False), (True, True)]
    assert cut([middle, decode], 4) == cut([middle, decode], 2)[:1]  # nothing to cut

    def reply(*results: dict[str, Any]) -> wire.BatchStepReply:
        return wire.BatchStepReply.model_validate({"entries": list(results)})

    lp = {"token": 1, "logprob": -0.5, "top": []}
    merged = merge(
        3,
        steps,
        [
            reply(
                {"clock": 8, "rows": 4, "captured": 10, "prompt_logprobs": [lp]},
                {"clock": 2, "rows": 2},
                {"clock": 32, "rows": 2, "emitted": [6, 9]},
            ),
            reply({"clock": 12, "rows": 4, "prompt_logprobs": [lp, lp]}),
            reply({"clock": 14, "rows": 2, "emitted": [77], "captured": 5}),
        ],
    )
    first = merged.entries[0]
    assert (first.clock, first.rows, first.emitted, first.captured) == (14, 10, [77], 15)
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 3
    assert merged.entries[2].emitted == [6, 9] and merged.entries[1].clock == 2


def test_a_frame_prefix_is_little_endian_and_fixed_size() -> None:
    frame = wire.stream_request(b"tok", b"{}", b"\1\2")
    assert frame[:4] == wire.STREAM_MAGIC
    assert struct.unpack_from("<HII", frame, 4) == (3, 2, 2)
    assert frame[wire.STREAM_PREFIX.size :] == b"tok{}\1\2"


def test_a_step_header_rendered_per_station_is_the_models_own() -> None:
    specs = [
        wire.BatchEntrySpec(
            session_id="a" * 16, start=4, tokens=[1, 2], kind="prefill", last=True, capture=True
        ),
        wire.BatchEntrySpec(session_id="b" * 16, start=30, tokens=[5], kind="decode", logprobs=2),
    ]
    ids = ["x" * 32, "y-_" * 6]
    for timing in (False, True):
        rendered = wire.StepHeaders(specs, timing=timing).render(ids)
        expected = wire.BatchStepRequest(
            entries=[
                s.model_copy(update={"session_id": i}) for s, i in zip(specs, ids, strict=True)
            ],
            timing=timing,
        )
        assert wire.BatchStepRequest.model_validate_json(rendered) == expected
        assert json.loads(rendered) == json.loads(expected.model_dump_json())
    with pytest.raises(ValueError, match="1 session ids for 2 entries"):
        wire.StepHeaders(specs, timing=False).render(ids[:1])


def test_a_ring_lock_behaves_as_a_threading_lock() -> None:
    from amplituhedron_rs._core import RingLock

    lock = RingLock()
    assert lock.acquire(False) and lock.locked()
    assert not lock.acquire(False) and not lock.acquire(timeout=0.01)
    lock.release()
    with pytest.raises(RuntimeError, match="unlocked"):
        lock.release()
    with lock:
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(ValueError, match="non-blocking"):
        lock.acquire(False, timeout=1)
