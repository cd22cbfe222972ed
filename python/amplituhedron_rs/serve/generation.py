"""One sequence's run: its validated parameters, and its engine events turned into reply text,
token counts, log-probabilities and a finish reason.

Every sequence is counted in the metrics exactly once, however it ends: the engine's end
(EOS, length, error), a stop sequence (the sequence is cancelled in the engine at once, and
its figures are those of the cancellation), or the client leaving (``abort``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs.runtime.tokenizer import Tokenizer
from amplituhedron_rs.serve import errors
from amplituhedron_rs.serve.frontend import (
    EngineFailed,
    EngineFront,
    GenerationParams,
    RequestStream,
)
from amplituhedron_rs.serve.metrics import ServeMetrics
from amplituhedron_rs.serve.protocol import chat_logprobs, completion_logprobs, usage
from amplituhedron_rs.serve.text import TextStream
from amplituhedron_rs.serve.tools import ToolPlan


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    params: GenerationParams
    stops: list[str]
    stream: bool
    include_usage: bool
    #: The prompt's text, when the reply starts with it (completions' ``echo``).
    echo: str | None = None
    #: The request's tools, when they play a part (chat).
    tools: ToolPlan | None = None


class Generation:
    """One sequence's run: its events turned into text, its counts, its finish reason."""

    def __init__(
        self,
        stream: RequestStream,
        tokenizer: Tokenizer,
        p: Prepared,
        metrics: ServeMetrics,
        started: float,
        front: EngineFront,
        index: int = 0,
    ) -> None:
        self.stream = stream
        self.front = front
        #: The choice's ``index`` in the reply.
        self.index = index
        self.tokenizer = tokenizer
        self.wants_logprobs = p.params.logprobs is not None
        #: Log-probabilities of the tokens whose text was sent, in order.
        self.sent_logprobs: list[_core.TokenLogprobs] = []
        self.echo = p.echo
        #: The request's tools (chat): the reply may be calls.
        self.tools = p.tools
        self.first_prompt_token = p.params.prompt[0]
        #: The prompt's tokens after the first, scored (echo with logprobs).
        self.prompt_scores: list[_core.TokenLogprobs] = []
        self.text = TextStream(tokenizer, p.stops)
        self.prompt_tokens = len(p.params.prompt)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason = "length"
        self.metrics = metrics
        self.started = started
        self.last_token_at: float | None = None
        #: Counted in the metrics (once, whatever ended it).
        self.recorded = False

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas as tokens arrive, each with the log-probabilities of the tokens whose
        text it completes (when asked for); ends when the sequence or a stop sequence ends.
        Tokens that send no text (a stop id, the tokens of a stop sequence) report none."""
        pending: list[_core.TokenLogprobs] = []

        def delta(piece: str) -> Delta:
            nonlocal pending
            sent, pending = pending, []
            self.sent_logprobs.extend(sent)
            return Delta(piece, sent)

        # A scored prompt is sent with its scores, when they come; else at once.
        if self.echo is not None and not self.wants_logprobs:
            yield Delta(self.echo, [], prompt=True)
        async for ev in self._events():
            if ev.kind == "prompt":
                self.prompt_scores = list(ev.prompt_logprobs or [])
                if self.echo is not None:
                    yield Delta(self.echo, self.prompt_scores, prompt=True)
                continue
            if ev.kind == "token":
                assert ev.token is not None
                self._timing()
                self.completion_tokens += 1
                if ev.logprobs is not None:
                    pending.append(ev.logprobs)
                piece = self.text.push(ev.token)
                if piece:
                    yield delta(piece)
                if self.text.stopped:
                    await self._stop_early()
                    return
                continue
            self._finished(ev)
            tail = self.text.finish()
            if tail:
                yield delta(tail)
            return

    async def _events(self) -> AsyncIterator[_core.EngineEvent]:
        try:
            async for ev in self.stream.events():
                yield ev
        except EngineFailed as exc:
            raise errors.engine_error(str(exc), 503) from exc

    async def collect(self) -> str:
        async for _ in self.deltas():
            pass
        return self.text.text

    def logprobs_payload(self, d: Delta, *, chat: bool, offset: int) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` object for a delta's tokens (None when the request asked
        for none); ``offset``: where their text starts in the reply (completions' offsets)."""
        if not self.wants_logprobs:
            return None
        if chat:
            return chat_logprobs(d.logprobs, self.tokenizer.token_bytes)
        first = self.first_prompt_token if d.prompt else None
        return completion_logprobs(d.logprobs, self.tokenizer.token_bytes, offset, first)

    def reply_logprobs(self, *, chat: bool) -> dict[str, Any] | None:
        """A whole (not streamed) reply's ``logprobs``: the echoed prompt's, then the
        completion's."""
        sent = Delta(self.text.text, self.sent_logprobs)
        if self.echo is None:
            return self.logprobs_payload(sent, chat=chat, offset=0)
        head = self.logprobs_payload(
            Delta(self.echo, self.prompt_scores, prompt=True), chat=chat, offset=0
        )
        tail = self.logprobs_payload(sent, chat=chat, offset=len(self.echo))
        if head is None or tail is None:
            return None
        return {key: head[key] + tail[key] for key in head}

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def abort(self) -> None:
        """The client left: the sequence stops now and is counted as ``abort`` with what
        the engine generated (nothing, when it had already ended)."""
        ev = self.front.cancel(self.stream)
        reason = "abort"
        if ev is None:
            # It had ended in the engine; its end may wait, unread, in the stream.
            while not self.stream.queue.empty():
                e = self.stream.queue.get_nowait()
                if not isinstance(e, EngineFailed) and e.kind == "finished":
                    ev = e
                    reason = {"cancelled": "abort"}.get(str(e.reason), str(e.reason))
        if ev is not None and not self.recorded:
            stats = ev.stats or {}
            self._record(stats, reason, int(stats.get("output_tokens", 0)))

    def _timing(self) -> None:
        t = time.perf_counter()
        if self.last_token_at is None:
            self.metrics.first_token(t - self.started)
        else:
            self.metrics.next_token(t - self.last_token_at)
        self.last_token_at = t

    async def _stop_early(self) -> None:
        """A stop sequence ended the reply: the engine stops the sequence (freeing its KV
        now, not after ``max_tokens``) and reports its figures, which count like any end."""
        self.finish_reason = "stop"
        ev = self.front.cancel(self.stream)
        if ev is not None:
            self.stream.finished = ev
        else:
            # It ended in the engine meanwhile: its own end is on its way.
            async for e in self.stream.events():
                ev = e
        assert ev is not None and ev.kind == "finished"
        self._finished(ev, reason="stop")

    def _finished(self, ev: _core.EngineEvent, reason: str | None = None) -> None:
        stats = ev.stats or {}
        self.cached_tokens = int(stats.get("cached_tokens", 0))
        if reason is None:
            reason = "error" if ev.reason == "error" else ev.reason or "stop"
        self._record(stats, reason, self.completion_tokens)
        if ev.reason == "error" and reason == "error":
            raise errors.engine_error(ev.error or "generation failed")
        self.finish_reason = "stop" if reason == "stop" else "length"

    def _record(self, stats: dict[str, int | float | bool], reason: str, generated: int) -> None:
        self.recorded = True
        e2e = time.perf_counter() - self.started
        self.metrics.finished(self.prompt_tokens, generated, stats, reason, e2e)


@dataclass(frozen=True)
class Delta:
    """A piece of reply text and the log-probabilities of the tokens it completes."""

    text: str
    logprobs: list[_core.TokenLogprobs]
    #: The echoed prompt (its first token unscored), not generated text.
    prompt: bool = False
