"""The OpenAI-compatible server, as a real process on loopback, through the official
``openai`` client: replies plain and streamed, stops, seeds, the prefix cache, batching
invariance under concurrency, cancellation, back-pressure, bad parameters, and a bounded
load test."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from amplituhedron_rs.runtime.gguf_file import read_model_file
from amplituhedron_rs.runtime.tokenizer import Tokenizer

pytestmark = [pytest.mark.model, pytest.mark.serve]

KEY = "test-key-1"
SYSTEM = (
    "You are a careful assistant for a weather service. Answer briefly, in plain English, "
    "and never invent a forecast you were not given."
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]

    def client(self, key: str = KEY, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, **kw)

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value: the first sample named ``name`` whose labels include
        ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return float(sample.value)
        raise AssertionError(f"no metric {name} {labels}")

    def model(self) -> str:
        return str(self.client().models.list().data[0].id)


@contextlib.contextmanager
def start_server(*args: str) -> Iterator[Server]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "amplituhedron_rs.cli",
        "serve",
        "--port",
        str(port),
        "--api-key",
        KEY,
        *args,
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up in 120 s")
            time.sleep(0.2)
        yield Server(url, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with start_server("--max-batch", "8", "--max-queue", "64") as srv:
        yield srv


def chat(c: openai.OpenAI, model: str, user: str, **kw: Any) -> Any:
    return c.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        **kw,
    )


def streamed_text(c: openai.OpenAI, model: str, user: str, **kw: Any) -> tuple[str, Any, str]:
    """Text, usage and finish reason of a streamed chat completion."""
    parts: list[str] = []
    usage = None
    finish = ""
    for chunk in chat(c, model, user, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(parts), usage, finish


def wait_idle(server: Server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            server.metric("amplituhedron:live_sequences") == 0
            and server.metric("amplituhedron:num_requests_running") == 0
        ):
            return
        time.sleep(0.1)
    raise AssertionError("sequences are still holding KV")


# --- replies ---------------------------------------------------------------------------------


def test_plain_and_streamed_replies_agree(server: Server) -> None:
    c, m = server.client(), server.model()
    plain = chat(c, m, "Is it raining?", max_tokens=24)
    text, usage, finish = streamed_text(c, m, "Is it raining?", max_tokens=24)
    assert plain.choices[0].message.content == text
    assert text.strip()
    assert plain.choices[0].finish_reason == finish
    assert finish in ("stop", "length")
    assert usage is not None
    assert usage.completion_tokens == plain.usage.completion_tokens > 0
    assert usage.prompt_tokens == plain.usage.prompt_tokens > 20
    assert plain.object == "chat.completion"


def test_completions_take_text_or_token_ids(server: Server) -> None:
    c, m = server.client(), server.model()
    by_text = c.completions.create(model=m, prompt="The capital of France is", max_tokens=6)
    ids = Tokenizer(read_model_file()).encode("The capital of France is")
    by_ids = c.completions.create(model=m, prompt=ids, max_tokens=6)
    assert by_text.usage is not None
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.choices[0].finish_reason == "length"
    assert by_text.usage.completion_tokens == 6


def test_stop_sequences_cut_the_text_and_say_stop(server: Server) -> None:
    c, m = server.client(), server.model()
    full = chat(c, m, "List three colours.", max_tokens=30).choices[0].message.content
    assert full and len(full) > 12
    stop = full[8:12]
    cut = chat(c, m, "List three colours.", max_tokens=30, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed, _, finish = streamed_text(c, m, "List three colours.", max_tokens=30, stop=stop)
    assert streamed == full[: full.index(stop)]
    assert finish == "stop"


def test_a_seed_makes_sampling_reproducible(server: Server) -> None:
    c, m = server.client(), server.model()
    kw: dict[str, Any] = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.95}
    a = chat(c, m, "Tell me a fact.", seed=11, **kw).choices[0].message.content
    b = chat(c, m, "Tell me a fact.", seed=11, **kw).choices[0].message.content
    others = {
        chat(c, m, "Tell me a fact.", seed=s, **kw).choices[0].message.content for s in (1, 2, 3)
    }
    assert a == b
    assert others - {a}, "other seeds never changed the text"


def test_a_request_that_speculates_gets_the_plain_greedy_reply(server: Server) -> None:
    c, m = server.client(), server.model()
    user = "Repeat exactly: the red fox, the red fox, the red fox, the red fox."
    plain = chat(c, m, user, max_tokens=24).choices[0].message.content
    spec = chat(c, m, user, max_tokens=24, extra_body={"draft": "prompt-lookup"})
    assert spec.choices[0].message.content == plain
    bad = c.with_options(max_retries=0).chat.completions
    with pytest.raises(openai.BadRequestError):
        bad.create(
            model=m,
            messages=[{"role": "user", "content": user}],
            extra_body={"draft": "medusa"},
        )


def reference_logprobs(prompt: list[int], n: int, top: int) -> list[Any]:
    """The first ``n`` greedy tokens after ``prompt`` and their log-probabilities, computed
    in this process: the whole sequence's logits in one forward pass (no cache, no batch)."""
    import amplituhedron_rs as ar
    from amplituhedron_rs import _core

    model = ar.load_model(cache=ar.CacheOptions(enabled=False))
    out = model.generate(prompt, n, stop_at_eos=False).output_ids
    rows = model.logits_all(prompt + out[:-1])[len(prompt) - 1 :]
    return [_core.token_logprobs(row, t, top) for row, t in zip(rows, out, strict=True)]


def test_logprobs_are_the_model_distribution_plain_streamed_cached_and_speculative(
    server: Server,
) -> None:
    c, m = server.client(), server.model()
    ids = Tokenizer(read_model_file()).encode("The weather today is")
    expected = reference_logprobs(ids, 8, 3)
    drafts: list[dict[str, str]] = [{}, {}, {"draft": "prompt-lookup"}]
    runs = [
        c.completions.create(model=m, prompt=ids, max_tokens=8, logprobs=3, extra_body=body)
        for body in drafts
    ]
    assert runs[1].usage is not None and runs[1].usage.prompt_tokens_details is not None
    assert runs[1].usage.prompt_tokens_details.cached_tokens == len(ids), "an exact hit"
    tok = Tokenizer(read_model_file())
    for r in runs:
        lp = r.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.token_logprobs == [e.logprob for e in expected], "bit-exact, as JSON floats"
        assert r.choices[0].finish_reason == "length"
        assert lp.tokens == [tok.token_bytes(e.token).decode("utf-8", "replace") for e in expected]
        assert "".join(lp.tokens) == r.choices[0].text
        for alts, e in zip(lp.top_logprobs, expected, strict=True):
            assert list(alts.values()) == [p for _, p in e.top]
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    # Chat: plain and streamed agree; the tokens' bytes spell the reply; greedy picks the
    # likeliest token.
    plain = chat(c, m, "Is it sunny?", max_tokens=12, logprobs=True, top_logprobs=2)
    content = plain.choices[0].logprobs.content
    text = plain.choices[0].message.content
    eos = 1 if plain.choices[0].finish_reason == "stop" else 0
    assert len(content) == plain.usage.completion_tokens - eos
    assert b"".join(bytes(e.bytes) for e in content) == text.encode()
    for e in content:
        assert [a.logprob for a in e.top_logprobs] == sorted(
            (a.logprob for a in e.top_logprobs), reverse=True
        )
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert e.logprob <= 0
    streamed: list[Any] = []
    for chunk in chat(c, m, "Is it sunny?", max_tokens=12, stream=True, logprobs=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content or [])
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert all(e.top_logprobs == [] for e in streamed)
    assert chat(c, m, "Is it sunny?", max_tokens=4).choices[0].logprobs is None


def test_echo_scores_the_prompt_for_loglikelihood_evaluation(server: Server) -> None:
    """``echo`` with ``logprobs`` (what lm-evaluation-harness sends): the reply starts with
    the prompt, whose tokens after the first are scored exactly as a whole-sequence forward
    pass in this process scores them; plain and streamed agree; ``max_tokens: 0`` only
    scores; the completion after the prompt is the one a request without echo gets."""
    import amplituhedron_rs as ar
    from amplituhedron_rs import _core

    c, m = server.client(), server.model()
    text = "The weather today is cold and"
    tok = Tokenizer(read_model_file())
    ids = tok.encode(text)
    model = ar.load_model(cache=ar.CacheOptions(enabled=False))
    rows = model.logits_all(ids)
    scores = [_core.token_logprobs(row, t, 1) for row, t in zip(rows, ids[1:], strict=False)]
    plain = c.completions.create(model=m, prompt=text, max_tokens=3)
    r = c.completions.create(model=m, prompt=text, max_tokens=3, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == text + plain.choices[0].text
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens is not None
    n = len(ids)
    assert lp.tokens == [tok.token_bytes(t).decode("utf-8", "replace") for t in ids] + lp.tokens[n:]
    assert len(lp.tokens) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == [s.logprob for s in scores], "bit-exact, as JSON floats"
    assert [list(a.values()) for a in lp.top_logprobs[1:n]] == [
        [p for _, p in s.top] for s in scores
    ]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 3)]
    assert r.usage is not None and r.usage.prompt_tokens == n
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0, "scored, not replayed"
    # Streamed: the prompt's chunk first, then the completion's.
    pieces, streamed = [], {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in c.completions.create(
        model=m, prompt=text, max_tokens=3, echo=True, logprobs=1, stream=True
    ):
        for ch in chunk.choices:
            pieces.append(ch.text)
            if ch.logprobs is not None:
                for key, values in streamed.items():
                    values.extend(getattr(ch.logprobs, key) or [])
    assert pieces[0] == text and "".join(pieces) == choice.text
    assert streamed == {k: getattr(lp, k) for k in streamed}
    # Scoring only; echo without logprobs; token ids as the prompt.
    only = c.completions.create(model=m, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == tok.decode(ids) and only.usage is not None
    assert only.usage.completion_tokens == 0
    assert only.choices[0].logprobs is not None
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    echoed = c.completions.create(model=m, prompt=text, max_tokens=3, echo=True)
    assert echoed.choices[0].text == choice.text and echoed.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model=m, prompt=text, max_tokens=0)


def test_a_repeated_system_prompt_is_served_from_the_cache(server: Server) -> None:
    c, m = server.client(), server.model()
    chat(c, m, "What is fog?", max_tokens=4)
    again = chat(c, m, "And what is hail?", max_tokens=4)
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= 16
    assert details.cached_tokens < again.usage.prompt_tokens
    exact = chat(c, m, "And what is hail?", max_tokens=4)
    assert exact.usage.prompt_tokens_details.cached_tokens == exact.usage.prompt_tokens


def test_a_prompt_longer_than_the_longest_prefix_caches_its_head(server: Server) -> None:
    # The prompts share more than 24 tokens: with --max-prefix-len 24 each caches its first
    # 24, which the next question under the same system prompt replays.
    questions = ["What is frost?", "And what is dew?"]
    with start_server("--max-prefix-len", "24") as short:
        c, m = short.client(), short.model()
        first, second = (chat(c, m, q, max_tokens=8) for q in questions)
    assert first.usage.prompt_tokens > 24
    assert first.usage.prompt_tokens_details.cached_tokens < 24
    assert second.usage.prompt_tokens_details.cached_tokens == 24
    # The replies equal those of a server that caches whole prompts.
    whole = [chat(server.client(), server.model(), q, max_tokens=8) for q in questions]
    assert [r.choices[0].message.content for r in (first, second)] == [
        r.choices[0].message.content for r in whole
    ]


def test_cache_salt_isolates_tenants(server: Server) -> None:
    c, m = server.client(), server.model()
    chat(c, m, "Is it windy?", max_tokens=2, extra_body={"cache_salt": "tenant-a"})
    same = chat(c, m, "Is it windy?", max_tokens=2, extra_body={"cache_salt": "tenant-a"})
    other = chat(c, m, "Is it windy?", max_tokens=2, extra_body={"cache_salt": "tenant-b"})
    assert same.usage.prompt_tokens_details.cached_tokens == same.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_metrics_count_the_engine_load(server: Server) -> None:
    """Steps, rows and busy seconds of the engine: a lone request prefills its uncached
    prompt rows, then decodes one row per token after the first, in at most the wall time."""
    wait_idle(server)
    names: list[tuple[str, dict[str, str]]] = [
        ("amplituhedron:engine_steps_total", {}),
        ("amplituhedron:engine_rows_total", {"kind": "prompt"}),
        ("amplituhedron:engine_rows_total", {"kind": "decode"}),
        ("amplituhedron:engine_busy_seconds_total", {}),
    ]
    before = [server.metric(n, **labels) for n, labels in names]
    started = time.monotonic()
    r = chat(server.client(), server.model(), "Name three kinds of cloud.", max_tokens=9)
    wall = time.monotonic() - started
    steps, prompt_rows, decode_rows, busy = (
        server.metric(n, **labels) - b for (n, labels), b in zip(names, before, strict=True)
    )
    assert r.usage.completion_tokens == 9
    assert prompt_rows == r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
    assert decode_rows == 8
    assert steps >= 9
    assert 0 < busy <= wall


# --- concurrency -----------------------------------------------------------------------------


def test_eight_concurrent_streams_each_equal_their_solo_run(server: Server) -> None:
    c, m = server.client(), server.model()
    asks = [f"Describe weather number {i} in a few words." for i in range(8)]
    kws: list[dict[str, Any]] = [
        {"max_tokens": 12 + 3 * i}
        if i % 2 == 0
        else {"max_tokens": 14, "temperature": 0.7, "seed": i}
        for i in range(8)
    ]
    solo = [streamed_text(c, m, a, **kw)[0] for a, kw in zip(asks, kws, strict=True)]
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda ak: streamed_text(c, m, ak[0], **ak[1])[0], zip(asks, kws, strict=True))
        )
    assert together == solo
    wait_idle(server)


def stream_then_leave(server: Server, while_open: Callable[[], None] | None = None) -> None:
    """Starts a 3000-token stream, reads three events, runs ``while_open`` and disconnects."""
    body = {
        "model": server.model(),
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "max_tokens": 3000,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as h,
        h.stream(
            "POST",
            f"{server.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
        ) as r,
    ):
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                if while_open is not None:
                    while_open()
                break


def test_a_client_that_disconnects_cancels_its_request(server: Server) -> None:
    before = server.metric("amplituhedron:generation_tokens_total")
    stream_then_leave(server)
    wait_idle(server)
    generated = server.metric("amplituhedron:generation_tokens_total") - before
    assert generated < 500, f"{generated} tokens generated after the client left"


def test_bad_parameters_get_openai_errors(server: Server) -> None:
    m = server.model()
    headers = {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "user", "content": "hi"}]
    bad_bodies: list[tuple[dict[str, Any], str | None]] = [
        ({"model": m, "messages": msgs, "n": 2}, "n"),
        ({"model": m, "messages": msgs, "temperature": -1}, "temperature"),
        ({"model": m, "messages": msgs, "temperature": 5}, "temperature"),
        ({"model": m, "messages": msgs, "top_p": 0}, "top_p"),
        ({"model": m, "messages": msgs, "max_tokens": 0}, "max_tokens"),
        ({"model": m, "messages": msgs, "max_tokens": 10**9}, "max_tokens"),
        ({"model": m, "messages": msgs, "stop": [str(i) for i in range(17)]}, "stop"),
        ({"model": m, "messages": msgs, "top_logprobs": 2}, "top_logprobs"),
        ({"model": m, "messages": msgs, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"model": m, "messages": msgs, "logprobs": "yes"}, "logprobs"),
        ({"model": m, "messages": msgs, "presence_penalty": 1.0}, None),
        ({"model": m, "messages": msgs, "seed": -1}, "seed"),
        ({"model": m, "messages": []}, "messages"),
        ({"model": m, "messages": [{"role": "robot", "content": "x"}]}, None),
        ({"model": m}, "messages"),
        ({"messages": msgs}, "model"),
        ({"model": m, "messages": msgs, "stream": "yes"}, "stream"),
    ]
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as h:
        for body, param in bad_bodies:
            r = h.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "invalid_request_error" and err["message"]
            if param is not None:
                assert err["param"] == param, (body, err)
        long = {"model": m, "prompt": [1] * 5000, "max_tokens": 4}
        r = h.post("/v1/completions", json=long)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = h.post("/v1/completions", json={"model": m, "prompt": [10**6], "max_tokens": 4})
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
        r = h.post("/v1/completions", json={"model": m, "prompt": "x", "logprobs": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        for raw in (b'{"model": "x", "messages": [], "temperature": NaN}', b"{not json", b""):
            r = h.post(
                "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
            )
            assert r.status_code == 400, (raw, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = h.post("/v1/chat/completions", json={"model": "gpt-17", "messages": msgs})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    auths: list[dict[str, Any]] = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer ünïcödé".encode()},
        {"Authorization": "Basic abc"},
    ]
    for auth in auths:
        r = httpx.post(
            f"{server.url}/v1/chat/completions", json={"model": m, "messages": msgs}, headers=auth
        )
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        server.client("nope").models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200, "health needs no key"


# --- back-pressure and load ------------------------------------------------------------------


def test_overload_answers_429_and_every_accepted_request_completes() -> None:
    with start_server("--max-batch", "1", "--max-queue", "1") as srv:
        m = srv.model()
        c = srv.client()

        def one(i: int) -> tuple[int, str | None]:
            try:
                r = c.completions.create(model=m, prompt=f"Number {i}:", max_tokens=24)
                return 200, r.choices[0].finish_reason
            except openai.RateLimitError as exc:
                assert exc.response.headers.get("Retry-After")
                assert exc.body["code"] == "queue_full"  # type: ignore[index]
                return 429, None

        with cf.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        codes = [code for code, _ in results]
        assert 429 in codes and 200 in codes
        assert all(finish in ("stop", "length") for code, finish in results if code == 200)
        wait_idle(srv)


def test_load_32_clients_300_requests(server: Server) -> None:
    m = server.model()
    c = server.client(timeout=300)
    statuses: list[int] = []

    def client(k: int) -> list[int]:
        out = []
        for j in range(k, 300, 32):
            r = c.completions.with_raw_response.create(
                model=m, prompt=f"Item {j} is", max_tokens=3, temperature=0.5, seed=j
            )
            body = json.loads(r.text)
            assert body["usage"]["completion_tokens"] >= 1
            out.append(r.status_code)
        return out

    with cf.ThreadPoolExecutor(32) as pool:
        for codes in pool.map(client, range(32)):
            statuses.extend(codes)
    assert len(statuses) == 300
    assert all(s == 200 for s in statuses), sorted(set(statuses))
    wait_idle(server)


# --- the README's serving examples ------------------------------------------------------------

README = Path(__file__).parents[1] / "README.md"
README_URL, README_KEY = "http://127.0.0.1:8000", "sk-local"


def _readme_serve_blocks() -> tuple[str, str]:
    """The README's ``openai`` example (its one ``py`` block) and its ``curl`` example."""
    text = README.read_text(encoding="utf-8")
    (client_block,) = re.findall(r"^```py\n(.*?)^```", text, re.M | re.S)
    (curl_block,) = [b for b in re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S) if "curl" in b]
    return client_block, curl_block


def test_the_readme_openai_example_runs_against_the_server(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    client_block, _ = _readme_serve_blocks()
    assert README_URL in client_block and README_KEY in client_block
    code = client_block.replace(README_URL, server.url).replace(README_KEY, KEY)
    exec(compile(code, "README.md openai example", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip()  # it printed a reply and a stream


def test_the_readme_curl_example_is_a_valid_request(server: Server) -> None:
    _, curl_block = _readme_serve_blocks()
    url = re.search(r"curl -s (\S+)", curl_block)
    body = re.search(r"-d '(.*?)'", curl_block, re.S)
    assert url and body and f"Bearer {README_KEY}" in curl_block
    reply = httpx.post(
        url.group(1).replace(README_URL, server.url),
        headers={"Authorization": f"Bearer {KEY}"},
        json=json.loads(body.group(1)),
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"]
