"""The incremental tool-call parser (``serve/tool_parser.py``) and the chat shapes built on it
(``serve/tools.py``'s ``ToolReply``): the pieces of a call concatenate to its whole
arguments, text is never taken for a call, a reply split anywhere parses the same, and the
streamed deltas add up to the whole reply's message."""

from __future__ import annotations

from typing import Any

import pytest

from amplituhedron_rs.serve.tool_parser import CallArguments, CallParser, CallStart, Content, Event
from amplituhedron_rs.serve.tools import ToolDef, ToolPlan

NAMES = ("get_weather", "get_time")
ARGS = '{"city": "Oslo", "unit": "celsius", "note": "a \\"quoted\\" {brace} and [bracket]"}'
GENERIC = '{"tool_calls": [{"name": "get_weather", "arguments": ' + ARGS + "}]}"
TWO = (
    '{"tool_calls": [{"arguments": {"zone": "Europe/Oslo"}, "name": "get_time"}, '
    '{"name": "get_weather", "parameters": "{\\"city\\": \\"Rome\\"}"}]}'
)
HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_weather"}</tool_call>\nDone. '
)
TEXTS = [
    "The weather in Oslo is sunny.",
    "  leading and trailing whitespace \n",
    '{"answer": 42, "tool_calls": []}',
    '{"tool_calls": []}',
    '{"tool_calls": [{"name": "launch_rockets", "arguments": {}}]}',
    '{"tool_calls": [{"arguments": 5, "name": "get_time"}]}',
    "a < b, <b>bold</b>, <tool_cal and <tool_call>not json</tool_call>",
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    "ends with a partial tag <tool_ca",
    '{"tool_calls": [{"name": "get_wea',
    "",
]
CALLS = [GENERIC, TWO, HERMES, GENERIC + "\n\n trailing words", GENERIC[:-20]]


def assemble(events: list[Event]) -> tuple[str, list[list[str]]]:
    """The content and the ``[name, arguments]`` of each call that ``events`` add up to."""
    calls: list[list[str]]
    content, calls = "", []
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallStart):
            assert e.index == len(calls)
            calls.append([e.name, ""])
        else:
            calls[e.index][1] += e.text
    return content, calls


def parse(pieces: list[str], limit: int | None = None) -> list[Event]:
    p = CallParser(NAMES, limit)
    events = [e for piece in pieces for e in p.feed(piece)]
    return events + p.close()


def test_the_arguments_pieces_concatenate_to_the_text_the_model_wrote() -> None:
    events = parse(list(GENERIC))  # one character at a time, as a stream may come
    pieces = [e.text for e in events if isinstance(e, CallArguments)]
    assert len(pieces) == len(ARGS) and "".join(pieces) == ARGS
    assert assemble(events) == ("", [["get_weather", ARGS]])
    assert parse([GENERIC]) == [CallStart(0, "get_weather"), CallArguments(0, ARGS)]


def test_calls_in_both_forms_in_any_key_order() -> None:
    assert assemble(parse([TWO])) == (
        "",
        [["get_time", '{"zone": "Europe/Oslo"}'], ["get_weather", '{"city": "Rome"}']],
    )
    # Text around Hermes blocks is content; whitespace next to a block is not.
    assert assemble(parse([HERMES])) == (
        "Let me check.\n\n\nDone.",
        [["get_time", '{"zone": "Europe/Oslo"}'], ["get_weather", "{}"]],
    )
    # parallel_tool_calls: false reports the first call only.
    assert assemble(parse([TWO], limit=1)) == ("", [["get_time", '{"zone": "Europe/Oslo"}']])


def test_what_follows_the_calls_is_ignored_and_a_cut_call_keeps_its_arguments() -> None:
    assert assemble(parse([GENERIC + " and more"]))[1] == [["get_weather", ARGS]]
    assert assemble(parse([GENERIC[:-20]])) == ("", [["get_weather", ARGS[:-17]]])


@pytest.mark.parametrize("text", TEXTS)
def test_a_text_reply_is_content_exactly_as_written(text: str) -> None:
    assert assemble(parse([text])) == (text, [])
    assert assemble(parse(list(text))) == (text, [])


def test_text_goes_out_once_it_cannot_begin_a_call() -> None:
    p = CallParser(NAMES)
    assert p.feed("Hello") == [Content("Hello")]
    assert p.feed(" <") == []  # a space and a "<" that may begin <tool_call>
    assert p.feed("b") == [Content(" <b")]
    p = CallParser(NAMES)
    assert p.feed('{"tool_calls": [{"name": "get_wea') == []
    p = CallParser(NAMES)
    assert p.feed('{"answer":') == [Content('{"answer":')]


@pytest.mark.parametrize("text", TEXTS + CALLS)
def test_a_reply_split_anywhere_parses_the_same(text: str) -> None:
    whole = assemble(parse([text]))
    for i in range(len(text) + 1):
        assert assemble(parse([text[:i], text[i:]])) == whole, i
    assert assemble(parse(list(text))) == whole


def plan(choice: Any = "auto", parallel: bool | None = None) -> ToolPlan:
    tools = [ToolDef.model_validate({"type": "function", "function": {"name": n}}) for n in NAMES]
    out = ToolPlan.of(tools, choice, parallel, native=False)
    assert out is not None
    return out


@pytest.mark.parametrize("text", [*CALLS, *TEXTS])
def test_the_streamed_deltas_add_up_to_the_whole_message(text: str) -> None:
    whole = plan().reply()
    message = whole.message(text)
    streamed = plan().reply()
    deltas = [d for piece in text for d in streamed.push(piece)] + streamed.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for entry in d.get("tool_calls", []):
            if "id" in entry:
                assert entry["id"].startswith("call_") and entry["type"] == "function"
                assert entry["function"]["arguments"] == ""
                calls[entry["index"]] = [entry["function"]["name"], ""]
            calls[entry["index"]][1] += entry["function"]["arguments"]
    expected = [[c["function"]["name"], c["function"]["arguments"]] for c in whole.calls]
    assert list(calls.values()) == expected
    assert (message["content"] or "") == content
    if expected:
        assert message["tool_calls"] == whole.calls
        assert whole.finish_reason("stop") == "tool_calls"
        assert whole.finish_reason("length") == "length"
    else:
        assert message == {"role": "assistant", "content": text}
        assert whole.finish_reason("stop") == "stop"
