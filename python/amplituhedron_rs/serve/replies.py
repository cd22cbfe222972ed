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

    def delta_chunk(
        self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """A chat chunk of a :class:`~.tools.ToolReply` delta (content or one call's)."""
        return self.chunk(
            index, delta.get("content"), None, logprobs=logprobs, tool_calls=delta.get("tool_calls")
        )


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
    cancels this generator, and `finally` hands the cancel to the engine). With tools, calls
    go out as ``delta.tool_calls`` as they are written (:class:`~.tools.ToolReply`)."""
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
        replies = {g.index: g.tools.reply() for g in gens if g.tools is not None}
        left = len(gens)
        while left:
            g, item = await queue.get()
            if isinstance(item, APIError):
                # Headers are gone: report in-band, as OpenAI does, then end the stream.
                yield _event(
                    {"error": {"message": item.message, "type": item.type, "code": item.code}}
                )
                return
            reply = replies.get(g.index)
            if item is None:
                left -= 1
                finish = g.finish_reason
                if reply is not None:
                    for d in reply.finish():
                        yield _event(shape.delta_chunk(g.index, d))
                    finish = reply.finish_reason(finish)
                final = shape.chunk(g.index, None if shape.chat else "", finish)
                if include_usage:
                    final["usage"] = None
                yield _event(final)
                continue
            logprobs = g.logprobs_payload(item, chat=shape.chat, offset=sent[g.index])
            sent[g.index] += len(item.text)
            if reply is None:
                yield _event(shape.chunk(g.index, item.text, None, logprobs=logprobs))
                continue
            deltas = reply.push(item.text)
            if not deltas and logprobs is not None:
                deltas = [{"content": ""}]  # held text's tokens: their log-probabilities go now
            for i, d in enumerate(deltas):
                yield _event(shape.delta_chunk(g.index, d, logprobs if i == 0 else None))
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
