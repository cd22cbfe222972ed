"""Every station endpoint against bad input, over real HTTP to real station processes:
each answer is a 4xx whose message says what is wrong, and the station's state (volume
stats, sessions) is exactly as before. Plus auth, session limits, metrics, and a
schemathesis run of the OpenAPI description (no 5xx)."""

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
    with httpx.Client(timeout=60) as c:
        yield c


def state(c: httpx.Client, url: str) -> tuple[Any, Any]:
    return c.get(f"{url}/amplituhedron/stats").json(), c.get(f"{url}/sessions").json()


def open_session(c: httpx.Client, url: str, sid: str, prompt: list[int] = PROMPT) -> None:
    r = c.post(f"{url}/sessions", json={"prompt_tokens": prompt, "session_id": sid})
    assert r.status_code == 201, r.text


def prefill(c: httpx.Client, spec: MeshSpec, sid: str) -> list[bytes]:
    """Runs PROMPT through both stations; returns each station's output body."""
    entry, exit_ = spec.stations
    r1 = c.post(
        f"{entry.url}/sessions/{sid}/forward",
        content=np.asarray(PROMPT, "<u4").tobytes(),
        headers=OCTETS,
    )
    assert r1.status_code == 200, r1.text
    r2 = c.post(
        f"{exit_.url}/sessions/{sid}/forward",
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
            client, url, lambda p=path, b=body: client.post(url + p, json=b), 401, "bearer"
        )
        expect_refusal(
            client,
            url,
            lambda p=path, b=body: client.post(
                url + p, json=b, headers={"Authorization": "Bearer nope"}
            ),
            401,
            "wrong bearer token",
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
        (errors.Unauthorized("x"), 401),
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
    sid = "bad-volume-input"
    open_session(client, url, sid)
    open_session(client, pair.stations[1].url, sid)
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
        (lambda: post(replay, json=volume_body(pair, "no-such-session")), 404, "no session"),
    ]
    for request, status, needle in cases:
        expect_refusal(client, url, request, status, needle)
    outputs = prefill(client, pair, sid)
    tail = outputs[0][-576 * 4 :]
    capture = f"{url}/amplituhedron/capture"

    def cap(body: bytes, **override: Any) -> httpx.Response:
        return post(
            capture,
            params=volume_body(pair, sid, **override),
            content=body,
            headers={**AUTH, **OCTETS},
        )

    nan_tail = np.frombuffer(tail, "<f4").copy()
    nan_tail[3] = np.nan
    for request, status, needle in [
        (lambda: cap(tail[:-4]), 400, "tail residual"),
        (lambda: cap(tail[:-1]), 400, "whole number"),
        (lambda: cap(nan_tail.tobytes()), 400, "not finite"),
        (lambda: cap(tail, prefix_hash="x1"), 422, "pattern"),
        (lambda: cap(tail, layer_lo=15, layer_hi=30), 409, "owns layers"),
        (lambda: cap(tail, session_id="nope"), 404, "no session"),
        (
            lambda: post(capture, params=volume_body(pair, sid), content=tail, headers=OCTETS),
            401,
            "bearer",
        ),
    ]:
        expect_refusal(client, url, request, status, needle)
    # The well-formed capture works, then replay into a fresh session hits.
    r = cap(tail)
    assert r.status_code == 200 and r.json()["captured"] and r.json()["bytes"] > 0
    open_session(client, url, sid + "-2")
    r = post(replay, json=volume_body(pair, sid + "-2"))
    assert r.status_code == 200 and r.headers["x-amplituhedron-status"] == "hit"
    assert r.content == tail


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
    sid = "bad-compute"
    open_session(client, entry.url, sid)
    open_session(client, exit_.url, sid)
    fwd = f"/sessions/{sid}/forward"
    hidden_nan = np.zeros((2, 576), "<f4")
    hidden_nan[1, 5] = np.inf
    for url, request, status, needle in [
        (
            entry.url,
            lambda: post(entry.url + fwd, content=b"\x01\x02\x03", headers=OCTETS),
            400,
            "u32",
        ),
        (
            entry.url,
            lambda: post(
                entry.url + fwd, content=np.asarray([49152], "<u4").tobytes(), headers=OCTETS
            ),
            422,
            "vocabulary",
        ),
        (
            entry.url,
            lambda: post(
                entry.url + fwd,
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
                entry.url + f"/sessions/{sid}/decode",
                content=np.asarray([1, 2], "<u4").tobytes(),
                headers=OCTETS,
            ),
            400,
            "exactly one row",
        ),
        (
            exit_.url,
            lambda: post(exit_.url + fwd, content=hidden_nan.tobytes(), headers=OCTETS),
            400,
            "not finite",
        ),
        (
            exit_.url,
            lambda: post(exit_.url + fwd, content=b"\0" * (575 * 4), headers=OCTETS),
            400,
            "576",
        ),
        (
            exit_.url,
            lambda: post(exit_.url + fwd, content=b"\0" * (65 * 1024 * 1024), headers=OCTETS),
            413,
            "limit",
        ),
        (
            exit_.url,
            lambda: post(
                exit_.url + "/sessions/none/forward", content=b"\0" * 2304, headers=OCTETS
            ),
            404,
            "no session",
        ),
        (
            entry.url,
            lambda: post(entry.url + f"/sessions/{sid}/rollback", json={"clock": 5}),
            409,
            "after the current clock",
        ),
        (entry.url, lambda: client.delete(entry.url + "/sessions/none"), 404, "no session"),
        (entry.url, lambda: post(entry.url + f"/sessions/{sid}/sample"), 400, "exit station"),
        (exit_.url, lambda: post(exit_.url + f"/sessions/{sid}/sample"), 409, "no logits"),
        (
            entry.url,
            lambda: post(
                entry.url + fwd,
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
    opened = [s["session_id"] for s in client.get(f"{url}/sessions").json()["sessions"]]
    extra = [f"fill-{i}" for i in range(4 - len(opened))]
    for sid in extra:
        open_session(client, url, sid)
    expect_refusal(
        client,
        url,
        lambda: client.post(f"{url}/sessions", json={"prompt_tokens": [1]}),
        503,
        "station full",
    )
    for sid in extra + opened:
        assert client.delete(f"{url}/sessions/{sid}").status_code == 200


def test_openapi_fuzz_finds_no_server_error(pair: MeshSpec) -> None:
    """schemathesis generates requests for every operation of the exit station's OpenAPI
    description (valid and invalid by the schema); none may produce a 5xx."""
    schema = schemathesis.openapi.from_url(f"{pair.stations[1].url}/openapi.json")
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
                assert "station full" in response.text
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
        assert (
            c.post("/sessions", json={"prompt_tokens": [1, 2], "session_id": "a"}).status_code
            == 201
        )
        assert (
            c.post("/sessions", json={"prompt_tokens": [1, 2], "session_id": "b"}).status_code
            == 201
        )
        deadline = time.monotonic() + 10
        while c.get("/sessions").json()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.get("/sessions").json()["sessions"] == []
        assert c.post("/sessions/a/forward", content=b"\0\0\0\0").status_code == 404
