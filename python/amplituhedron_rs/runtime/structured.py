"""Constraints on what a generation may output (SPEC §16): a JSON schema, any JSON object, a
regex, a Lark grammar, a GBNF grammar or a fixed choice, as the core's grammar kinds.

The engine enforces them token by token (``_core.Grammar``, llguidance): the allowed-token
mask is applied to the logits before the one sampling rule, end-of-sequence is allowed only
where the grammar accepts, and a sequence whose grammar is complete finishes there. A
constraint is compiled against the model's vocabulary once per request (never on the
server's event loop); what cannot be compiled is an InputError with llguidance's reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError
from amplituhedron_rs.runtime.gbnf import gbnf_to_lark
from amplituhedron_rs.runtime.tokenizer import Tokenizer

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]

#: Choices a ``choice`` constraint may list, and their total length.
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Constraint:
    """A constraint as written: what the engine compiles and a mesh ships to its exit
    station (``kind`` and ``text``)."""

    kind: GrammarKind
    text: str

    def compile(self, tokenizer: Tokenizer) -> _core.Grammar:
        """The grammar for ``tokenizer``'s model (InputError with the reason when it cannot
        be compiled). Releases the GIL while compiling; run it off an event loop."""
        return _core.Grammar(tokenizer.grammar_vocabulary(), self.kind, self.text)


def json_schema(schema: Mapping[str, Any] | bool | str) -> Constraint:
    """Output is JSON valid under ``schema`` (a dict, or its JSON text)."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return Constraint("json_schema", text)


def json_object() -> Constraint:
    """Output is any JSON object."""
    return Constraint("json_object", "")


def regex(pattern: str) -> Constraint:
    """Output matches ``pattern`` whole (Rust ``regex`` syntax)."""
    return Constraint("regex", pattern)


def lark(grammar: str) -> Constraint:
    """Output is a sentence of ``grammar`` (llguidance's Lark syntax)."""
    return Constraint("lark", grammar)


def gbnf(grammar: str) -> Constraint:
    """Output is a sentence of the GBNF ``grammar`` (llama.cpp's syntax), rewritten as Lark."""
    return Constraint("lark", gbnf_to_lark(grammar))


# A Lark rule or terminal definition ("name:" at a line's start); GBNF defines with "::=".
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z0-9_-]*(\.\d+)?\s*:(?!:=)", re.M)


def lark_or_gbnf(grammar: str) -> Constraint:
    """A grammar in Lark, or in llama.cpp's GBNF (it defines rules with ``::=`` and no rule
    with ``:``), which is rewritten as Lark."""
    if "::=" in grammar and not _LARK_RULE.search(grammar):
        return gbnf(grammar)
    return lark(grammar)


def choice(options: Sequence[str]) -> Constraint:
    """Output is exactly one of ``options``."""
    if not options:
        raise InputError("a choice needs at least one option")
    if len(options) > MAX_CHOICES:
        raise InputError(f"at most {MAX_CHOICES} choices, got {len(options)}")
    if any(not isinstance(o, str) or not o for o in options):
        raise InputError("every choice is a non-empty string")
    # Lark string literals are JSON strings.
    return Constraint("lark", "start: " + " | ".join(json.dumps(o) for o in options) + "\n")


def one_of(
    *,
    json_schema_: Mapping[str, Any] | bool | str | None = None,
    regex_: str | None = None,
    grammar: str | None = None,
) -> Constraint | None:
    """The Python API's constraint (``Model.generate(json_schema=, regex=, grammar=)``): at
    most one of them; ``grammar`` is Lark."""
    given = [
        c
        for c in (
            None if json_schema_ is None else json_schema(json_schema_),
            None if regex_ is None else regex(regex_),
            None if grammar is None else lark(grammar),
        )
        if c is not None
    ]
    if len(given) > 1:
        raise InputError("give at most one of json_schema, regex and grammar")
    return given[0] if given else None
