"""The OpenAI-compatible server over a 2-station mesh (real station processes, a real server
process, the official ``openai`` client): its replies equal the single-process server's,
streamed and plain agree, 8 concurrent streams equal their solo runs, a repeated system
prompt is served from the stations' caches, a client that leaves frees its sessions on every
station, and speculative decoding (verify steps of k+1 rows per hop, rejected drafts rolled
back on every station) leaves greedy output unchanged. Plus the stations' batched-step
endpoint against bad input."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from amplituhedron_rs.mesh import protocol as wire
from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec
from test_serve import (
    Server,
    chat,
    start_server,
    stream_then_leave,
    streamed_text,
    wait_idle,
)

pytestmark = [pytest.mark.model, pytest.mark.mesh]

TOKEN = "mesh-serve-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
COPY = (
    "Here is a list:\n"
    + "\n".join(f'{{"id": {i}, "name": "item {i}", "colour": "blue"}}' for i in range(12))
    + "\nRewrite the list with every colour changed to red."
)


@pytest.fixture(scope="module")
def mesh() -> Iterator[MeshSpec]:
    with LocalMesh(2, token=TOKEN, station_args=["--max-sessions", "12"]) as spec:
        yield spec


@pytest.fixture(scope="module")
def mesh_server(mesh: MeshSpec, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("mesh") / "mesh.json"
    mesh.write(path)
    args = ["--mesh", str(path), "--token", TOKEN, "--max-batch", "8", "--max-queue", "64"]
    with start_server(*args) as srv:
        yield srv


@pytest.fixture(scope="module")
def local_server() -> Iterator[Server]:
    with start_server("--max-batch", "8", "--max-queue", "64") as srv:
        yield srv


def open_sessions(mesh: MeshSpec) -> list[int]:
    """Sessions open on each station (counted: stations never list ids)."""
    with httpx.Client(headers=AUTH, timeout=30) as h:
        return [h.get(f"{s.url}/sessions").json()["live"] for s in mesh.stations]


def complete(srv: Server, prompt: str, **kw: Any) -> tuple[str, Any]:
    r = srv.client().completions.create(model=srv.model(), prompt=prompt, **kw)
    return r.choices[0].text, r.usage


# --- the server over a mesh -------------------------------------------------------------------


@pytest.mark.serve
def test_mesh_replies_equal_the_single_process_server(
    mesh_server: Server, local_server: Server
) -> None:
    asks: list[tuple[str, dict[str, Any]]] = [
        ("Is it raining?", {"max_tokens": 24}),
        ("Tell me a fact.", {"max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 5}),
        (
            "Name a cloud.",
            {"max_tokens": 12, "temperature": 0.7, "seed": 9, "extra_body": {"top_k": 40}},
        ),
    ]
    for user, kw in asks:
        m = chat(mesh_server.client(), mesh_server.model(), user, **kw).choices[0]
        s = chat(local_server.client(), local_server.model(), user, **kw).choices[0]
        assert m.message.content == s.message.content, user
        assert m.finish_reason == s.finish_reason
    # Sampled speculation: verification is position-keyed, so mesh and process still agree.
    kw = {"max_tokens": 40, "temperature": 0.8, "seed": 3, "extra_body": {"draft": "prompt-lookup"}}
    assert complete(mesh_server, COPY, **kw)[0] == complete(local_server, COPY, **kw)[0]


@pytest.mark.serve
def test_a_list_of_prompts_over_the_mesh_equals_the_single_process_server(
    mesh_server: Server, local_server: Server
) -> None:
    """Several prompts in one request, each its own sequence batched through the stations:
    the choices (plain, streamed, echoed with logprobs) equal the single-process server's."""
    prompts = ["The sky is", "Once upon a time", "Rain falls on"]

    def run(srv: Server) -> tuple[Any, ...]:
        c, m = srv.client(), srv.model()
        r = c.completions.create(model=m, prompt=prompts, max_tokens=8, echo=True, logprobs=1)
        plain = [
            (ch.index, ch.text, ch.logprobs and ch.logprobs.token_logprobs) for ch in r.choices
        ]
        streamed = ["", "", ""]
        for chunk in c.completions.create(model=m, prompt=prompts, max_tokens=8, stream=True):
            for ch in chunk.choices:
                streamed[ch.index] += ch.text
        return plain, streamed

    assert run(mesh_server) == run(local_server)
    wait_idle(mesh_server)


@pytest.mark.serve
def test_logprobs_over_the_mesh_equal_the_single_process_servers(
    mesh_server: Server, local_server: Server
) -> None:
    """The exit station computes them from its own logits: a prefill's, a verify step's
    rows, and after an all-hit replay the cached logits the first token is sampled from."""
    ids = [1, 504, 3458, 282, 4195, 314]

    def run(srv: Server, **kw: Any) -> tuple[Any, ...]:
        r = srv.client().completions.create(
            model=srv.model(), prompt=ids, max_tokens=10, logprobs=2, **kw
        )
        lp = r.choices[0].logprobs
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached = r.usage.prompt_tokens_details.cached_tokens
        return (r.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs), cached

    local, _ = run(local_server)
    assert local[2] and len(local[2]) == 10
    first, _ = run(mesh_server)
    again, cached = run(mesh_server)
    spec, _ = run(mesh_server, extra_body={"draft": "prompt-lookup"})
    assert cached == len(ids), "an exact hit on the stations"
    assert first == local and again == local and spec == local
    c, m = mesh_server.client(), mesh_server.model()
    reply = chat(c, m, "Is it foggy?", max_tokens=8, logprobs=True, top_logprobs=1)
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.content
    text = reply.choices[0].message.content
    assert text is not None and b"".join(bytes(e.bytes or []) for e in lp.content) == text.encode()


@pytest.mark.serve
def test_echo_and_prompt_scores_over_the_mesh_equal_the_single_process_servers(
    mesh_server: Server, local_server: Server
) -> None:
    """The exit station scores each prompt row's next token from its own logits, in every
    prefill chunk (this prompt takes two): the same reply, bit for bit, as in process."""
    text = " ".join(["Fog forms when moist air cools to its dew point near the ground."] * 4)

    def run(srv: Server, **kw: Any) -> tuple[Any, ...]:
        r = srv.client().completions.create(model=srv.model(), prompt=text, echo=True, **kw)
        lp = r.choices[0].logprobs
        scores = None if lp is None else (lp.tokens, lp.token_logprobs, lp.top_logprobs)
        return r.choices[0].text, scores

    for kw in (
        {"max_tokens": 4, "logprobs": 2},
        {"max_tokens": 0, "logprobs": 0},
        {"max_tokens": 3},
    ):
        local = run(local_server, **kw)
        assert local[0].startswith(text)
        assert run(mesh_server, **kw) == local, kw
    scores = run(mesh_server, max_tokens=1, logprobs=1)[1]
    assert scores is not None and len(scores[1]) > 33 and scores[1][0] is None


@pytest.mark.serve
def test_plain_and_streamed_replies_agree_over_the_mesh(mesh_server: Server) -> None:
    c, m = mesh_server.client(), mesh_server.model()
    plain = chat(c, m, "Is it windy?", max_tokens=20)
    text, usage, finish = streamed_text(c, m, "Is it windy?", max_tokens=20)
    assert plain.choices[0].message.content == text and text.strip()
    assert plain.choices[0].finish_reason == finish
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens > 0


@pytest.mark.serve
def test_eight_concurrent_streams_over_the_mesh_equal_their_solo_runs(
    mesh_server: Server, mesh: MeshSpec
) -> None:
    c, m = mesh_server.client(), mesh_server.model()
    asks = [f"Describe weather number {i} in a few words." for i in range(8)]
    kws: list[dict[str, Any]] = [
        {"max_tokens": 10 + 3 * i}
        if i % 2 == 0
        else {"max_tokens": 14, "temperature": 0.7, "seed": i}
        for i in range(8)
    ]
    solo = [streamed_text(c, m, a, **kw)[0] for a, kw in zip(asks, kws, strict=True)]
    hops = mesh_server.metric("amplituhedron:station_requests_total")
    decode = "amplituhedron:engine_rows_total"
    steps0, rows0 = (
        mesh_server.metric("amplituhedron:engine_steps_total"),
        mesh_server.metric(decode, kind="decode"),
    )
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda ak: streamed_text(c, m, ak[0], **ak[1])[0], zip(asks, kws, strict=True))
        )
    assert together == solo
    # Batched: far fewer hops than one request per token per station (8 × ~14 × 2).
    assert mesh_server.metric("amplituhedron:station_requests_total") - hops < 8 * 14 * 2 / 2
    # The engine's own load counts say so too: several sequences' rows per step.
    steps = mesh_server.metric("amplituhedron:engine_steps_total") - steps0
    assert (mesh_server.metric(decode, kind="decode") - rows0) / steps > 1.5
    wait_idle(mesh_server)
    assert open_sessions(mesh) == [0, 0]


@pytest.mark.serve
def test_a_repeated_system_prompt_is_served_from_the_stations_caches(mesh_server: Server) -> None:
    c, m = mesh_server.client(), mesh_server.model()
    chat(c, m, "What is fog?", max_tokens=4)
    again = chat(c, m, "And what is sleet?", max_tokens=4)
    details = again.usage.prompt_tokens_details
    assert details is not None and 16 <= details.cached_tokens < again.usage.prompt_tokens
    exact = chat(c, m, "And what is sleet?", max_tokens=4)
    assert exact.usage.prompt_tokens_details.cached_tokens == exact.usage.prompt_tokens
    assert exact.choices[0].message.content == again.choices[0].message.content


@pytest.mark.serve
def test_the_stations_cache_the_head_of_a_prompt_longer_than_their_longest_prefix(
    local_server: Server,
) -> None:
    questions = ["What is frost?", "And what is dew?", "What is frost?"]
    with start_server("--stations", "2", "--max-prefix-len", "24") as srv:
        c, m = srv.client(), srv.model()
        replies = [chat(c, m, q, max_tokens=8) for q in questions]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    assert replies[0].usage.prompt_tokens > 24
    # Each station cached the first 24 tokens, which the next questions replay.
    assert cached[0] < 24 and cached[1:] == [24, 24]
    solo = [chat(local_server.client(), local_server.model(), q, max_tokens=8) for q in questions]
    assert [r.choices[0].message.content for r in replies] == [
        r.choices[0].message.content for r in solo
    ]


@pytest.mark.serve
def test_a_client_that_disconnects_frees_its_sessions_on_every_station(
    mesh_server: Server, mesh: MeshSpec
) -> None:
    before = mesh_server.metric("amplituhedron:generation_tokens_total")

    def both_stations_hold_it() -> None:
        assert open_sessions(mesh) == [1, 1]

    stream_then_leave(mesh_server, both_stations_hold_it)
    wait_idle(mesh_server)
    assert open_sessions(mesh) == [0, 0]
    generated = mesh_server.metric("amplituhedron:generation_tokens_total") - before
    assert generated < 500, f"{generated} tokens generated after the client left"


@pytest.mark.serve
def test_greedy_with_drafts_over_the_mesh_equals_plain_decoding(
    mesh_server: Server, mesh: MeshSpec
) -> None:
    proposed = mesh_server.metric("amplituhedron:spec_decode_num_draft_tokens_total")
    accepted = mesh_server.metric("amplituhedron:spec_decode_num_accepted_tokens_total")
    plain, _ = complete(mesh_server, COPY, max_tokens=64, extra_body={"draft": "off"})
    spec, _ = complete(mesh_server, COPY, max_tokens=64, extra_body={"draft": "prompt-lookup"})
    assert spec == plain
    proposed = mesh_server.metric("amplituhedron:spec_decode_num_draft_tokens_total") - proposed
    accepted = mesh_server.metric("amplituhedron:spec_decode_num_accepted_tokens_total") - accepted
    # Some drafts were accepted (k+1 rows per hop), some rejected: rolled back on both stations.
    assert 0 < accepted < proposed, (accepted, proposed)
    wait_idle(mesh_server)
    assert open_sessions(mesh) == [0, 0]


# --- the stations' batched step against bad input ---------------------------------------------


def _frame(entries: list[dict[str, Any]], payload: bytes = b"") -> bytes:
    return wire.pack_frame(wire.BatchStepRequest.model_validate({"entries": entries}), payload)


def test_the_batched_step_refuses_bad_input_and_changes_nothing(mesh: MeshSpec) -> None:
    entry, exit_ = mesh.stations
    prompt = [1, 504, 3458, 282, 4195]
    hidden = 576
    with httpx.Client(headers=AUTH, timeout=30) as h:
        # Each station draws its own id for the sequence's session there.
        sids = []
        for s in mesh.stations:
            r = h.post(f"{s.url}/sessions", json={"prompt_tokens": prompt})
            assert r.status_code == 201, r.text
            sids.append(r.json()["session_id"])
        ok = {"session_id": sids[0], "start": 0, "tokens": prompt[:3], "kind": "prefill"}
        r = h.post(f"{entry.url}{wire.BATCH_ROUTE}", content=_frame([ok]))
        assert r.status_code == 200, r.text
        head, rows = wire.split_frame(r.content)
        assert wire.BatchStepReply.model_validate_json(head).entries[0].clock == 3
        assert len(rows) == 3 * hidden * 4
        ok_exit = {**ok, "session_id": sids[1]}

        def sessions() -> list[Any]:
            """Each station's session count and the positions its session holds (read from
            the refusal of a step past them, which changes nothing)."""
            out = []
            row = np.zeros(hidden, "<f4").tobytes()  # the exit station takes hidden rows
            for s, e, beyond, payload in ((entry, ok, 4, b""), (exit_, ok_exit, 1, row)):
                past = {**e, "start": beyond, "tokens": prompt[beyond : beyond + 1]}
                r = h.post(f"{s.url}{wire.BATCH_ROUTE}", content=_frame([past], payload))
                assert r.status_code == 409, r.text
                out.append((h.get(f"{s.url}/sessions").json(), r.json()["detail"]))
            return out

        before = sessions()
        assert "holds 3 positions" in before[0][1] and "holds 0 positions" in before[1][1]
        raw_header = b'{"entries": [{"session_id": "bad-1"}]}'
        cases: list[tuple[str, bytes, int, str]] = [
            (entry.url, b"", 400, "frame"),
            (entry.url, b"\xff\xff\x00\x00{}", 400, "header length"),
            (entry.url, len(raw_header).to_bytes(4, "little") + raw_header, 400, "header"),
            (entry.url, _frame([{**ok, "session_id": "A" * 32}]), 404, "no session"),
            # Ids are per station: the exit station's id names nothing at the entry.
            (entry.url, _frame([{**ok, "session_id": sids[1]}]), 404, "no session"),
            (entry.url, _frame([ok, ok]), 400, "twice"),
            (entry.url, _frame([{**ok, "tokens": [5] * 257}]), 413, "rows per entry"),
            (entry.url, _frame([{**ok, "start": 3, "tokens": [7]}]), 409, "prompt"),
            (
                entry.url,
                _frame([{**ok, "start": 4, "tokens": [4195], "last": True}]),
                409,
                "holds 3",
            ),
            (entry.url, _frame([{**ok, "kind": "decode", "start": 3}]), 409, "after the"),
            (
                entry.url,
                _frame([{**ok, "kind": "decode", "start": 5, "emit": True}]),
                400,
                "prefill",
            ),
            (entry.url, _frame([{**ok, "emit": True}]), 400, "last chunk"),
            (entry.url, _frame([ok], b"\x00" * 4), 400, "no payload"),
            (exit_.url, _frame([ok_exit], b"\x00" * 8), 400, "rows of"),
            (
                exit_.url,
                _frame([ok_exit], np.full(3 * hidden, np.nan, "<f4").tobytes()),
                400,
                "not finite",
            ),
        ]
        for url, body, status, words in cases:
            r = h.post(f"{url}{wire.BATCH_ROUTE}", content=body)
            assert r.status_code == status, (words, r.text)
            assert words in r.json()["detail"], (words, r.text)
        r = httpx.post(f"{entry.url}{wire.BATCH_ROUTE}", content=_frame([ok]))
        assert r.status_code == 401
        assert sessions() == before
        for s, sid in zip(mesh.stations, sids, strict=True):
            h.delete(f"{s.url}/sessions/{sid}")


@pytest.mark.serve
def test_overload_over_the_mesh_answers_429_and_every_accepted_request_completes(
    mesh: MeshSpec, tmp_path: Path
) -> None:
    path = tmp_path / "mesh.json"
    mesh.write(path)
    args = ["--mesh", str(path), "--token", TOKEN, "--max-batch", "1", "--max-queue", "1"]
    with start_server(*args) as srv:
        c, m = srv.client(), srv.model()

        def one(i: int) -> int:
            try:
                c.completions.create(model=m, prompt=f"Number {i}:", max_tokens=24)
                return 200
            except openai.RateLimitError as exc:
                assert exc.response.headers.get("Retry-After")
                return 429

        with cf.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(one, range(8)))
        assert 429 in codes and 200 in codes
        wait_idle(srv)
    assert open_sessions(mesh) == [0, 0]


@pytest.mark.serve
def test_load_over_the_mesh_32_clients_leaves_no_session_open(
    mesh_server: Server, mesh: MeshSpec
) -> None:
    m = mesh_server.model()
    c = mesh_server.client(timeout=300)

    def client(k: int) -> list[int]:
        out = []
        for j in range(k, 128, 32):
            r = c.completions.with_raw_response.create(
                model=m, prompt=f"Item {j} is", max_tokens=3, temperature=0.5, seed=j
            )
            usage = r.parse().usage
            assert usage is not None and usage.completion_tokens >= 1
            out.append(r.status_code)
        return out

    with cf.ThreadPoolExecutor(32) as pool:
        statuses = [s for codes in pool.map(client, range(32)) for s in codes]
    assert len(statuses) == 128 and set(statuses) == {200}
    wait_idle(mesh_server)
    assert open_sessions(mesh) == [0, 0]


# --- failover through the server ----------------------------------------------------------------
@pytest.mark.serve
def test_the_server_fails_over_to_a_replica_mid_stream(
    local_server: Server, tmp_path: Path
) -> None:
    """``serve --mesh`` over 2 ranges × 2 replicas: the exit primary is SIGKILLed while a
    greedy and a seeded reply stream; both equal the single-process server's replies, and
    /metrics counts the failover."""
    mesh = LocalMesh(2, replicas=2, token=TOKEN)
    spec = mesh.start()
    try:
        path = tmp_path / "mesh.json"
        spec.write(path)
        args = ["--mesh", str(path), "--max-batch", "8"]
        with start_server(*args) as srv:
            kw: dict[str, Any] = {"max_tokens": 24, "temperature": 0}
            seeded: dict[str, Any] = {"max_tokens": 24, "temperature": 0.8, "seed": 5}
            want = [
                streamed_text(local_server.client(), local_server.model(), COPY, **kw)[0],
                streamed_text(local_server.client(), local_server.model(), COPY, **seeded)[0],
            ]

            def stream(params: dict[str, Any]) -> str:
                c = srv.client()
                parts: list[str] = []
                for chunk in chat(c, srv.model(), COPY, stream=True, **params):
                    for choice in chunk.choices:
                        parts.append(choice.delta.content or "")
                        if len(parts) == 6 and mesh.alive(2):
                            mesh.kill_station(2)  # the exit range's primary
                return "".join(parts)

            with cf.ThreadPoolExecutor(2) as pool:
                got = list(pool.map(stream, [kw, seeded]))
            assert not mesh.alive(2)
            assert got == want
            assert srv.metric("amplituhedron:mesh_failovers_total") == 1
            assert srv.metric("amplituhedron:mesh_rebuilt_sequences_total") >= 1
            assert srv.metric("amplituhedron:mesh_stations_down") >= 1
    finally:
        mesh.close()
