"""What a request's reply looks like on the wire: the JSON of a finished reply's usage, the
server-sent events of a streamed one (chunks, tool-call deltas, the usage tail), and the
waiting for non-streamed generations that a client's disconnect cancels."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from amplituhedron_rs.serve.errors import APIError
from amplituhedron_rs.serve.generation import Delta, Generation
from amplituhedron_rs.serve.protocol import usage
from amplituhedron_rs.serve.tools import ToolStream, stream_deltas


@dataclass(frozen=True)
class ChunkShape:
    rid: str
    created: int
    model: str
    chat: bool

    def chunk(
        self,
        index: int,
        delta: str | None,
        finish: str | None,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish}
        if self.chat:
            d: dict[str, Any] = {}
            if first:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            if tool_calls is not None:
                d["tool_calls"] = tool_calls
            choice["delta"] = d
            choice["logprobs"] = logprobs
            obj = "chat.completion.chunk"
        else:
            choice["text"] = delta or ""
            choice["logprobs"] = logprobs
            obj = "text_completion"
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def total_usage(gens: list[Generation]) -> dict[str, Any]:
    """A request's usage: its sequences' completions summed, each prompt counted once (by
    its first choice), as OpenAI counts ``n`` choices."""
    firsts = [g for g in gens if g.choice == 0]
    return usage(
        sum(g.prompt_tokens for g in firsts),
        sum(g.completion_tokens for g in gens),
        sum(g.cached_tokens for g in firsts),
    )


async def sse(
    gens: list[Generation], shape: ChunkShape, include_usage: bool
) -> AsyncIterator[bytes]:
    """Server-sent events: each sequence's deltas as they come, tagged with its choice's
    index, and each choice's end; the client leaving cancels every sequence (Starlette
    cancels this generator, and `finally` hands the cancel to the engine). With tools, text
    that may be a call is held until the reply ends (:class:`~.tools.ToolStream`)."""
    queue: asyncio.Queue[tuple[Generation, Delta | APIError | None]] = asyncio.Queue()

    async def pump(g: Generation) -> None:
        try:
            async for d in g.deltas():
                await queue.put((g, d))
            await queue.put((g, None))
        except APIError as exc:
            await queue.put((g, exc))

    tasks: list[asyncio.Task[None]] = []
    try:
        if shape.chat:
            for g in gens:
                yield _event(shape.chunk(g.index, "", None, first=True))
        tasks = [asyncio.ensure_future(pump(g)) for g in gens]
        sent = {g.index: 0 for g in gens}  # characters of reply text so far (text offsets)
        held = {g.index: ToolStream(g.tools) for g in gens if g.tools is not None}
        left = len(gens)
        while left:
            g, item = await queue.get()
            if isinstance(item, APIError):
                # Headers are gone: report in-band, as OpenAI does, then end the stream.
                yield _event(
                    {"error": {"message": item.message, "type": item.type, "code": item.code}}
                )
                return
            hold = held.get(g.index)
            if item is None:
                left -= 1
                finish = g.finish_reason
                if hold is not None:
                    text, calls = hold.finish()
                    if text:
                        yield _event(shape.chunk(g.index, text, None))
                    if calls is not None:
                        deltas = stream_deltas(calls)
                        yield _event(shape.chunk(g.index, None, None, tool_calls=deltas))
                        finish = "tool_calls"
                final = shape.chunk(g.index, None if shape.chat else "", finish)
                if include_usage:
                    final["usage"] = None
                yield _event(final)
                continue
            logprobs = g.logprobs_payload(item, chat=shape.chat, offset=sent[g.index])
            sent[g.index] += len(item.text)
            text = item.text if hold is None else hold.push(item.text)
            if not text and hold is not None and logprobs is None:
                continue
            yield _event(shape.chunk(g.index, text, None, logprobs=logprobs))
        if include_usage:
            tail = shape.chunk(0, None, None)
            tail["choices"] = []
            tail["usage"] = total_usage(gens)
            yield _event(tail)
        yield b"data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            if g.stream.finished is None:
                g.abort()


async def until_done_or_disconnect(gens: list[Generation], request: Request) -> list[str]:
    """Awaits non-streamed generations, cancelling them all if the client disconnects first
    (or one of them fails)."""
    tasks = [asyncio.ensure_future(g.collect()) for g in gens]
    waiter = asyncio.ensure_future(_disconnected(request.receive))
    try:
        work: asyncio.Future[list[str]] = asyncio.gather(*tasks)
        pending: set[asyncio.Future[Any]] = {work, waiter}
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise APIError(499, "client disconnected", "invalid_request_error")
    finally:
        waiter.cancel()
        for t in tasks:
            t.cancel()
        for g in gens:
            if g.stream.finished is None:
                g.abort()


async def _disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
