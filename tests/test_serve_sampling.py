"""The sampling controls of OpenAI and vLLM against the real server (SmolLM2, the official
``openai`` client), in process and over a 2-station mesh: ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty`` and ``logit_bias`` give the tokens a reference
computed here from the model's own logits gives; ``min_tokens`` forces the length;
``ignore_eos`` runs to ``max_tokens``; ``stop_token_ids`` stop; ``skip_special_tokens`` and
``include_stop_str_in_output`` shape the text; ``n`` choices equal separate requests seeded
``seed + i``; neutral values are the request without them, bit for bit; bad values are 400s
naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

import amplituhedron_rs as ar
from amplituhedron_rs.mesh.launcher import LocalMesh
from amplituhedron_rs.runtime.gguf_file import read_model_file
from amplituhedron_rs.runtime.sampling import SamplingParams
from amplituhedron_rs.runtime.tokenizer import Tokenizer
from test_serve import KEY, Server, start_server

pytestmark = [pytest.mark.model, pytest.mark.serve]

TOKEN = "sampling-mesh-token"
PROMPT = "The cat sat on the mat. The cat sat on the mat. The dog"
Adjust = dict[str, Any]


@pytest.fixture(scope="module")
def local() -> Iterator[Server]:
    with start_server("--max-batch", "8", "--max-queue", "64") as srv:
        yield srv


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with LocalMesh(2, token=TOKEN, station_args=["--max-sessions", "24"]) as spec:
        path = tmp_path_factory.mktemp("mesh") / "mesh.json"
        spec.write(path)
        args = ["--mesh", str(path), "--token", TOKEN, "--max-batch", "8", "--max-queue", "64"]
        with start_server(*args) as srv:
            yield srv


@pytest.fixture(scope="module", params=["local", "mesh"])
def server(request: pytest.FixtureRequest) -> Server:
    srv: Server = request.getfixturevalue(request.param)
    return srv


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(read_model_file())


@pytest.fixture(scope="module")
def model() -> Any:
    return ar.load_model(cache=ar.CacheOptions(enabled=False))


def complete(srv: Server, prompt: Any, **kw: Any) -> Any:
    extra = {k: kw.pop(k) for k in list(kw) if k not in _OPENAI_ARGS}
    return srv.client().completions.create(
        model=srv.model(), prompt=prompt, extra_body=extra or None, **kw
    )


_OPENAI_ARGS = {
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "n",
    "stop",
    "stream",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
}


def adjusted_row(
    row: np.ndarray[Any, np.dtype[np.float32]],
    prompt: list[int],
    out: list[int],
    adjust: Adjust,
    banned: list[int],
) -> np.ndarray[Any, np.dtype[np.float32]]:
    """The reference: the definitions, in float32, in vLLM's order (bias, the min_tokens
    mask, repetition over prompt and output, then frequency and presence over the output)."""
    lg = row.astype(np.float32).copy()
    for k, b in (adjust.get("logit_bias") or {}).items():
        lg[int(k)] = np.float32(lg[int(k)] + np.float32(b))
    if len(out) < adjust.get("min_tokens", 0):
        lg[banned] = -np.inf
    r = np.float32(adjust.get("repetition_penalty", 1.0))
    if r != 1:
        for t in set(prompt) | set(out):
            lg[t] = lg[t] / r if lg[t] > 0 else lg[t] * r
    freq = np.float32(adjust.get("frequency_penalty", 0.0))
    pres = np.float32(adjust.get("presence_penalty", 0.0))
    if freq or pres:
        for t in set(out):
            lg[t] = lg[t] - freq * np.float32(out.count(t))
            lg[t] = lg[t] - pres
    return lg


def reference(
    model: Any,
    prompt: list[int],
    n: int,
    adjust: Adjust,
    stop_ids: list[int],
    sampled: SamplingParams | None = None,
) -> list[int]:
    """The tokens the definitions give, from the model's logits computed here (a fresh run
    per position, no cache, no batch); greedy, or drawn by a plain sampler of ``sampled``
    from the adjusted row (the server's sampler applies the adjustments itself). Kept for
    the other backend's run."""
    key = repr((prompt, n, adjust, stop_ids, sampled))
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(model, prompt, n, adjust, stop_ids, sampled)
    return _REFERENCES[key]


_REFERENCES: dict[str, list[int]] = {}


def _reference(
    model: Any,
    prompt: list[int],
    n: int,
    adjust: Adjust,
    stop_ids: list[int],
    sampled: SamplingParams | None,
) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        row = model.logits(prompt + out)
        lg = adjusted_row(row, prompt, out, adjust, stop_ids)
        if sampled is None:
            t = int(np.argmax(lg))
        else:
            t = int(sampled.sampler().sample(lg, len(prompt) + len(out)))
        out.append(t)
        if t in stop_ids:
            break
    return out


def cases(greedy: list[int]) -> list[Adjust]:
    """Adjustments to check, some aimed at the plain greedy reply's tokens."""
    return [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.2},
        {"presence_penalty": -0.5, "frequency_penalty": 0.7},
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 0.7},
        {"logit_bias": {str(greedy[0]): -100, str(greedy[3]): 7.5}},
        {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "logit_bias": {"30": 4.5}},
    ]


def test_penalties_and_bias_follow_their_definitions(
    server: Server, model: Any, tok: Tokenizer
) -> None:
    prompt = tok.encode(PROMPT)
    eos = [tok.eos_id] if tok.eos_id is not None else []
    n = 10
    plain = complete(server, prompt, max_tokens=n).choices[0].text
    changed = 0
    for adjust in cases(reference(model, prompt, n, {}, eos)):
        want = reference(model, prompt, n, adjust, eos)
        r = complete(server, prompt, max_tokens=n, **adjust)
        got = r.choices[0].text
        assert got == tok.decode([t for t in want if t not in eos], skip_special=True), adjust
        assert r.usage.completion_tokens == len(want), adjust
        changed += got != plain
    # A confident model shrugs off some (measured: 3 of 7 change this reply).
    assert changed >= 3, changed
    # Sampled: the same adjustments, then the seeded draw.
    adjust = {"frequency_penalty": 0.8, "repetition_penalty": 1.2, "logit_bias": {"30": 2.0}}
    params = SamplingParams(temperature=0.9, seed=11)
    want = reference(model, prompt, n, adjust, eos, sampled=params)
    r = complete(server, prompt, max_tokens=n, temperature=0.9, seed=11, **adjust)
    assert r.choices[0].text == tok.decode([t for t in want if t not in eos], skip_special=True)


def chat_ids(tok: Tokenizer, user: str) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": user}])


def chat(srv: Server, user: str, **kw: Any) -> Any:
    extra = {k: kw.pop(k) for k in list(kw) if k not in _OPENAI_ARGS}
    return srv.client().chat.completions.create(
        model=srv.model(),
        messages=[{"role": "user", "content": user}],
        extra_body=extra or None,
        **kw,
    )


def test_min_tokens_ignore_eos_and_stop_token_ids(
    server: Server, model: Any, tok: Tokenizer
) -> None:
    user = "Say hi."
    short = chat(server, user, max_tokens=80)
    ended = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and ended < 30, "the model stops early"
    assert tok.eos_id is not None
    # min_tokens: EOS masked until then, as the definition says.
    m = chat(server, user, max_tokens=80, min_tokens=ended + 12)
    assert m.usage.completion_tokens >= ended + 12
    want = reference(model, chat_ids(tok, user), 80, {"min_tokens": ended + 12}, [tok.eos_id])
    assert m.usage.completion_tokens == len(want)
    assert m.choices[0].message.content == tok.decode(
        [t for t in want if t != tok.eos_id], skip_special=True
    )
    # ignore_eos: to max_tokens.
    long = chat(server, user, max_tokens=ended + 20, ignore_eos=True)
    assert long.usage.completion_tokens == ended + 20
    assert long.choices[0].finish_reason == "length"
    # stop_token_ids: the reply ends at the first one, its text left out (or kept, asked).
    ids = reference(model, chat_ids(tok, user), ended, {}, [tok.eos_id])
    stop = ids[2]
    first = ids.index(stop)
    s = chat(server, user, max_tokens=80, stop_token_ids=[stop])
    assert s.choices[0].finish_reason == "stop"
    assert s.usage.completion_tokens == first + 1
    assert s.choices[0].message.content == tok.decode(ids[:first], skip_special=True)
    kept = chat(server, user, max_tokens=80, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert kept.choices[0].message.content == tok.decode(ids[: first + 1], skip_special=True)
    # min_tokens also holds back the stop ids.
    held = chat(server, user, max_tokens=80, stop_token_ids=[stop], min_tokens=first + 3)
    assert held.usage.completion_tokens >= first + 3


def test_special_tokens_and_stop_strings_in_the_text(server: Server, tok: Tokenizer) -> None:
    user = "Say hi."
    plain = chat(server, user, max_tokens=80).choices[0].message.content
    assert tok.eos_id is not None
    eos_text = tok.decode([tok.eos_id])
    raw = (
        chat(
            server,
            user,
            max_tokens=80,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        )
        .choices[0]
        .message.content
    )
    assert raw == plain + eos_text
    # Without include_stop_str_in_output the EOS text stays out even when specials show.
    assert (
        chat(server, user, max_tokens=80, skip_special_tokens=False).choices[0].message.content
        == plain
    )
    stop = plain[3:6]
    cut = chat(server, user, max_tokens=80, stop=[stop], include_stop_str_in_output=True)
    assert cut.choices[0].message.content == plain[: plain.index(stop) + len(stop)]


def test_n_choices_equal_separate_requests_seeded_seed_plus_i(server: Server) -> None:
    user = "Write a short poem about rain."
    kw: dict[str, Any] = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.95}
    r = chat(server, user, n=4, seed=100, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = [chat(server, user, seed=100 + i, **kw) for i in range(4)]
    assert [c.message.content for c in r.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in r.choices}) > 1, "the seeds differ"
    # The prompt counts once; the completions add up.
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    # Streamed: each choice's deltas under its index.
    parts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chat(server, user, n=4, seed=100, stream=True, **kw):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [parts[i] for i in range(4)] == [c.message.content for c in r.choices]
    assert sorted(finish) == [0, 1, 2, 3]
    # Completions with two prompts: choices numbered prompt by prompt.
    prompts = ["The sky is", "My favourite fruit is"]
    two = complete(server, prompts, n=2, seed=7, max_tokens=8, temperature=0.8)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    for k, p in enumerate(prompts):
        for i in range(2):
            one = complete(server, p, seed=7 + i, max_tokens=8, temperature=0.8)
            assert two.choices[2 * k + i].text == one.choices[0].text, (p, i)


def test_n_choices_prefill_their_prompt_once(local: Server) -> None:
    user = "Describe the sea in one sentence, please, for a child of five years old."
    before = local.metric("amplituhedron:prefix_cache_hits_total")
    r = chat(local, user + " (n)", n=4, seed=3, max_tokens=4, temperature=0.7)
    hits = local.metric("amplituhedron:prefix_cache_hits_total") - before
    # Choices 2..n replay the whole prompt the first computed (the first may replay a
    # cached head, the chat template's system turn: usage counts the prompt once).
    first = r.usage.prompt_tokens_details.cached_tokens
    assert hits == 3 * r.usage.prompt_tokens + first


NEUTRAL: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0,
    "repetition_penalty": 1.0,
    "logit_bias": {"42": 0},
    "min_tokens": 0,
    "ignore_eos": False,
    "stop_token_ids": [],
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "n": 1,
}


def test_neutral_values_are_the_request_without_them(server: Server) -> None:
    prompt = "Once upon a time"
    for sampled in ({}, {"temperature": 0.8, "seed": 21}):
        absent = complete(server, prompt, max_tokens=12, logprobs=1, **sampled)
        given = complete(server, prompt, max_tokens=12, logprobs=1, **sampled, **NEUTRAL)
        a, g = absent.choices[0], given.choices[0]
        assert g.text == a.text
        assert g.logprobs.token_logprobs == a.logprobs.token_logprobs
        assert g.logprobs.tokens == a.logprobs.tokens


def test_bad_values_are_400s_naming_the_field(local: Server, tok: Tokenizer) -> None:
    vocab = tok.vocab_size
    bad: list[tuple[dict[str, Any], str]] = [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 1000}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(vocab): 1}}, "logit_bias"),
        ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop_token_ids": [vocab]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ]
    m = local.model()
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=local.url, headers=headers, timeout=60) as h:
        for fields, name in bad:
            body = {"model": m, "prompt": "Hello", "max_tokens": 8, **fields}
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 400, (fields, r.text)
            assert name in r.json()["error"]["message"], (fields, r.text)
        many = {"model": m, "prompt": ["a"] * 20, "max_tokens": 2, "n": 16}
        assert h.post("/v1/completions", json=many).status_code == 400
    with pytest.raises(openai.BadRequestError):
        complete(local, "Hello", max_tokens=4, n=20)
