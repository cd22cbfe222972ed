"""Every station endpoint against bad input, over real HTTP to real station processes:
each answer is a 4xx whose message says what is wrong, and the station's state (volume
stats, sessions) is exactly as before. Plus auth, session limits, metrics, and a
schemathesis run of the OpenAPI description (no 5xx). The attacks of issue 10 are in
tests/test_station_security.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

import amplituhedron_rs as ar
from amplituhedron_rs import _core
from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec
from amplituhedron_rs.runtime.gguf_file import ModelFileError

pytestmark = [pytest.mark.model, pytest.mark.mesh]

TOKEN = "station-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OCTETS = {"Content-Type": "application/octet-stream"}
PROMPT = [12615, 36411, 418, 582, 3822, 5027, 20590, 418]


@pytest.fixture(scope="module")
def pair() -> Iterator[MeshSpec]:
    """Two stations: 0:15 (entry, takes token ids) and 15:30 (exit, takes hidden states)."""
    with LocalMesh(2, token=TOKEN, station_args=["--max-sessions", "4"]) as spec:
        yield spec


@pytest.fixture()
def client() -> Iterator[httpx.Client]:
    """A client holding the mesh token (the one tests of refusals without it override)."""
    with httpx.Client(timeout=60, headers=AUTH) as c:
        yield c


def state(c: httpx.Client, url: str) -> tuple[Any, Any]:
    return c.get(f"{url}/amplituhedron/stats").json(), c.get(f"{url}/sessions").json()


def open_session(c: httpx.Client, url: str, prompt: list[int] = PROMPT) -> str:
    """Opens a session; returns the id the station drew."""
    r = c.post(f"{url}/sessions", json={"prompt_tokens": prompt})
    assert r.status_code == 201, r.text
    sid: str = r.json()["session_id"]
    return sid


def prefill(c: httpx.Client, spec: MeshSpec, sids: list[str]) -> list[bytes]:
    """Runs PROMPT through both stations; returns each station's output body."""
    entry, exit_ = spec.stations
    r1 = c.post(
        f"{entry.url}/sessions/{sids[0]}/forward",
        content=np.asarray(PROMPT, "<u4").tobytes(),
        headers=OCTETS,
    )
    assert r1.status_code == 200, r1.text
    r2 = c.post(
        f"{exit_.url}/sessions/{sids[1]}/forward",
        content=r1.content,
        params={"logits": "last", "hidden": "last"},
        headers=OCTETS,
    )
    assert r2.status_code == 200, r2.text
    return [r1.content, r2.content]


def volume_body(spec: MeshSpec, sid: str, **override: Any) -> dict[str, Any]:
    s = spec.stations[0]
    body = {
        "session_id": sid,
        "prefix_hash": str(_core.prefix_hash(PROMPT)),
        "prefix_len": len(PROMPT),
        "layer_lo": s.layer_lo,
        "layer_hi": s.layer_hi,
    }
    body.update(override)
    return body


def expect_refusal(
    c: httpx.Client, url: str, request: Any, status: int | tuple[int, ...], needle: str
) -> None:
    """Sends a bad request; checks the 4xx, its message, and that nothing changed."""
    before = state(c, url)
    r = request()
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text)
    assert needle.lower() in r.text.lower(), r.text
    assert state(c, url) == before


def test_health_and_metrics(pair: MeshSpec, client: httpx.Client) -> None:
    h = client.get(f"{pair.stations[1].url}/healthz").json()
    assert (h["layer_lo"], h["layer_hi"], h["exit"], h["entry"]) == (15, 30, True, False)
    text = client.get(f"{pair.stations[0].url}/metrics").text
    for metric in (
        "amplituhedron_volume_hits",
        "amplituhedron_volume_bytes",
        "amplituhedron_live_sessions",
        "amplituhedron_request_seconds_bucket",
    ):
        assert metric in text


def test_control_endpoints_need_the_bearer_token(pair: MeshSpec, client: httpx.Client) -> None:
    url = pair.stations[0].url
    for path, body in [
        ("/amplituhedron/configure", {"max_entries": 3}),
        ("/amplituhedron/clear", None),
    ]:
        expect_refusal(
            client, url, lambda p=path, b=body: httpx.post(url + p, json=b), 401, "bearer"
        )
        expect_refusal(
            client,
            url,
            lambda p=path, b=body: httpx.post(
                url + p, json=b, headers={"Authorization": "Bearer nope"}
            ),
            401,
            "invalid mesh token",
        )
    r = client.post(f"{url}/amplituhedron/configure", json={"max_entries": 3}, headers=AUTH)
    assert r.status_code == 200 and "stats" in r.json()
    assert client.post(f"{url}/amplituhedron/clear", headers=AUTH).json() == {"cleared": True}


def test_the_matvec_memo_has_no_endpoints(pair: MeshSpec, client: httpx.Client) -> None:
    """The memo is a library type; a station exposes no memo routes (and so nothing that
    could wipe its volume cache under another name)."""
    url = pair.stations[0].url
    for method, path in [("POST", "/memo/clear"), ("GET", "/memo/stats")]:
        request = lambda m=method, p=path: client.request(m, url + p, headers=AUTH)  # noqa: E731
        expect_refusal(client, url, request, 404, "not found")


def test_refusals_get_their_status_from_the_exception_type() -> None:
    from amplituhedron_rs.mesh.station import errors

    cases: list[tuple[Exception, int]] = [
        (errors.BadBody("x"), 400),
        (errors.NotFound("x"), 404),
        (errors.Conflict("x"), 409),
        (errors.TooLarge("x"), 413),
        (errors.Full("x"), 503),
        (ar.InputError("x"), 422),
        (ar.RingError("x"), 409),
        (ar.CacheError("x"), 409),
        (ar.ModelError("x"), 500),
        (ar.MeshError("x"), 502),
        (ModelFileError("x"), 500),  # a subclass takes its base's status
        (KeyError("x"), 500),
    ]
    for exc, status in cases:
        assert errors.status_of(exc) == status, exc
        response = errors.error_response(exc)
        assert response.status_code == status and b'"detail"' in response.body


def test_configure_rejects_bad_values(pair: MeshSpec, client: httpx.Client) -> None:
    url = pair.stations[0].url
    post = client.post
    expect_refusal(
        client,
        url,
        lambda: post(
            f"{url}/amplituhedron/configure",
            content=b"{not json",
            headers={**AUTH, "Content-Type": "application/json"},
        ),
        422,
        "json",
    )
    expect_refusal(
        client,
        url,
        lambda: post(f"{url}/amplituhedron/configure", json={"max_entries": -1}, headers=AUTH),
        422,
        "greater than or equal",
    )
    expect_refusal(
        client,
        url,
        lambda: post(f"{url}/amplituhedron/configure", json={"max_entries": 0}, headers=AUTH),
        422,
        "greater than or equal to 1",
    )
    expect_refusal(
        client,
        url,
        lambda: post(f"{url}/amplituhedron/configure", json={"bogus": 1}, headers=AUTH),
        422,
        "extra",
    )


def test_replay_and_capture_reject_bad_input(pair: MeshSpec, client: httpx.Client) -> None:
    entry = pair.stations[0]
    url = entry.url
    sid = open_session(client, url)
    sids = [sid, open_session(client, pair.stations[1].url)]
    post = client.post
    replay = f"{url}/amplituhedron/replay"
    cases = [
        (
            lambda: post(replay, content=b"{", headers={"Content-Type": "application/json"}),
            422,
            "json",
        ),
        (lambda: post(replay, json=volume_body(pair, sid, prefix_hash="abc")), 422, "pattern"),
        (
            lambda: post(replay, json=volume_body(pair, sid, prefix_hash="18446744073709551616")),
            422,
            "u64",
        ),
        (lambda: post(replay, json=volume_body(pair, sid, prefix_hash="-5")), 422, "pattern"),
        (
            lambda: post(replay, json=volume_body(pair, sid, layer_lo=15, layer_hi=30)),
            409,
            "owns layers 0:15",
        ),
        (
            lambda: post(replay, json=volume_body(pair, sid, prefix_hash="12345")),
            409,
            "not the hash",
        ),
        (
            lambda: post(replay, json=volume_body(pair, sid, prefix_len=len(PROMPT) + 1)),
            422,
            "exceeds",
        ),
        (lambda: post(replay, json=volume_body(pair, "no/such-session")), 422, "pattern"),
        (lambda: post(replay, json=volume_body(pair, "A" * 32)), 404, "no session"),
    ]
    for request, status, needle in cases:
        expect_refusal(client, url, request, status, needle)
    capture = f"{url}/amplituhedron/capture"

    def cap(body: bytes = b"", **override: Any) -> httpx.Response:
        return post(
            capture, params=volume_body(pair, sid, **override), content=body, headers=OCTETS
        )

    # Before the prompt ran, there is nothing the station computed to capture.
    expect_refusal(client, url, cap, 409, "has not computed")
    outputs = prefill(client, pair, sids)
    tail = outputs[0][-576 * 4 :]
    for request, status, needle in [
        (lambda: cap(tail), 400, "takes no body"),
        (lambda: cap(prefix_hash="x1"), 422, "pattern"),
        (lambda: cap(layer_lo=15, layer_hi=30), 409, "owns layers"),
        (lambda: cap(session_id="A" * 32), 404, "no session"),
        (lambda: cap(session_id="a/b"), 422, "pattern"),
        (lambda: cap(prefix_len=len(PROMPT) - 1), 422, "whole prompt"),
        (lambda: httpx.post(capture, params=volume_body(pair, sid)), 401, "bearer"),
    ]:
        expect_refusal(client, url, request, status, needle)
    # The well-formed capture freezes the station's own tail; replay into a fresh session
    # hits and answers exactly that tail.
    r = cap()
    assert r.status_code == 200 and r.json()["captured"] and r.json()["bytes"] > 0
    fresh = open_session(client, url)
    r = post(replay, json=volume_body(pair, fresh))
    assert r.status_code == 200 and r.headers["x-amplituhedron-status"] == "hit"
    assert r.content == tail
    for opened in (sid, fresh):
        assert client.delete(f"{url}/sessions/{opened}").status_code == 200
    assert client.delete(f"{pair.stations[1].url}/sessions/{sids[1]}").status_code == 200


def test_sessions_and_compute_reject_bad_input(pair: MeshSpec, client: httpx.Client) -> None:
    entry, exit_ = pair.stations
    post = client.post
    for request, status, needle in [
        (lambda: post(f"{entry.url}/sessions", json={"prompt_tokens": []}), 422, "at least 1"),
        (lambda: post(f"{entry.url}/sessions", json={"prompt_tokens": [-1]}), 422, "greater"),
        (lambda: post(f"{entry.url}/sessions", json={"prompt_tokens": [2**32]}), 422, "less"),
        (
            lambda: post(
                f"{entry.url}/sessions", content=b"[", headers={"Content-Type": "application/json"}
            ),
            422,
            "json",
        ),
    ]:
        expect_refusal(client, entry.url, request, status, needle)
    se, sx = open_session(client, entry.url), open_session(client, exit_.url)
    fe, fx = f"/sessions/{se}/forward", f"/sessions/{sx}/forward"
    unknown = "A" * 32
    hidden_nan = np.zeros((2, 576), "<f4")
    hidden_nan[1, 5] = np.inf
    for url, request, status, needle in [
        (
            entry.url,
            lambda: post(entry.url + fe, content=b"\x01\x02\x03", headers=OCTETS),
            400,
            "u32",
        ),
        (
            entry.url,
            lambda: post(
                entry.url + fe, content=np.asarray([49152], "<u4").tobytes(), headers=OCTETS
            ),
            422,
            "vocabulary",
        ),
        (
            entry.url,
            lambda: post(
                entry.url + fe,
                content=np.asarray([1], "<u4").tobytes(),
                params={"logits": "last"},
                headers=OCTETS,
            ),
            400,
            "exit",
        ),
        (
            entry.url,
            lambda: post(
                entry.url + f"/sessions/{se}/decode",
                content=np.asarray([1, 2], "<u4").tobytes(),
                headers=OCTETS,
            ),
            400,
            "exactly one row",
        ),
        (
            exit_.url,
            lambda: post(exit_.url + fx, content=hidden_nan.tobytes(), headers=OCTETS),
            400,
            "not finite",
        ),
        (
            exit_.url,
            lambda: post(exit_.url + fx, content=b"\0" * (575 * 4), headers=OCTETS),
            400,
            "576",
        ),
        (
            exit_.url,
            lambda: post(exit_.url + fx, content=b"\0" * (65 * 1024 * 1024), headers=OCTETS),
            413,
            "limit",
        ),
        (
            exit_.url,
            lambda: post(
                exit_.url + f"/sessions/{unknown}/forward",
                content=b"\0" * 2304,
                headers=OCTETS,
            ),
            404,
            "no session",
        ),
        (
            entry.url,
            lambda: post(entry.url + f"/sessions/{se}/rollback", json={"clock": 5}),
            409,
            "after the current clock",
        ),
        (entry.url, lambda: client.delete(f"{entry.url}/sessions/{unknown}"), 404, "no session"),
        (entry.url, lambda: client.delete(entry.url + "/sessions/none"), 422, "pattern"),
        (entry.url, lambda: post(entry.url + f"/sessions/{se}/sample"), 400, "exit station"),
        (exit_.url, lambda: post(exit_.url + f"/sessions/{sx}/sample"), 409, "no logits"),
        (
            entry.url,
            lambda: post(
                entry.url + fe,
                content=np.asarray([1], "<u4").tobytes(),
                params={"sample": "true"},
                headers=OCTETS,
            ),
            400,
            "exit",
        ),
        (
            exit_.url,
            lambda: post(
                exit_.url + "/sessions",
                json={"prompt_tokens": [1], "sampling": {"temperature": -0.5}},
            ),
            422,
            "greater than or equal to 0",
        ),
    ]:
        expect_refusal(client, url, request, status, needle)


def test_a_full_station_answers_503(pair: MeshSpec, client: httpx.Client) -> None:
    url = pair.stations[1].url
    live = client.get(f"{url}/sessions").json()["live"]
    extra = [open_session(client, url) for _ in range(4 - live)]
    expect_refusal(
        client,
        url,
        lambda: client.post(f"{url}/sessions", json={"prompt_tokens": [1]}),
        503,
        "station full",
    )
    r = client.post(f"{url}/sessions", json={"prompt_tokens": [1]})
    assert r.headers["retry-after"] == "1"
    for sid in extra:
        assert client.delete(f"{url}/sessions/{sid}").status_code == 200


#: JSON the strict parser would not write but Python's accepts, plus malformed token ids.
HOSTILE_JSON = [
    b'{"prompt_tokens": [NaN]}',
    b'{"prompt_tokens": [1], "sampling": {"temperature": Infinity}}',
    b'{"prompt_tokens": [1], "sampling": {"top_p": -Infinity}}',
    b'{"prompt_tokens": [1.5]}',
    b'{"prompt_tokens": [true]}',
    b'{"prompt_tokens": ["7"]}',
    b'{"clock": NaN}',
    b'{"max_entries": 1e999}',
    b'{"prefix_hash": "1", "prefix_len": NaN, "session_id": "x", "layer_lo": 0, "layer_hi": 1}',
]


def test_every_operation_refuses_hostile_bodies_with_a_4xx(
    pair: MeshSpec, client: httpx.Client
) -> None:
    """Beyond the schema: every operation of the OpenAPI description, on both stations,
    gets non-finite numbers and malformed tokens, an oversized body and the same oversized
    body chunked (no Content-Length); each answer is a 4xx that renders, never a 5xx, and
    the station is as it was."""
    for station in pair.stations:
        url = station.url
        spec = client.get(f"{url}/openapi.json").json()
        sid = open_session(client, url)
        operations = [
            (method.upper(), path.replace("{session_id}", sid), "requestBody" in op)
            for path, item in spec["paths"].items()
            for method, op in item.items()
            if method.upper() in ("POST", "PUT", "PATCH", "DELETE")
        ]
        assert len(operations) >= 10
        oversized = b"[" + b"1," * (1 << 20) + b"1]"  # > the 1 MiB JSON limit

        def chunked(body: bytes) -> Iterator[bytes]:
            for i in range(0, len(body), 64 * 1024):
                yield body[i : i + 64 * 1024]

        for method, path, takes_body in operations:
            attempts: list[tuple[Any, dict[str, str]]] = [
                (body, {"Content-Type": "application/json"})
                for body in (HOSTILE_JSON if takes_body else [])
            ]
            attempts += [
                (oversized, {"Content-Type": "application/json"}),
                (chunked(oversized), {"Content-Type": "application/json"}),
                (chunked(b"\0" * (17 << 20)), OCTETS),  # > the 16 MiB octet limit
            ]
            for body, headers in attempts:
                before = client.get(f"{url}/amplituhedron/stats").json()
                r = client.request(method, url + path, content=body, headers=headers)
                assert 400 <= r.status_code < 500, (method, path, r.status_code, r.text[:300])
                assert r.json()["detail"], r.text
                assert client.get(f"{url}/amplituhedron/stats").json() == before
        assert client.delete(f"{url}/sessions/{sid}").status_code == 200


def test_openapi_fuzz_finds_no_server_error(pair: MeshSpec) -> None:
    """schemathesis generates requests for every operation of the exit station's OpenAPI
    description (valid and invalid by the schema); none may produce a 5xx. (Last of the
    module's tests on ``pair``: the sessions it opens stay until the idle sweep.)"""
    schema = schemathesis.openapi.from_url(f"{pair.stations[1].url}/openapi.json", headers=AUTH)
    operations = [cast(Any, result).ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def no_server_error(case: Any) -> None:
            response = case.call(headers=AUTH, timeout=30)
            if response.status_code == 503:  # the documented back-pressure answer
                assert "station full" in response.text or "budget" in response.text
                return
            assert response.status_code < 500, (case.method, case.path, response.text[:300])

        no_server_error()


def test_idle_sessions_expire(model: Any) -> None:
    """A station built in-process on the loaded weights, with a 0.5 s idle limit."""
    import time

    from fastapi.testclient import TestClient

    from amplituhedron_rs.mesh.station import Station, StationSettings, create_app

    station = Station(
        StationSettings(layer_lo=0, layer_hi=30, session_idle_s=0.5, max_sessions=2),
        weights=model.weights,
    )
    with TestClient(create_app(station)) as c:
        sids = []
        for _ in range(2):
            r = c.post("/sessions", json={"prompt_tokens": [1, 2]})
            assert r.status_code == 201, r.text
            sids.append(r.json()["session_id"])
        deadline = time.monotonic() + 10
        while c.get("/sessions").json()["live"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.get("/sessions").json()["live"] == 0
        assert c.post(f"/sessions/{sids[0]}/forward", content=b"\0\0\0\0").status_code == 404
