"""OpenAI tool calling (SPEC §16): ``tools``, ``tool_choice``, ``parallel_tool_calls``, the
assistant's ``tool_calls`` and ``role: "tool"`` messages, rendered into the prompt and parsed
back out of the reply.

How tools reach the model:

- A chat template that knows tools (its source uses ``tools``) renders them itself, with the
  messages in Hugging Face's shape (assistant ``tool_calls`` with their arguments as objects,
  ``tool`` messages); the model is expected to answer in the Hermes form
  ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (Qwen 2.5's and Hermes').
- Any other template (both bundled models) gets the **generic format**: a system prompt
  that lists each function's name, description and JSON Schema and asks for a reply that is
  only ``{"tool_calls": [{"name": "<function>", "arguments": {…}}]}``; an earlier assistant
  call is written back in that form, and a tool's result becomes a user turn
  ``Result of <function> (<call id>): <content>`` (consecutive turns of one role are merged,
  for templates that require alternation).

``tool_choice``: ``none`` (tools are not shown, nothing is parsed), ``auto`` (free text;
a reply that is a call in either form becomes ``tool_calls``), ``required`` (at least one
call) and a named function (exactly that one) are **enforced by a grammar**: the output is a
JSON Schema (generic) or Lark (Hermes) language whose sentences are exactly the allowed calls
with arguments valid under each function's parameters (objects closed to undeclared
properties unless the schema says otherwise). A named function is called exactly
once; ``required`` allows as many calls as there are functions (small models otherwise repeat
a call until ``max_tokens``), one with ``parallel_tool_calls: false``.

The reply is read by one incremental parser (:mod:`.tool_parser`). Calls become
``message.tool_calls`` (``content: null`` unless there was text around them), their
``arguments`` the text the model wrote, with ``finish_reason: "tool_calls"``. Streamed, a
call is sent as it is written, as vLLM and OpenAI do: a ``delta.tool_calls`` entry with its
index, id and name once the name is known, then pieces of its arguments; the pieces of a call
concatenate to the whole reply's ``arguments``. Text that may begin a call is held until it
cannot, then sent as content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from amplituhedron_rs.runtime import structured
from amplituhedron_rs.runtime.structured import Constraint
from amplituhedron_rs.serve.tool_parser import CallParser, CallStart, Content, Event
from amplituhedron_rs.serve.unicode import Text

FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"
#: Tools one request may declare.
MAX_TOOLS = 128


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    #: The arguments' JSON Schema (none: no arguments, an empty object).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Text
    #: The arguments as a JSON text (OpenAI's wire form).
    arguments: Text


class ToolCall(BaseModel):
    """A call the assistant made, as a client sends it back in ``messages``."""

    model_config = ConfigDict(extra="ignore")
    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


def check_tools(tools: Sequence[ToolDef] | None, choice: ToolChoice | None) -> None:
    """ValueError (a 400) for tools that cannot be honoured: duplicate names, too many, or a
    ``tool_choice`` that names none of them / needs tools there are not."""
    if tools:
        if len(tools) > MAX_TOOLS:
            raise ValueError(f"tools: at most {MAX_TOOLS} tools")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be distinct")
    if isinstance(choice, NamedToolChoice):
        if not tools or choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(
                f"tool_choice: names function {choice.function.name!r}, which tools does not "
                "declare"
            )
    elif choice == "required" and not tools:
        raise ValueError("tool_choice: 'required' needs tools")


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its prompt, its constraint and its reply."""

    tools: list[FunctionDef]
    choice: ToolChoice
    parallel: bool
    #: The chat template renders tools itself (the Hermes form) rather than the generic one.
    native: bool

    @classmethod
    def of(
        cls,
        tools: Sequence[ToolDef] | None,
        choice: ToolChoice | None,
        parallel: bool | None,
        native: bool,
    ) -> ToolPlan | None:
        """The plan, or None when tools play no part (none declared, or ``tool_choice:
        "none"``)."""
        if not tools or choice == "none":
            return None
        return cls(
            tools=[t.function for t in tools],
            choice=choice if choice is not None else "auto",
            # A named function is called once (as vLLM and OpenAI do).
            parallel=parallel is not False and not isinstance(choice, NamedToolChoice),
            native=native,
        )

    @property
    def forced(self) -> bool:
        """The reply must be tool calls (``required`` or a named function)."""
        return self.choice != "auto"

    def allowed(self) -> list[FunctionDef]:
        if isinstance(self.choice, NamedToolChoice):
            return [f for f in self.tools if f.name == self.choice.function.name]
        return self.tools

    # --- the prompt ------------------------------------------------------------------------
    def system_prompt(self) -> str:
        """The generic format's instructions (see the module docstring)."""
        listed = "\n".join(
            json.dumps(
                {
                    "name": f.name,
                    "description": f.description or "",
                    "parameters": _parameters(f),
                }
            )
            for f in self.allowed()
        )
        how = "one or more calls" if self.parallel else "exactly one call"
        must = (
            "You must call a function."
            if self.forced
            else "Call a function only when it helps; otherwise answer normally."
        )
        return (
            "You can call these functions (their parameters are JSON Schemas):\n"
            f"{listed}\n{must} To call functions, reply with only this JSON object, "
            f'{how} in the list: {{"tool_calls": [{{"name": "<function name>", '
            '"arguments": {<the arguments>}}]}'
        )

    def constraint(self) -> Constraint | None:
        """The grammar that forces tool calls (``required`` / named), else None."""
        if not self.forced:
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": _closed(_parameters(f))},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.allowed()
        ]
        one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.native:
            # Hermes: <tool_call> blocks, each holding one call's JSON.
            block = '"<tool_call>\\n" %json ' + json.dumps(one) + ' "\\n</tool_call>"'
            more = len(calls) - 1 if self.parallel else 0
            rules = "start: call" + ' ("\\n" call)?' * more
            return structured.lark(f"{rules}\ncall: {block}\n")
        items: dict[str, Any] = {"type": "array", "items": one, "minItems": 1}
        # At most one call per function: a small model repeats calls until max_tokens.
        items["maxItems"] = len(calls) if self.parallel else 1
        return structured.json_schema(
            {
                "type": "object",
                "properties": {"tool_calls": items},
                "required": ["tool_calls"],
                "additionalProperties": False,
            }
        )

    # --- the reply -------------------------------------------------------------------------
    def reply(self) -> ToolReply:
        """Reads a reply to this request (:mod:`.tool_parser`)."""
        return ToolReply(CallParser({f.name for f in self.allowed()}, None if self.parallel else 1))


def _closed(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` and says nothing of others
    closed to them (``additionalProperties: false``, as OpenAI's strict mode has it): a
    forced call's arguments hold the declared parameters only (a small model otherwise
    invents properties until ``max_tokens``)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _parameters(f: FunctionDef) -> dict[str, Any]:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


# --- messages into the template --------------------------------------------------------------


def template_messages(
    messages: Sequence[dict[str, Any]], plan: ToolPlan | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (``role``, ``content``, and the assistant's ``tool_calls`` /
    a tool's ``tool_call_id`` and ``name``) as the chat template gets them, and the ``tools``
    it renders (native templates only). Without a plan (no tools), tool messages are still
    written in the generic form, so a conversation that used tools renders everywhere."""
    if plan is not None and plan.native:
        native = [_native(m) for m in messages]
        tools = [
            {"type": "function", "function": f.model_dump(exclude_none=True)} for f in plan.tools
        ]
        return native, tools
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                names[c.id] = c.function.name
                calls.append({"name": c.function.name, "arguments": _arguments(c)})
            written = json.dumps({"tool_calls": calls})
            content = f"{content}\n{written}" if content else written
        elif role == "tool":
            call = m.get("tool_call_id") or ""
            name = m.get("name") or names.get(call, "a function")
            role, content = "user", f"Result of {name} ({call}): {content}"
        out.append({"role": role, "content": content})
    if plan is not None:
        prompt = plan.system_prompt()
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    if any(m["role"] == "tool" for m in messages):
        out = _merged(out)
    return out, None


def _arguments(c: ToolCall) -> Any:
    try:
        return json.loads(c.function.arguments)
    except ValueError:
        return c.function.arguments


def _native(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c)},
            }
            for c in m["tool_calls"]
        ]
    for key in ("tool_call_id", "name"):
        if m.get(key):
            out[key] = m[key]
    return out


def _merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": f"{out[-1]['content']}\n\n{m['content']}"}
        else:
            out.append(m)
    return out


# --- the reply -------------------------------------------------------------------------------


class ToolReply:
    """A reply to a request with tools, as OpenAI's chat shapes: streamed, the ``delta`` of
    each chunk to send as text comes (:meth:`push`, then :meth:`finish`); whole, the same
    parse fed at once (:meth:`message`). A call's ``arguments`` are the text the model wrote,
    in both."""

    def __init__(self, parser: CallParser) -> None:
        self.parser = parser
        self.content = ""
        #: The calls so far, OpenAI's ``tool_calls`` (each with a fresh id).
        self.calls: list[dict[str, Any]] = []

    def push(self, text: str) -> list[dict[str, Any]]:
        """The deltas to send now, in order: ``{"content": …}`` or ``{"tool_calls": [one]}``
        (a call's start with its id, name and ``arguments: ""``, then pieces of its
        arguments)."""
        return self._deltas(self.parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held when the reply ended."""
        return self._deltas(self.parser.close())

    def finish_reason(self, engine: str) -> str:
        """``tool_calls`` when the reply made calls, unless it was cut short (``length``)."""
        return "tool_calls" if self.calls and engine != "length" else engine

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply ``text`` as the chat's ``message``."""
        self.push(text)
        self.finish()
        if not self.calls:
            return {"role": "assistant", "content": self.content}
        return {"role": "assistant", "content": self.content or None, "tool_calls": self.calls}

    def _deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Content):
                self.content += e.text
                out.append({"content": e.text})
                continue
            if isinstance(e, CallStart):
                cid = f"call_{uuid.uuid4().hex[:24]}"
                function = {"name": e.name, "arguments": ""}
                self.calls.append({"id": cid, "type": "function", "function": function})
                entry = {"index": e.index, "id": cid, "type": "function", "function": {**function}}
            else:
                self.calls[e.index]["function"]["arguments"] += e.text
                entry = {"index": e.index, "function": {"arguments": e.text}}
            out.append({"tool_calls": [entry]})
        return out
