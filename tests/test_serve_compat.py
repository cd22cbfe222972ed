"""The server as a drop-in for vLLM users, as a real process over real HTTP: a request ended
by a stop sequence counted in its usage and in every metric; completions with several
prompts (strings or token-id lists), plain and streamed; explicit JSON nulls; the tokenizer
endpoints and ``models.retrieve``; the metrics a vLLM Grafana dashboard queries, and our own
dashboard's; and lm-evaluation-harness's ``local-completions`` request shapes answered as
in-process scoring answers them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from amplituhedron_rs.runtime.gguf_file import read_model_file
from amplituhedron_rs.runtime.tokenizer import Tokenizer
from test_serve import KEY, Server, chat, start_server, wait_idle

pytestmark = [pytest.mark.model, pytest.mark.serve]

DASHBOARD = Path(__file__).parents[1] / "docs" / "grafana" / "amplituhedron.json"
#: Every series vLLM's own Grafana dashboard (examples/observability/prometheus_grafana/
#: grafana.json) queries, with ``vllm:`` renamed.
VLLM_DASHBOARD_SERIES = [
    "e2e_request_latency_seconds_bucket",
    "e2e_request_latency_seconds_sum",
    "e2e_request_latency_seconds_count",
    "prompt_tokens_total",
    "generation_tokens_total",
    "inter_token_latency_seconds_bucket",
    "inter_token_latency_seconds_sum",
    "inter_token_latency_seconds_count",
    "num_requests_running",
    "num_requests_waiting",
    "time_to_first_token_seconds_bucket",
    "time_to_first_token_seconds_sum",
    "time_to_first_token_seconds_count",
    "kv_cache_usage_perc",
    "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket",
    "request_success_total",
    "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum",
    "request_decode_time_seconds_sum",
    "request_max_num_generation_tokens_sum",
]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with start_server("--max-batch", "8", "--max-queue", "64") as srv:
        yield srv


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(read_model_file())


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    )


def samples(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels) → value."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(
        httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    ):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


# --- a stop sequence ends a request: usage and every metric count it ------------------------


def test_a_request_ended_by_a_stop_sequence_counts_in_usage_and_every_metric(
    server: Server,
) -> None:
    c, m = server.client(), server.model()
    user = "List three colours."
    full = chat(c, m, user, max_tokens=200).choices[0].message.content
    assert full and len(full) > 12
    stop = full[8:12]
    wait_idle(server)
    label = (("model_name", m),)
    counts = [
        "amplituhedron:e2e_request_latency_seconds_count",
        "amplituhedron:time_to_first_token_seconds_count",
        "amplituhedron:request_queue_time_seconds_count",
        "amplituhedron:request_prefill_time_seconds_count",
        "amplituhedron:request_decode_time_seconds_count",
        "amplituhedron:request_inference_time_seconds_count",
        "amplituhedron:request_prompt_tokens_count",
        "amplituhedron:request_generation_tokens_count",
    ]
    before = samples(server)
    r = chat(c, m, user, max_tokens=200, stop=[stop])  # its prompt was cached by the first
    after = samples(server)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]
    u = r.usage
    assert u.prompt_tokens_details.cached_tokens == u.prompt_tokens, "was 0 with a stop"

    def delta(name: str, labels: tuple[tuple[str, str], ...] = label) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("amplituhedron:prompt_tokens_total") == u.prompt_tokens
    assert delta("amplituhedron:generation_tokens_total") == u.completion_tokens
    assert delta("amplituhedron:prefix_cache_queries_total") == u.prompt_tokens
    assert delta("amplituhedron:prefix_cache_hits_total") == u.prompt_tokens
    assert delta("amplituhedron:prefix_cache_full_hits_total") == 1
    reason = tuple(sorted({"model_name": m, "finished_reason": "stop"}.items()))
    assert delta("amplituhedron:request_success_total", reason) == 1
    for name in counts:
        assert delta(name) == 1, name
    # The engine stopped the sequence at the stop, not at max_tokens.
    decode_rows = tuple(sorted({"model_name": m, "kind": "decode"}.items()))
    assert delta("amplituhedron:engine_rows_total", decode_rows) < u.completion_tokens + 8
    wait_idle(server)
    # Streamed: the same.
    before = samples(server)
    text = ""
    for chunk in chat(c, m, user, max_tokens=200, stop=[stop], stream=True):
        for ch in chunk.choices:
            text += ch.delta.content or ""
    after = samples(server)
    assert text == full[: full.index(stop)]
    assert delta("amplituhedron:request_success_total", reason) == 1
    assert delta("amplituhedron:generation_tokens_total") == u.completion_tokens
    wait_idle(server)


# --- several prompts per request ------------------------------------------------------------


def test_completions_take_a_list_of_prompts_one_choice_each(server: Server, tok: Tokenizer) -> None:
    c, m = server.client(), server.model()
    texts = ["The capital of France is", "Two plus two equals", "My favourite colour is"]
    solo = [c.completions.create(model=m, prompt=t, max_tokens=6) for t in texts]
    both = c.completions.create(model=m, prompt=texts, max_tokens=6)
    assert [ch.index for ch in both.choices] == [0, 1, 2]
    assert [ch.text for ch in both.choices] == [s.choices[0].text for s in solo]
    assert both.usage is not None
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in solo if s.usage)
    assert both.usage.completion_tokens == sum(s.usage.completion_tokens for s in solo if s.usage)
    # Token-id lists, echo and logprobs per prompt.
    ids = [tok.encode(t) for t in texts]
    by_ids = c.completions.create(model=m, prompt=ids, max_tokens=6, echo=True, logprobs=1)
    for ch, t, s in zip(by_ids.choices, texts, solo, strict=True):
        assert ch.text == t + s.choices[0].text
        assert ch.logprobs is not None and ch.logprobs.token_logprobs is not None
        n = len(tok.encode(t))
        assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.tokens is not None
        assert ch.logprobs.tokens[:n] == [tok.token_bytes(i).decode() for i in tok.encode(t)]
        assert len(ch.logprobs.token_logprobs) > n
    # Streamed: each choice's deltas, tagged with its index, spell its text.
    streamed = ["", "", ""]
    finishes: dict[int, str] = {}
    for chunk in c.completions.create(
        model=m, prompt=texts, max_tokens=6, stream=True, stream_options={"include_usage": True}
    ):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == both.usage.completion_tokens
    assert streamed == [s.choices[0].text for s in solo]
    assert finishes == {i: s.choices[0].finish_reason for i, s in enumerate(solo)}
    # A bad prompt refuses the request: nothing runs.
    r = post(server, "/v1/completions", {"model": m, "prompt": [[1, 2], [10**6]]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"model": m, "prompt": [[1, 2], []]})
    assert r.status_code == 400
    wait_idle(server)


def test_explicit_nulls_mean_not_given(server: Server) -> None:
    m = server.model()
    given = {"model": m, "prompt": "The weather today is", "max_tokens": 5}
    nulls = {
        k: None
        for k in (
            "n", "stream", "logprobs", "echo", "stop", "temperature", "top_p", "seed", "user",
            "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "suffix",
            "best_of", "guided_json", "repetition_penalty",
        )
    }  # fmt: skip
    plain, with_nulls = (post(server, "/v1/completions", b) for b in (given, given | nulls))
    assert with_nulls.status_code == 200, with_nulls.text
    assert with_nulls.json()["choices"] == plain.json()["choices"]
    messages = [{"role": "user", "content": "Is it cold?"}]
    body = {"model": m, "messages": messages, "max_tokens": 5}
    chat_nulls = {k: None for k in ("n", "stream", "logprobs", "top_logprobs", "stop", "tools")}
    r = post(server, "/v1/chat/completions", body | chat_nulls | {"max_completion_tokens": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == post(server, "/v1/chat/completions", body).json()["choices"]


# --- tokenizer endpoints and models.retrieve ------------------------------------------------


def test_tokenize_and_detokenize_speak_vllms_shapes(server: Server, tok: Tokenizer) -> None:
    m = server.model()
    text = "Hello, world! <|im_end|>"
    r = post(server, "/tokenize", {"model": m, "prompt": text, "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == [tok.token_text(t) for t in body["tokens"]]
    card = server.client().models.retrieve(m).model_extra or {}
    assert body["max_model_len"] == card["max_model_len"]
    assert tok.eos_id in body["tokens"], "special tokens written in the text are recognised"
    back = post(server, "/detokenize", {"model": m, "tokens": body["tokens"]}).json()
    assert back == {"prompt": text}
    # Messages: exactly the ids the chat endpoint runs.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    r2 = post(server, "/v1/chat/completions", {"model": m, "messages": messages, "max_tokens": 1})
    assert len(ids) == r2.json()["usage"]["prompt_tokens"]
    assert ids == tok.encode(tok.render_chat(messages))
    open_ = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert len(open_.json()["tokens"]) < len(ids)
    bad: list[tuple[str, dict[str, Any], int]] = [
        ("/tokenize", {"prompt": "x", "model": "gpt-17"}, 404),
        ("/tokenize", {"prompt": "x", "bogus": 1}, 400),
        ("/tokenize", {"messages": messages, "add_special_tokens": True}, 400),
        ("/detokenize", {"tokens": [10**6]}, 400),
        ("/detokenize", {"tokens": [-1]}, 400),
    ]
    for path, b, status in bad:
        r = post(server, path, b)
        assert r.status_code == status, (path, b, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 401
    info = httpx.get(
        f"{server.url}/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    assert info["eos_token"] == tok.token_text(tok.eos_id or 0) == "<|im_end|>"
    assert info["chat_template"] == tok.chat_template


def test_models_retrieve(server: Server) -> None:
    c, m = server.client(), server.model()
    card = c.models.retrieve(m)
    assert card.id == m and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-17")


# --- metrics: vLLM's dashboard, and ours ----------------------------------------------------


def test_a_vllm_dashboard_and_ours_find_every_series_they_query(server: Server) -> None:
    c, m = server.client(), server.model()
    chat(c, m, "Name a month.", max_tokens=4)
    c.completions.create(model=m, prompt="Once upon a time", max_tokens=4)
    names = {(n, dict(labels).get("model_name")) for n, labels in samples(server)}
    for series in VLLM_DASHBOARD_SERIES:
        assert (f"amplituhedron:{series}", m) in names, series
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 20
    used = {n for e in exprs for n in re.findall(r"amplituhedron:[a-z0-9_:]+", e)}
    assert "vllm:" not in json.dumps(dashboard)
    for name in sorted(used):
        assert (name, m) in names, name
    # Every series of ours is charted or listed in the docs.
    docs = (DASHBOARD.parents[1] / "serving.md").read_text()
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n, _ in names}
    for family in families:
        if family.startswith("amplituhedron:"):
            assert family.removeprefix("amplituhedron:") in docs, family


# --- lm-evaluation-harness's local-completions ----------------------------------------------

#: A few loglikelihood requests as lm-eval makes them: (context, continuation).
LOGLIKELIHOOD = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " Berlin"),
    ("Question: What colour is the sky?\nAnswer:", " blue"),
    ("Two plus two equals", " four, of course"),
]
UNTIL = ["\n\n", "Question:", "."]


def _reference_loglikelihood(
    model: Any, ctx: list[int], cont: list[int]
) -> tuple[list[float], bool]:
    """Each continuation token's log-probability and whether all are the argmax, from one
    whole-sequence forward pass in this process."""
    from amplituhedron_rs import _core

    rows = model.logits_all(ctx + cont)[len(ctx) - 1 : len(ctx) + len(cont) - 1]
    scores = [_core.token_logprobs(row, t, 1) for row, t in zip(rows, cont, strict=True)]
    greedy = all(int(np.argmax(row)) == t for row, t in zip(rows, cont, strict=True))
    return [s.logprob for s in scores], greedy


def test_lm_evaluation_harness_local_completions_shapes(server: Server) -> None:
    """lm-eval's local-completions with its remote tokenizer (auto-detected through
    /tokenizer_info and /tokenize) and tokenized batches: loglikelihood as lists of token-id
    lists with echo, logprobs 1 and max_tokens 1 (its default) or 0, parsed as lm-eval parses
    them; generate-until with stop. Answers equal in-process scoring, bit for bit."""
    import amplituhedron_rs as ar

    m = server.model()
    info = httpx.get(f"{server.url}/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"})
    assert "eos_token" in info.json()

    def encode(text: str) -> list[int]:
        r = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
        tokens: list[int] = r.json()["tokens"]
        return tokens

    eos = info.json()["eos_token"]
    assert encode(eos) == [Tokenizer(read_model_file()).eos_id]
    model = ar.load_model(cache=ar.CacheOptions(enabled=False))
    pairs = [(encode(ctx), encode(cont)) for ctx, cont in LOGLIKELIHOOD]
    expected = [_reference_loglikelihood(model, ctx, cont) for ctx, cont in pairs]
    for max_tokens in (1, 0):
        payload = {
            "model": m,
            "prompt": [ctx + cont for ctx, cont in pairs],
            "temperature": 0,
            "max_tokens": max_tokens,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        r = post(server, "/v1/completions", payload)
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda ch: ch["index"])
        assert len(choices) == len(pairs)
        for ch, (ctx, cont), (want, greedy) in zip(choices, pairs, expected, strict=True):
            lp = ch["logprobs"]
            end = len(ctx) + len(cont)
            assert len(lp["token_logprobs"]) == end + max_tokens
            got = lp["token_logprobs"][len(ctx) : end]
            assert got == want, "bit-exact, as JSON floats"
            tops = lp["top_logprobs"][len(ctx) : end]
            assert all(t == max(top.values()) for t, top in zip(got, tops, strict=True)) == greedy
    # generate_until: token-id prompts, greedy, the task's stops plus the EOS text.
    contexts = ["Question: What is the largest planet?\nAnswer:", "Once upon a time"]
    prompts = [encode(t) for t in contexts]
    payload = {
        "prompt": prompts,
        "model": m,
        "max_tokens": 24,
        "temperature": 0,
        "stop": [*UNTIL, eos],
        "seed": 1234,
    }
    r = post(server, "/v1/completions", payload)
    assert r.status_code == 200, r.text
    texts: list[str | None] = [None] * len(contexts)
    for ch in r.json()["choices"]:
        texts[ch["index"]] = ch["text"]
    for text, ctx in zip(texts, prompts, strict=True):
        full = model.generate(ctx, 24).text
        cuts = [i for s in UNTIL if (i := full.find(s)) >= 0]
        assert text == (full[: min(cuts)] if cuts else full)
    wait_idle(server)
