"""TEST-ONLY failure drill: a station that SIGKILLs itself at a chosen moment.

Failover must be tested at every phase of a generation (open, replay, a prefill chunk, a
decode step, the step that captures the prompt's volume), and a kill timed from outside
cannot hit one of them reliably. With ``AMPLITUHEDRON_TEST_DIE_ON=<phase>:<n>`` in its
environment (off by default: nothing reads it otherwise, and no flag or mesh file turns it
on), a station kills itself with SIGKILL on the ``n``-th request of that phase, after it did
the work and before it answers — the nastiest moment: its KV moved, the caller never hears.

Phases: ``open`` (``POST /sessions``), ``replay`` (``POST /amplituhedron/replay``), and for
``POST /batch/step``: ``capture`` (an entry ends its prompt and captures its volume),
``prefill`` (an entry is a prompt chunk), ``decode`` (decode rows only).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

#: The environment variable that arms the drill (tests and chaos drills only).
DIE_ON_ENV = "AMPLITUHEDRON_TEST_DIE_ON"
PHASES = ("open", "replay", "prefill", "decode", "capture")


def parse(value: str) -> tuple[str, int]:
    """``phase:n`` → (phase, n); ValueError if malformed."""
    phase, _, n = value.partition(":")
    if phase not in PHASES or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{DIE_ON_ENV} is <phase>:<n> with phase in {PHASES}, got {value!r}")
    return phase, int(n)


def phase_of(method: str, path: str, body: bytes) -> str | None:
    """The drill phase of an HTTP request (None: not one the drill counts)."""
    if method != "POST":
        return None
    if path == "/sessions":
        return "open"
    if path == "/amplituhedron/replay":
        return "replay"
    if path != "/batch/step" or len(body) < 4:
        return None
    n = int.from_bytes(body[:4], "little")
    return step_phase(body[4 : 4 + n])


def step_phase(head: bytes) -> str | None:
    """The drill phase of a batched step, from its JSON header (HTTP or the step stream)."""
    try:
        entries = json.loads(head)["entries"]
    except (ValueError, KeyError, TypeError):
        return None
    if any(e.get("capture") and e.get("last") for e in entries):
        return "capture"
    if any(e.get("kind") == "prefill" for e in entries):
        return "prefill"
    return "decode"


class Drill:
    """Counts requests of ``phase`` (over HTTP and the step stream alike): ``hit`` is true
    for the ``n``-th, whose answer must then never leave (:func:`die`)."""

    def __init__(self, phase: str, n: int) -> None:
        self.phase = phase
        self.n = n
        self.seen = 0

    def hit(self, phase: str | None) -> bool:
        if phase != self.phase:
            return False
        self.seen += 1
        return self.seen == self.n


def die() -> None:
    """SIGKILLs this process (after the work, before the answer)."""
    os.kill(os.getpid(), signal.SIGKILL)


class DieOn:
    """Pure ASGI middleware (inside the body limit, which has buffered the body): SIGKILLs
    this process when the ``drill``'s request answers."""

    def __init__(self, app: Any, drill: Drill) -> None:
        self.app = app
        self.drill = drill

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = await receive()
        body = message.get("body", b"") if message["type"] == "http.request" else b""
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return message
            return await receive()

        doomed = self.drill.hit(phase_of(scope["method"], scope["path"], body))

        async def send_or_die(msg: Any) -> None:
            if doomed and msg["type"] == "http.response.start":
                die()
            await send(msg)

        await self.app(scope, replay, send_or_die)


def armed() -> Drill | None:
    """The drill this process's environment asks for (None: off, the default)."""
    value = os.environ.get(DIE_ON_ENV)
    return Drill(*parse(value)) if value else None
