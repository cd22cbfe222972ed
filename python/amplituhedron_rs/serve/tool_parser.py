"""The one parser of tool calls in a reply (SPEC §16). It reads the reply as it is generated,
so a streamed reply sends each call as it is written; a whole reply is the same parser fed
all at once, so the streamed pieces and the whole reply cannot disagree.

A reply is one of:

- the generic form, the whole reply: ``{"tool_calls": [{"name": …, "arguments": {…}}, …]}``;
- text with Hermes blocks ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` in it;
- text.

A call is an object with an allowed ``name`` and ``arguments`` (or ``parameters``), in either
order. Its arguments are the text the model wrote for the object, unchanged (so a streamed
call sends it character by character as it comes); arguments written as a JSON string are
that string's value, and none are ``{}``.

Nothing sent is taken back. Text that may still begin a call is held: from a reply's opening
``{``, from a ``<`` that may begin ``<tool_call>``, and whitespace (whitespace next to a call
is not content). A call is announced once its name is known to be allowed and its arguments
have begun; held text that turns out not to be a call is content after all (a reply with no
call is content exactly as written). After an announced call, anything that does not parse
ends the parse and the rest of the reply is ignored: a reply cut short keeps its calls, their
arguments as far as they were written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass
from typing import TypeVar

#: Sent to the parser when the reply ends, and read by it from then on.
EOF = ""
_JSON_SPACE = " \t\n\r"
_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"

_R = TypeVar("_R")
#: A parsing step: waits for characters (``yield``), returns a result.
_Step = Generator[None, str, _R]


@dataclass(frozen=True)
class Content:
    """Reply text that is not a call."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """Call ``index`` begins: its function's name (its arguments follow)."""

    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    """The next piece of call ``index``'s arguments."""

    index: int
    text: str


Event = Content | CallStart | CallArguments


class CallParser:
    """Feeds a reply's text in pieces (:meth:`feed`), then :meth:`close`; each returns the
    events that are now certain, merged (adjacent content, adjacent pieces of one call's
    arguments). ``names``: the functions that may be called; ``limit``: the calls reported
    (later ones are parsed and dropped, as ``parallel_tool_calls: false`` wants)."""

    def __init__(self, names: Collection[str], limit: int | None = None) -> None:
        self.names = frozenset(names)
        self.limit = limit
        #: Calls announced so far (counting those past ``limit``).
        self.calls = 0
        self._events: list[Event] = []
        self._held = ""  # read since the current attempt at a call began
        self._replay = ""  # held text of a failed attempt, to be read again as text
        self._space = ""  # whitespace not yet known to be content
        self._ended = False
        self._run = self._reply()
        next(self._run)

    def feed(self, text: str) -> list[Event]:
        for c in text:
            self._run.send(c)
        return self._take()

    def close(self) -> list[Event]:
        """The reply ended: whatever was held is decided."""
        if not self._ended:
            self._ended = True
            try:
                self._run.send(EOF)
            except StopIteration:
                pass
            else:  # every step returns once it reads EOF
                raise AssertionError("the tool-call parser did not finish at the end")
            if not self.calls and self._space:
                self._events.append(Content(self._space))
        return self._take()

    # --- output --------------------------------------------------------------------------

    def _take(self) -> list[Event]:
        out: list[Event] = []
        for e in self._events:
            last = out[-1] if out else None
            if isinstance(e, Content) and isinstance(last, Content):
                out[-1] = Content(last.text + e.text)
            elif (
                isinstance(e, CallArguments)
                and isinstance(last, CallArguments)
                and last.index == e.index
            ):
                out[-1] = CallArguments(e.index, last.text + e.text)
            else:
                out.append(e)
        self._events = []
        return out

    def _text(self, c: str) -> None:
        """``c`` is content; whitespace waits for content after it."""
        if c.isspace():
            self._space += c
        else:
            self._events.append(Content(self._space + c))
            self._space = ""

    def _reported(self, index: int) -> bool:
        return self.limit is None or index < self.limit

    # --- reading ---------------------------------------------------------------------------

    def _next(self) -> _Step[str]:
        if self._replay:
            c, self._replay = self._replay[0], self._replay[1:]
        elif self._ended:
            c = EOF
        else:
            c = yield
        self._held += c
        return c

    def _release(self) -> None:
        """The attempt that began the held text is not a call: its first character is
        content, and the rest is read again as text (another call may begin in it)."""
        self._text(self._held[0])
        self._replay = self._held[1:] + self._replay

    def _drain(self) -> _Step[None]:
        """After an announced call stopped parsing: the rest of the reply is ignored."""
        while (yield from self._next()) != EOF:
            pass

    def _space_from(self, c: str) -> _Step[str]:
        """The first character from ``c`` on that is not JSON whitespace."""
        while c and c in _JSON_SPACE:
            c = yield from self._next()
        return c

    def _after(self) -> _Step[str]:
        """The next character that is not JSON whitespace."""
        return (yield from self._space_from((yield from self._next())))

    def _literal(self, word: str) -> _Step[bool]:
        for w in word:
            if (yield from self._next()) != w:
                return False
        return True

    # --- the grammar ---------------------------------------------------------------------

    def _reply(self) -> _Step[None]:
        c = yield from self._next()
        while c.isspace():
            self._text(c)
            c = yield from self._next()
        if c == "{":
            self._held = c
            if (yield from self._generic()) or self.calls:
                yield from self._drain()  # what follows the calls is not read
                return
            self._release()
        else:
            self._replay = c + self._replay
        yield from self._text_and_blocks()

    def _text_and_blocks(self) -> _Step[None]:
        while True:
            self._held = ""
            c = yield from self._next()
            if c == EOF:
                return
            if c != "<":
                self._text(c)
                continue
            before = self.calls
            if (yield from self._hermes()):
                continue
            if self.calls > before:
                yield from self._drain()
                return
            self._release()

    def _generic(self) -> _Step[bool]:
        """After the reply's opening ``{``: ``"tool_calls": [call, …]}``."""
        key, c = yield from self._string((yield from self._after()))
        if key != "tool_calls" or (yield from self._space_from(c)) != ":":
            return False
        if (yield from self._after()) != "[":
            return False
        c = yield from self._after()
        while True:
            end = yield from self._call(c)
            if end is None:
                return False
            c = yield from self._space_from(end)
            if c == "]":
                return (yield from self._after()) == "}"
            if c != ",":
                return False
            c = yield from self._after()

    def _hermes(self) -> _Step[bool]:
        """After a ``<``: ``tool_call>``, one call, ``</tool_call>``."""
        if not (yield from self._literal(_OPEN[1:])):
            return False
        c = yield from self._next()
        while c.isspace():
            c = yield from self._next()
        end = yield from self._call(c)
        if end is None:
            return False
        while end.isspace():
            end = yield from self._next()
        return end == "<" and (yield from self._literal(_CLOSE[1:]))

    def _call(self, c: str) -> _Step[str | None]:
        """A call's object from ``c`` (``{``): the character after it, or None when it is not
        a call (announced or not: see :meth:`_reply`)."""
        if c != "{":
            return None
        index = self.calls
        name: str | None = None
        given = False  # the arguments have been read (or have begun)
        early: list[str] = []  # arguments written before the name

        def announce() -> None:
            assert name is not None
            self.calls += 1
            if self._reported(index):
                self._events.append(CallStart(index, name))
            for piece in early:
                argument(piece)

        def argument(piece: str) -> None:
            if self.calls <= index:
                early.append(piece)
            elif self._reported(index):
                self._events.append(CallArguments(index, piece))

        c = yield from self._after()
        while True:
            key, c = yield from self._string(c)
            if key is None or (yield from self._space_from(c)) != ":":
                return None
            c = yield from self._after()
            if key == "name" and name is None:
                name, c = yield from self._string(c)
                if name not in self.names:
                    return None
                if given:
                    announce()
            elif key in ("arguments", "parameters") and not given:
                given = True
                if c == "{":
                    if name is not None:
                        announce()
                    end = yield from self._compound(c, argument)
                elif c == '"':
                    value, end = yield from self._string(c)
                    if value is None:
                        return None
                    argument(value)
                    if name is not None:
                        announce()
                else:
                    return None
                if end is None:
                    return None
                c = end
            else:
                skipped = yield from self._value(c)
                if skipped is None:
                    return None
                c = skipped
            c = yield from self._space_from(c)
            if c == "}":
                break
            if c != ",":
                return None
            c = yield from self._after()
        if name is None:
            return None
        if self.calls <= index:
            if not given:
                early.append("{}")
            announce()
        return (yield from self._next())

    # --- JSON values ---------------------------------------------------------------------

    def _string(self, c: str) -> _Step[tuple[str | None, str]]:
        """A JSON string from ``c`` (its opening quote): its value (None when it is not one)
        and the character after it."""
        if c != '"':
            return None, c
        raw, escaped = c, False
        while True:
            c = yield from self._next()
            if c == EOF:
                return None, c
            raw += c
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                break
        try:
            value = json.loads(raw)
        except ValueError:
            return None, c
        return value, (yield from self._next())

    def _compound(self, c: str, sink: Callable[[str], None]) -> _Step[str | None]:
        """An object or array from ``c``, each character to ``sink`` as it is read (its
        contents are not checked: the grammar does that, when there is one): the character
        after it, or None when the reply ends first."""
        depth, in_string, escaped = 0, False, False
        while c != EOF:
            sink(c)
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return (yield from self._next())
            c = yield from self._next()
        return None

    def _value(self, c: str) -> _Step[str | None]:
        """Skips any JSON value from ``c``: the character after it, or None."""
        if c == '"':
            value, end = yield from self._string(c)
            return None if value is None else end
        if c and c in "{[":
            return (yield from self._compound(c, lambda _: None))
        ends = ",}]" + _JSON_SPACE  # a number, true, false or null runs until one of these
        if not c or c in ends:
            return None
        while c and c not in ends:
            c = yield from self._next()
        return c
