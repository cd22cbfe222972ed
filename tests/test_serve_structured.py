"""Structured outputs and tool calling through the OpenAI-compatible server (SPEC §16), with
the clients users run: the official ``openai`` client's ``parse`` with a Pydantic model,
``langchain-openai``'s ``with_structured_output`` and ``bind_tools``, ``litellm``'s tool
calls; vLLM's ``guided_*`` / ``structured_outputs`` and llama.cpp's ``json_schema`` /
``grammar`` fields. Every constrained reply is validated with ``jsonschema``; greedy
constrained replies are identical alone and in a batch of 8 mixed with free ones, with and
without drafts, in one process and over a 2-station mesh; what cannot be honoured is a 400
that says why. Gemma 3 (a base model: no chat template) is constrained through completions."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field, SecretStr

from structured_schemas import ALL, PROMPTS
from test_serve import KEY, Server, start_server

pytestmark = [pytest.mark.model, pytest.mark.serve]

SYSTEM = "You are a helpful assistant. Answer with JSON when asked."
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS: list[Any] = [WEATHER_TOOL, TIME_TOOL]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with start_server("--max-batch", "8", "--max-queue", "64") as srv:
        yield srv


def post(srv: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{srv.url}{path}",
        json={"model": srv.model(), **body},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=300,
    )


def messages(user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def json_reply(srv: Server, name: str, **extra: Any) -> Any:
    """A chat reply under ``response_format`` for schema ``name``, validated."""
    schema = ALL[name]
    body = {
        "messages": messages(PROMPTS[name]),
        "max_tokens": 320,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        },
        **extra,
    }
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    jsonschema.validate(value, schema)
    return choice["message"]["content"]


def check_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        name = c["function"]["name"]
        assert name in names, name
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMETERS[name])


# --- response_format, and the peers' fields ---------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_response_format_reply_validates(server: Server, name: str) -> None:
    json_reply(server, name)


def test_openai_parse_returns_the_pydantic_model(server: Server) -> None:
    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population_millions: float = Field(ge=0, le=50)

    c = server.client()
    r = c.beta.chat.completions.parse(
        model=server.model(),
        messages=messages("Describe the capital of France."),  # type: ignore[arg-type]
        response_format=City,
        max_tokens=200,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City), r
    assert r.choices[0].finish_reason == "stop"


def test_json_object_mode_and_streaming_agree(server: Server) -> None:
    c = server.client()
    kw: dict[str, Any] = {
        "model": server.model(),
        "messages": messages("Describe a dog as a short JSON object: its name and age."),
        "max_tokens": 400,
        "response_format": {"type": "json_object"},
    }
    whole = c.chat.completions.create(**kw)
    text = whole.choices[0].message.content or ""
    assert isinstance(json.loads(text), dict)
    parts = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(stream=True, **kw)
        if ch.choices
    ]
    assert "".join(parts) == text


def test_vllm_and_llama_cpp_fields_are_honoured(server: Server) -> None:
    schema = ALL["person"]
    user = messages(PROMPTS["person"])
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        r = post(server, "/v1/chat/completions", {"messages": user, "max_tokens": 200, **extra})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    choices = ["red", "green", "blue"]
    lark = 'start: "Answer: " ("yes" | "no")\n'
    gbnf = 'root ::= "Answer: " ("yes" | "no")\n'
    cases: list[tuple[dict[str, Any], str]] = [
        ({"guided_regex": date}, date),
        ({"structured_outputs": {"regex": date}}, date),
        ({"guided_choice": choices}, "red|green|blue"),
        ({"structured_outputs": {"choice": choices}}, "red|green|blue"),
        ({"guided_grammar": lark}, "Answer: (yes|no)"),
        ({"guided_grammar": gbnf}, "Answer: (yes|no)"),
        ({"grammar": gbnf}, "Answer: (yes|no)"),
    ]
    import re

    for extra, pattern in cases:
        for path, body in (
            ("/v1/chat/completions", {"messages": messages("Answer the question."), **extra}),
            ("/v1/completions", {"prompt": "Q: is water wet?\n", **extra}),
        ):
            r = post(server, path, {"max_tokens": 30, **body})
            assert r.status_code == 200, (extra, r.text)
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            assert re.fullmatch(pattern, text), (extra, text)
            assert choice["finish_reason"] == "stop"
    # llama.cpp's json_schema, and response_format, on completions.
    for extra in (
        {"json_schema": schema},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        {"response_format": {"type": "json_object", "schema": schema}},
    ):
        r = post(
            server, "/v1/completions", {"prompt": "A person as JSON: ", "max_tokens": 200, **extra}
        )
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


def test_constraints_that_cannot_be_honoured_are_400_with_the_reason(server: Server) -> None:
    user = messages("hi")
    big = {"type": "object", "description": "x" * 300_000}
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "wat"}},
                }
            },
            "response_format",
            "json_schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", ""),
        ({"guided_json": big}, "guided_json", "at most"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
        ({"guided_grammar": "root ::= nothing\n"}, "guided_grammar", "not defined"),
        ({"grammar": 'root ::= "a" @'}, "grammar", "GBNF"),
        ({"guided_json": ALL["person"], "guided_regex": "a"}, "", "one constraint"),
        (
            {"guided_json": ALL["person"], "guided_decoding_backend": "xgrammar"},
            "guided_decoding_backend",
            "llguidance",
        ),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", ""),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "guided_json": ALL["person"]},
            "guided_json",
            "tool",
        ),
    ]
    for extra, param, words in cases:
        r = post(server, "/v1/chat/completions", {"messages": user, "max_tokens": 8, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert words.lower() in err["message"].lower(), (extra, err)
        if param:
            assert param in (err["param"] or "") or param in err["message"], (extra, err)


# --- tools -------------------------------------------------------------------------------------


def test_required_and_named_tool_choice_are_enforced(server: Server) -> None:
    user = messages("What is the weather in Paris, and the time in Europe/Paris?")
    for choice, parallel, names in [
        ("required", None, {"get_weather", "get_time"}),
        ("required", False, {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, None, {"get_time"}),
    ]:
        body: dict[str, Any] = {
            "messages": user,
            "tools": TOOLS,
            "tool_choice": choice,
            "max_tokens": 200,
        }
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        assert c["message"]["content"] is None
        check_calls(c["message"]["tool_calls"], names)
        if parallel is False:
            assert len(c["message"]["tool_calls"]) == 1


def streamed(c: Any, kw: dict[str, Any]) -> tuple[str, list[list[Any]], str | None]:
    """A streamed chat's content, each call's ``delta.tool_calls`` entries (by index), and
    its finish reason."""
    content, finish = "", None
    calls: dict[int, list[Any]] = {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                calls.setdefault(d.index, []).append(d)
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def streamed_calls(c: Any, kw: dict[str, Any]) -> list[tuple[str, str]]:
    """A streamed chat's calls, ``(name, arguments)``, checked to come as vLLM and OpenAI
    send them: each first with its id and name (``arguments: ""``), then the arguments'
    pieces; the calls equal the same request's whole reply's (apart from their ids)."""
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls, whole
    content, calls, finish = streamed(c, kw)
    assert finish == "tool_calls" and content == (whole.message.content or "")
    out = []
    for head, *pieces in calls:
        assert head.id.startswith("call_") and head.type == "function", head
        assert head.function.name and head.function.arguments == ""
        assert all(p.id is None and p.function.name is None for p in pieces)
        out.append((head.function.name, "".join(p.function.arguments for p in pieces)))
        # A call's arguments come as they are written, not whole at the end.
        assert len(pieces) > 1, pieces
    assert out == [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    return out


#: A conversation in which SmolLM2 answers ``tool_choice: "auto"`` with a call (it writes
#: text when nothing shows it the form), and its last question, which it answers in text.
CALLED_BEFORE: list[dict[str, Any]] = []
for i, (city, result) in enumerate([("Oslo", "sunny, 18"), ("Madrid", "cloudy, 21")]):
    args = json.dumps({"city": city, "unit": "celsius"})
    CALLED_BEFORE += [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": args},
                }
            ],
        },
        {"role": "tool", "tool_call_id": f"call_{i}", "content": result},
        {"role": "assistant", "content": f"It is {result.split(',')[0]} in {city}."},
    ]


def test_tool_calls_stream_as_they_are_written(server: Server) -> None:
    c = server.client()
    base: dict[str, Any] = {"model": server.model(), "tools": TOOLS, "max_tokens": 200}
    both = messages("What is the weather in Paris, and the time in Europe/Paris?")
    forced: list[tuple[dict[str, Any], set[str]]] = [
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, {"get_time"}),
        ({"tool_choice": "required"}, {"get_weather", "get_time"}),
        ({"tool_choice": "required", "parallel_tool_calls": False}, {"get_weather", "get_time"}),
    ]
    for extra, names in forced:
        calls = streamed_calls(c, {**base, "messages": both, **extra})
        for name, arguments in calls:
            assert name in names
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])
        if extra.get("parallel_tool_calls") is False:
            assert len(calls) == 1
    rome = [*CALLED_BEFORE, {"role": "user", "content": "What is the weather in Rome?"}]
    assert streamed_calls(c, {**base, "messages": rome, "tool_choice": "auto"}) == [
        ("get_weather", '{"city": "Rome", "unit": "celsius"}')
    ]


def test_an_auto_reply_in_text_streams_as_the_same_content(server: Server) -> None:
    c = server.client()
    thanks = [*CALLED_BEFORE, {"role": "user", "content": "Thanks! How are you?"}]
    # A reply that begins like a call ("{") is held, then sent once it cannot be one.
    braces = messages("What is the weather in Rome? Reply with only the JSON object.")
    for msgs, opening in [(thanks, ""), (braces, "{")]:
        kw: dict[str, Any] = {
            "model": server.model(),
            "messages": msgs,
            "tools": TOOLS,
            "max_tokens": 60,
        }
        whole = c.chat.completions.create(**kw).choices[0]
        assert not whole.message.tool_calls and whole.message.content, whole
        assert whole.message.content.startswith(opening)
        content, calls, finish = streamed(c, kw)
        assert (content, calls, finish) == (whole.message.content, [], whole.finish_reason)


def test_a_conversation_with_tool_calls_round_trips(server: Server) -> None:
    c = server.client()
    kw: dict[str, Any] = {
        "model": server.model(),
        "messages": messages("What is the weather in Oslo?"),
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 120,
    }
    calls = c.chat.completions.create(**kw).choices[0].message.tool_calls
    assert calls
    # The call and its result go back; the model answers in text.
    history = [
        *kw["messages"],
        {"role": "assistant", "content": None, "tool_calls": [t.model_dump() for t in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"sky": "clear", "celsius": 18}'},
    ]
    answer = c.chat.completions.create(
        model=server.model(), messages=history, tools=TOOLS, max_tokens=30
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_tool_choice_parses_a_call_or_answers_in_text(server: Server) -> None:
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": messages("Call get_weather for Rome."), "tools": TOOLS, "max_tokens": 80},
    )
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    if c["message"].get("tool_calls"):
        assert c["finish_reason"] == "tool_calls"
        check_calls(c["message"]["tool_calls"], {"get_weather", "get_time"})
    else:
        assert c["message"]["content"] is not None


def test_langchain_structured_output_and_bound_tools(server: Server) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class Movie(BaseModel):
        """A film."""

        title: str = Field(max_length=50)
        year: int = Field(ge=1890, le=2030)

    llm = ChatOpenAI(
        model=server.model(),
        base_url=f"{server.url}/v1",
        api_key=SecretStr(KEY),
        max_completion_tokens=200,
    )
    methods: tuple[Literal["json_schema", "function_calling"], ...] = (
        "json_schema",
        "function_calling",
    )
    for method in methods:
        movie = llm.with_structured_output(Movie, method=method).invoke(
            "Name a famous science fiction film."
        )
        assert isinstance(movie, Movie), (method, movie)

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Lisbon?"
    )
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert isinstance(reply.tool_calls[0]["args"]["city"], str)


def test_litellm_tool_calls(server: Server) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    r = litellm.completion(
        model=f"openai/{server.model()}",
        api_base=f"{server.url}/v1",
        api_key=KEY,
        messages=messages("What is the weather in Madrid?"),
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    check_calls([c.model_dump() for c in calls], {"get_weather", "get_time"})


def test_tokenize_renders_tools_as_the_chat_endpoint_does(server: Server) -> None:
    user = messages("What is the weather in Oslo?")
    plain = post(server, "/tokenize", {"messages": user}).json()["count"]
    counts = []
    extras: list[dict[str, Any]] = [
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        {"tools": TOOLS, "parallel_tool_calls": False},
        {"messages": [*CALLED_BEFORE, *user], "tools": TOOLS},
    ]
    for extra in extras:
        body = {"messages": user, **extra}
        counted = post(server, "/tokenize", body)
        assert counted.status_code == 200, counted.text
        chat = post(server, "/v1/chat/completions", {**body, "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        assert counted.json()["count"] == chat.json()["usage"]["prompt_tokens"], extra
        counts.append(counted.json()["count"])
    assert all(n > plain for n in counts)
    # Validated as the chat endpoint validates them.
    refused: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "x"),
    ]
    for extra, words in refused:
        r = post(server, "/tokenize", {"messages": user, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


# --- invariants: batched ≡ alone, drafts, the mesh --------------------------------------------


def mixed_bodies() -> list[tuple[str, dict[str, Any]]]:
    """Eight greedy requests: constrained (several schemas, a regex, forced tools) and free."""
    names = sorted(ALL)
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(8):
        if i % 4 == 3:
            body = {"messages": messages(f"Tell me about the number {i}."), "max_tokens": 24}
        elif i % 4 == 2:
            body = {
                "messages": messages("Weather in Bergen?"),
                "tools": TOOLS,
                "tool_choice": "required",
                "max_tokens": 120,
            }
        else:
            name = names[i % len(names)]
            body = {
                "messages": messages(PROMPTS[name]),
                "max_tokens": 320,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": ALL[name]},
                },
            }
        out.append(("/v1/chat/completions", body))
    return out


def reply_of(srv: Server, path: str, body: dict[str, Any]) -> Any:
    r = post(srv, path, body)
    assert r.status_code == 200, r.text
    m = r.json()["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    return m["content"], calls


def concurrent_replies(srv: Server, bodies: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda pb: reply_of(srv, *pb), bodies))


def test_batched_equals_alone_with_and_without_drafts(server: Server) -> None:
    bodies = mixed_bodies()
    alone = [reply_of(server, p, b) for p, b in bodies]
    assert concurrent_replies(server, bodies) == alone
    drafted = [(p, {**b, "draft": "prompt-lookup"}) for p, b in bodies]
    assert concurrent_replies(server, drafted) == alone


@pytest.mark.mesh
def test_the_mesh_server_gives_the_same_constrained_replies(server: Server) -> None:
    bodies = mixed_bodies()
    alone = [reply_of(server, p, b) for p, b in bodies]
    with start_server("--stations", "2", "--max-batch", "8") as mesh:
        assert [reply_of(mesh, p, b) for p, b in bodies] == alone
        assert concurrent_replies(mesh, bodies) == alone
        drafted = [(p, {**b, "draft": "prompt-lookup"}) for p, b in bodies]
        assert concurrent_replies(mesh, drafted) == alone
        # A schema the exit station's llguidance rejects never reaches it: the server refuses.
        bad = {"messages": messages("x"), "guided_json": {"type": "wat"}}
        assert post(mesh, "/v1/chat/completions", bad).status_code == 400


# --- Gemma 3: a base model, constrained through completions ------------------------------------


def test_gemma_completions_follow_response_format(gemma_path: Any) -> None:
    with start_server("--model", str(gemma_path), "--max-batch", "4") as srv:
        for name in sorted(ALL):
            schema = ALL[name]
            r = post(
                srv,
                "/v1/completions",
                {
                    "prompt": PROMPTS[name] + "\nJSON: ",
                    "max_tokens": 320,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": name, "schema": schema},
                    },
                },
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop", (name, choice)
            jsonschema.validate(json.loads(choice["text"]), schema)
