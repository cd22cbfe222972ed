"""llama.cpp's GBNF grammars, rewritten in llguidance's Lark syntax (SPEC §16).

GBNF (llama.cpp ``grammars/README.md``): rules ``name ::= expr``; string literals
``"..."`` (escapes ``\\n \\r \\t \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH``), character classes
``[a-z]`` / ``[^...]``, ``.`` (any character), grouping, ``|``, ``* + ?`` and ``{m}``,
``{m,}``, ``{m,n}``; ``#`` comments; the start rule is ``root``. Every construct has a Lark
counterpart, so the rewrite is one to one: rules become ``g_<name>`` (Lark rule names are
lowercase; GBNF's may hold ``-`` and capitals), literals become JSON-quoted Lark strings,
classes and ``.`` become regexes whose characters are all written ``\\x{…}``. What is not
GBNF (an unknown character, an undefined rule, no ``root``) is refused with an InputError
that says where.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from amplituhedron_rs._core import InputError

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_SPACE = re.compile(r"(?:\s|#[^\n]*)*")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


@dataclass(frozen=True)
class _Tok:
    kind: str  # name, define, string, class, any, open, close, bar, op, repeat
    text: str
    at: int


def gbnf_to_lark(source: str) -> str:
    """The Lark grammar equivalent to the GBNF grammar ``source`` (InputError when it is not
    GBNF)."""
    tokens = _tokenize(source)
    rules: dict[str, list[_Tok]] = {}
    order: list[str] = []
    i = 0
    while i < len(tokens):
        if not (
            tokens[i].kind == "name" and i + 1 < len(tokens) and tokens[i + 1].kind == "define"
        ):
            raise _error(source, tokens[i].at, "expected a rule ('name ::= ...')")
        name = tokens[i].text
        if name in rules:
            raise _error(source, tokens[i].at, f"rule {name!r} is defined twice")
        j = i + 2
        while j < len(tokens) and not (
            tokens[j].kind == "name" and j + 1 < len(tokens) and tokens[j + 1].kind == "define"
        ):
            j += 1
        rules[name] = tokens[i + 2 : j]
        order.append(name)
        i = j
    if "root" not in rules:
        raise InputError("GBNF grammar: no 'root' rule")
    names = _lark_names(order)
    lines = [f"start: {names['root']}"]
    for name in order:
        body = rules[name]
        if not body:
            raise InputError(f"GBNF grammar: rule {name!r} is empty")
        parser = _Body(source, body, names)
        lines.append(f"{names[name]}: {parser.parse()}")
    return "\n".join(lines) + "\n"


def _lark_names(order: list[str]) -> dict[str, str]:
    """A distinct lowercase Lark rule name per GBNF rule."""
    out: dict[str, str] = {}
    used: set[str] = set()
    for name in order:
        base = "g_" + name.lower().replace("-", "_")
        candidate, k = base, 1
        while candidate in used:
            k += 1
            candidate = f"{base}_{k}"
        used.add(candidate)
        out[name] = candidate
    return out


def _tokenize(source: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    n = len(source)
    while True:
        m = _SPACE.match(source, pos)
        pos = m.end() if m else pos
        if pos >= n:
            return out
        c = source[pos]
        if source.startswith("::=", pos):
            out.append(_Tok("define", "::=", pos))
            pos += 3
        elif c == '"':
            end = _string_end(source, pos)
            out.append(_Tok("string", source[pos:end], pos))
            pos = end
        elif c == "[":
            end = _class_end(source, pos)
            out.append(_Tok("class", source[pos:end], pos))
            pos = end
        elif c == "{":
            m = _REPEAT.match(source, pos)
            if not m:
                raise _error(source, pos, "a repetition is {m}, {m,} or {m,n}")
            out.append(_Tok("repeat", m.group(0), pos))
            pos = m.end()
        elif c in "()|*+?.":
            kind = {"(": "open", ")": "close", "|": "bar", ".": "any"}.get(c, "op")
            out.append(_Tok(kind, c, pos))
            pos += 1
        elif m := _NAME.match(source, pos):
            out.append(_Tok("name", m.group(0), pos))
            pos = m.end()
        else:
            raise _error(source, pos, f"unexpected character {c!r}")


def _string_end(source: str, pos: int) -> int:
    i = pos + 1
    while i < len(source):
        if source[i] == "\\":
            i += 2
        elif source[i] == '"':
            return i + 1
        elif source[i] == "\n":
            break
        else:
            i += 1
    raise _error(source, pos, "an unterminated string")


def _class_end(source: str, pos: int) -> int:
    i = pos + 1
    while i < len(source):
        if source[i] == "\\":
            i += 2
        elif source[i] == "]":
            return i + 1
        else:
            i += 1
    raise _error(source, pos, "an unterminated character class")


def _unescape(source: str, text: str, at: int) -> list[tuple[str, bool]]:
    """The characters of a literal's or class's inside, escapes decoded, each with whether
    it was escaped (an escaped ``-`` in a class is a dash, not a range)."""
    out: list[tuple[str, bool]] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c != "\\":
            out.append((c, False))
            i += 1
            continue
        if i + 1 >= len(text):
            raise _error(source, at, "a dangling backslash")
        e = text[i + 1]
        if e in _SIMPLE_ESCAPES:
            out.append((_SIMPLE_ESCAPES[e], True))
            i += 2
        elif e in _HEX_ESCAPES:
            width = _HEX_ESCAPES[e]
            digits = text[i + 2 : i + 2 + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise _error(source, at, f"\\{e} needs {width} hex digits")
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise _error(source, at, f"\\{e}{digits} is not a character")
            out.append((chr(code), True))
            i += 2 + width
        else:
            # GBNF passes other escaped characters through (\-, \^, \/ ...).
            out.append((e, True))
            i += 2
    return out


def _rx_char(c: str) -> str:
    return c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}"


class _Body:
    """A recursive-descent parse of one rule's body, written back as Lark."""

    def __init__(self, source: str, tokens: list[_Tok], names: dict[str, str]) -> None:
        self.source, self.tokens, self.names, self.i = source, tokens, names, 0

    def parse(self) -> str:
        out = self.alternates()
        if self.i < len(self.tokens):
            t = self.tokens[self.i]
            raise _error(self.source, t.at, f"unexpected {t.text!r}")
        return out

    def peek(self) -> _Tok | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def alternates(self) -> str:
        parts = [self.sequence()]
        while (t := self.peek()) is not None and t.kind == "bar":
            self.i += 1
            parts.append(self.sequence())
        return " | ".join(parts)

    def sequence(self) -> str:
        items: list[str] = []
        while (t := self.peek()) is not None and t.kind not in ("bar", "close"):
            items.append(self.repeated())
        # An empty alternative matches the empty string.
        return " ".join(items) if items else '""'

    def repeated(self) -> str:
        item = self.atom()
        while (t := self.peek()) is not None and t.kind in ("op", "repeat"):
            self.i += 1
            if t.kind == "op":
                item = f"({item}){t.text}"
            else:
                m = _REPEAT.match(t.text)
                assert m is not None
                lo, comma, hi = m.group(1), m.group(2), m.group(3)
                if hi and int(hi) < int(lo):
                    raise _error(self.source, t.at, f"{{{lo},{hi}}}: the bounds are reversed")
                bounds = lo if not comma else f"{lo},{hi}"
                item = f"({item}){{{bounds}}}"
        return item

    def atom(self) -> str:
        t = self.peek()
        if t is None:
            last = self.tokens[-1]
            raise _error(self.source, last.at, "the rule ends too early")
        self.i += 1
        if t.kind == "name":
            if t.text not in self.names:
                raise _error(self.source, t.at, f"rule {t.text!r} is not defined")
            return self.names[t.text]
        if t.kind == "string":
            chars = _unescape(self.source, t.text[1:-1], t.at)
            return json.dumps("".join(c for c, _ in chars))
        if t.kind == "class":
            inner = t.text[1:-1]
            negated = inner.startswith("^")
            chars = _unescape(self.source, inner[1:] if negated else inner, t.at)
            if not chars:
                raise _error(self.source, t.at, "an empty character class")
            rx = "".join(
                "-" if c == "-" and not escaped and 0 < k < len(chars) - 1 else _rx_char(c)
                for k, (c, escaped) in enumerate(chars)
            )
            return f"/[{'^' if negated else ''}{rx}]/"
        if t.kind == "any":
            return "/(?s:.)/"
        if t.kind == "open":
            inner = self.alternates()
            close = self.peek()
            if close is None or close.kind != "close":
                raise _error(self.source, t.at, "an unclosed '('")
            self.i += 1
            return f"({inner})"
        raise _error(self.source, t.at, f"unexpected {t.text!r}")


def _error(source: str, at: int, what: str) -> InputError:
    line = source.count("\n", 0, at) + 1
    col = at - (source.rfind("\n", 0, at) + 1) + 1
    return InputError(f"GBNF grammar, line {line} column {col}: {what}")
