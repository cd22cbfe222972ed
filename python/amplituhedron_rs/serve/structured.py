"""Structured outputs on the wire (SPEC §16): every request field that constrains the output —
OpenAI's ``response_format``, vLLM's ``guided_*`` and ``structured_outputs``, llama.cpp's
``json_schema`` and ``grammar`` — read into one :class:`~amplituhedron_rs.runtime.structured.
Constraint`, compiled off the event loop, enforced by the engine token by token.

At most one constraint per request; two are a 400 naming both. A constraint llguidance
rejects, or one too large, is a 400 with its reason; nothing is half-applied. Compiled
grammars are kept (by kind and text) so repeated schemas — an agent's, a client library's —
compile once.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, StrictBool, model_validator

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError
from amplituhedron_rs.runtime import structured
from amplituhedron_rs.runtime.structured import Constraint
from amplituhedron_rs.runtime.tokenizer import Tokenizer
from amplituhedron_rs.serve.unicode import Text

#: vLLM's names of the one backend there is here (any other is refused: it would differ).
BACKENDS = ("auto", "guidance", "llguidance")


@dataclass(frozen=True)
class Requested:
    """A request's constraint and the field it came from (named in a 400)."""

    constraint: Constraint
    field: str


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is always honoured:
    the output follows the schema token by token)."""

    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = None
    strict: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _schema_key(cls, v: Any) -> Any:
        # `schema` shadows BaseModel.schema: read it under another name.
        if isinstance(v, dict) and "schema" in v:
            v = {**v, "schema_": v["schema"]}
        return v


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, any JSON object, or JSON under a schema (llama.cpp
    also puts a ``schema`` next to ``json_object``)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _schema_key(cls, v: Any) -> Any:
        if isinstance(v, dict) and "schema" in v:
            v = {k: val for k, val in v.items() if k != "schema"} | {"schema_": v["schema"]}
        return v

    def constraint(self) -> Constraint | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            if self.schema_ is not None:
                return structured.json_schema(self.schema_)
            return structured.json_object()
        schema = self.json_schema.schema_ if self.json_schema is not None else self.schema_
        if schema is None:
            raise ValueError("response_format: json_schema needs json_schema.schema")
        return structured.json_schema(schema)


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` object (one of ``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``; ``disable_any_whitespace`` is honoured)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | bool | Text | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = None
    backend: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _json_key(cls, v: Any) -> Any:
        if isinstance(v, dict) and "json" in v:
            v = {k: val for k, val in v.items() if k != "json"} | {"json_": v["json"]}
        return v


class StructuredFields(BaseModel):
    """The constraining fields of both endpoints, read into at most one constraint
    (:meth:`requested`)."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Text | None = None
    guided_whitespace_pattern: Text | None = None
    structured_outputs: StructuredOutputs | None = None
    #: llama.cpp server's: a JSON schema, and a GBNF grammar.
    json_schema: dict[str, Any] | bool | None = None
    grammar: Text | None = None

    _requested: Requested | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredFields:
        found = _constraints(self)
        if len(found) > 1:
            names = ", ".join(r.field for r in found)
            raise ValueError(f"{names}: give one constraint per request, not several")
        self._requested = found[0] if found else None
        return self

    def requested(self) -> Requested | None:
        """The request's constraint and the field it came from, if any."""
        return self._requested


def _constraints(f: StructuredFields) -> list[Requested]:
    out: list[Requested] = []

    def add(field: str, make: Any, *args: Any) -> None:
        try:
            c = make(*args)
        except (InputError, ValueError) as exc:
            message = str(exc)
            prefix = f"{field}: "
            raise ValueError(message if message.startswith(prefix) else prefix + message) from exc
        if c is not None:
            out.append(Requested(c, field))

    for name, backend in (
        ("guided_decoding_backend", f.guided_decoding_backend),
        ("structured_outputs.backend", f.structured_outputs and f.structured_outputs.backend),
    ):
        if backend and backend not in BACKENDS:
            raise ValueError(
                f"{name}: {backend!r} is not available; structured outputs use llguidance "
                f"(one of {', '.join(BACKENDS)})"
            )
    if f.guided_whitespace_pattern is not None:
        raise ValueError(
            "guided_whitespace_pattern: not supported (JSON is written with one space after "
            "',' and ':'; structured_outputs.disable_any_whitespace=false allows any)"
        )
    if f.response_format is not None:
        add("response_format", f.response_format.constraint)
    if f.guided_json is not None:
        add("guided_json", structured.json_schema, f.guided_json)
    if f.guided_regex is not None:
        add("guided_regex", structured.regex, f.guided_regex)
    if f.guided_choice is not None:
        add("guided_choice", structured.choice, f.guided_choice)
    if f.guided_grammar is not None:
        add("guided_grammar", structured.lark_or_gbnf, f.guided_grammar)
    if f.json_schema is not None:
        add("json_schema", structured.json_schema, f.json_schema)
    if f.grammar:
        add("grammar", structured.gbnf, f.grammar)
    so = f.structured_outputs
    if so is not None:
        parts = [
            ("structured_outputs.json", so.json_, lambda v: _with_whitespace(v, so)),
            ("structured_outputs.regex", so.regex, structured.regex),
            ("structured_outputs.choice", so.choice, structured.choice),
            ("structured_outputs.grammar", so.grammar, structured.lark_or_gbnf),
            (
                "structured_outputs.json_object",
                so.json_object or None,
                lambda _: _with_whitespace({"type": "object"}, so),
            ),
        ]
        for field, value, make in parts:
            if value is not None:
                add(field, make, value)
    return out


def _with_whitespace(schema: dict[str, Any] | bool | str, so: StructuredOutputs) -> Constraint:
    """A JSON constraint; ``disable_any_whitespace=false`` lets the JSON hold any
    whitespace (llguidance's flexible layout) instead of the compact default."""
    if so.disable_any_whitespace is not False:
        return structured.json_schema(schema)
    value = json.loads(schema) if isinstance(schema, str) else schema
    if isinstance(value, dict) and "x-guidance" not in value:
        value = {**value, "x-guidance": {"whitespace_flexible": True}}
    return structured.json_schema(value)


class GrammarCache:
    """Compiled grammars by (kind, text), the most recently used kept (a compiled grammar is
    shared by every sequence that follows it: each gets its own state)."""

    def __init__(self, tokenizer: Tokenizer, size: int = 64) -> None:
        self.tokenizer = tokenizer
        self.size = size
        self._grammars: OrderedDict[Constraint, _core.Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, c: Constraint) -> _core.Grammar:
        """The grammar of ``c`` (InputError with llguidance's reason when it has none)."""
        with self._lock:
            g = self._grammars.get(c)
            if g is not None:
                self._grammars.move_to_end(c)
                return g
        g = c.compile(self.tokenizer)
        with self._lock:
            self._grammars[c] = g
            while len(self._grammars) > self.size:
                self._grammars.popitem(last=False)
        return g

    async def compile_async(self, c: Constraint) -> _core.Grammar:
        """:meth:`compile` in a worker thread (compiling never runs on the event loop)."""
        return await asyncio.to_thread(self.compile, c)
