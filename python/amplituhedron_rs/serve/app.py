"""The OpenAI-compatible HTTP server: routes, auth, streaming; the engine does the rest.

- ``POST /v1/chat/completions`` — ``messages`` through the model's own chat template;
- ``POST /v1/completions`` — ``prompt`` as text or token ids;
- ``GET /v1/models``, ``GET /health`` (no key needed), ``GET /metrics`` (Prometheus).

Each request becomes one engine sequence: it consults the volume cache (exact, then longest
prefix; ``usage.prompt_tokens_details.cached_tokens`` reports what was replayed) and joins
the running batch. A client that disconnects cancels its sequence at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError, QueueFullError
from amplituhedron_rs.runtime.sampling import SamplingParams
from amplituhedron_rs.runtime.tokenizer import Tokenizer
from amplituhedron_rs.serve import errors
from amplituhedron_rs.serve.errors import APIError, bad_request
from amplituhedron_rs.serve.frontend import EngineFront, GenerationParams, RequestStream
from amplituhedron_rs.serve.generation import Generation, Prepared
from amplituhedron_rs.serve.metrics import ServeMetrics
from amplituhedron_rs.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now,
)
from amplituhedron_rs.serve.structured import GrammarCache, Requested
from amplituhedron_rs.serve.tools import ToolPlan, ToolStream, stream_deltas, template_messages


@dataclass
class ServeSettings:
    """What the server is started with."""

    model_name: str
    #: Positions a request may use (prompt + generated); longer contexts get a 400.
    context_len: int
    api_keys: list[str] = field(default_factory=list)
    #: Speculate (prompt lookup) unless a request says ``"draft": "off"``.
    draft_by_default: bool = False
    draft_max: int = 8


def create_app(front: EngineFront, tokenizer: Tokenizer, settings: ServeSettings) -> FastAPI:
    """The ASGI app over a started-on-startup engine front."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        front.start()
        try:
            yield
        finally:
            front.stop()

    app = FastAPI(
        title="amplituhedron — OpenAI-compatible server",
        version=_core.__version__,
        lifespan=lifespan,
    )
    errors.install(app)
    metrics = ServeMetrics(front)
    grammars = GrammarCache(tokenizer)
    keys = [k.encode() for k in settings.api_keys]

    def tenant(authorization: str | None) -> str:
        """Who is calling (a hash of their key): the root of their cache salt."""
        token = (authorization or "").removeprefix("Bearer ")
        return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:16]

    def require_key(authorization: str | None = Header(default=None)) -> str:
        if not keys:
            return tenant(None)
        if authorization is None or not authorization.startswith("Bearer "):
            raise errors.unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        given = authorization.removeprefix("Bearer ").encode("utf-8", "surrogateescape")
        # Compare with every key, in constant time per key.
        if not any(secrets.compare_digest(given, k) for k in keys):
            raise errors.unauthorized("invalid API key")
        return tenant(authorization)

    auth = Depends(require_key)

    def check_model(name: str) -> None:
        if name != settings.model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {settings.model_name!r}",
                "not_found_error",
                param="model",
                code="model_not_found",
            )

    def prepare(
        body: ChatCompletionRequest | CompletionRequest,
        prompt: list[int],
        max_tokens: int | None,
        who: str,
        *,
        echo: str | None = None,
        prompt_logprobs: int | None = None,
        grammar: _core.Grammar | None = None,
        tools: ToolPlan | None = None,
    ) -> Prepared:
        check_model(body.model)
        if not prompt:
            raise bad_request("the prompt is empty", param="prompt")
        room = settings.context_len - len(prompt)
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            wanted = len(prompt) + (max_tokens or 1)
            raise bad_request(
                f"this model's context is {settings.context_len} tokens; the request needs "
                f"{wanted} ({len(prompt)} in the prompt)",
                param="max_tokens" if room > 0 else "messages",
                code="context_length_exceeded",
            )
        seed = secrets.randbits(63) if body.seed is None else body.seed
        try:
            # The runtime's one rule: greedy when no temperature/top_k/top_p, or temperature 0.
            sampling = SamplingParams(body.temperature, body.top_k, body.top_p, seed).core_kwargs()
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        draft = (
            body.draft == "prompt-lookup" if body.draft is not None else settings.draft_by_default
        )
        eos = tokenizer.eos_id
        salt = f"{who}:{body.cache_salt}" if body.cache_salt is not None else None
        return Prepared(
            GenerationParams(
                prompt=prompt,
                max_new_tokens=room if max_tokens is None else max_tokens,
                sampling=sampling,
                stop_ids=[eos] if eos is not None else [],
                salt=salt,
                draft_max=settings.draft_max if draft else None,
                logprobs=body.logprobs_count(),
                prompt_logprobs=prompt_logprobs,
                grammar=grammar,
            ),
            body.stop_list(),
            body.stream,
            bool(body.stream_options and body.stream_options.include_usage),
            echo,
            tools,
        )

    async def compiled(requested: Requested | None) -> _core.Grammar | None:
        """The request's constraint, compiled off the event loop (a 400 naming its field when
        llguidance rejects it)."""
        if requested is None:
            return None
        try:
            return await grammars.compile_async(requested.constraint)
        except InputError as exc:
            raise bad_request(f"{requested.field}: {exc}", param=requested.field) from exc

    def submit(p: Prepared) -> RequestStream:
        try:
            return front.submit(p.params)
        except QueueFullError as exc:
            metrics.rejected.inc()
            raise errors.queue_full(str(exc)) from exc
        except ValueError as exc:
            raise bad_request(str(exc)) from exc

    # --- routes ------------------------------------------------------------------------

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": settings.model_name}

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[auth])
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.model_name,
                    "object": "model",
                    "created": now(),
                    "owned_by": "amplituhedron",
                    "max_model_len": settings.context_len,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, who: str = auth
    ) -> Any:
        plan = ToolPlan.of(
            body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer.supports_tools
        )
        messages, tools = template_messages(
            [{**m.for_template(), "role": _template_role(m.role)} for m in body.messages], plan
        )
        requested = body.requested()
        forced = plan.constraint() if plan is not None else None
        if forced is not None:
            if requested is not None:
                raise bad_request(
                    f"{requested.field}: a reply forced to call tools (tool_choice) cannot "
                    "also follow it",
                    param=requested.field,
                )
            requested = Requested(forced, "tool_choice")
        try:
            prompt = tokenizer.encode(tokenizer.render_chat(messages, tools=tools))
        except ValueError as exc:
            raise bad_request(f"messages: {exc}", param="messages") from exc
        grammar = await compiled(requested)
        prepared = prepare(body, prompt, body.token_limit(), who, grammar=grammar, tools=plan)
        return await respond(prepared, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, who: str = auth) -> Any:
        text: str | None = None
        if isinstance(body.prompt, str):
            text = body.prompt
        elif body.prompt and isinstance(body.prompt[0], str):
            text = str(body.prompt[0])
        if text is not None:
            prompt = tokenizer.encode(text)
        else:
            prompt = [int(t) for t in body.prompt]
            bad = [t for t in prompt if t >= tokenizer.vocab_size]
            if bad:
                raise bad_request(
                    f"token id {bad[0]} is outside the vocabulary of {tokenizer.vocab_size}",
                    param="prompt",
                )
        echo = None
        if body.echo:
            echo = text if text is not None else tokenizer.decode(prompt)
        prepared = prepare(
            body,
            prompt,
            body.max_tokens,
            who,
            echo=echo,
            prompt_logprobs=body.prompt_logprobs_count(),
            grammar=await compiled(body.requested()),
        )
        return await respond(prepared, request, chat=False)

    async def respond(p: Prepared, request: Request, *, chat: bool) -> Any:
        rid = new_id("chatcmpl" if chat else "cmpl")
        created = now()
        started = time.perf_counter()
        stream = submit(p)
        metrics.requests.labels("chat" if chat else "completions").inc()
        generation = Generation(stream, tokenizer, p, metrics, started)
        if p.stream:
            shape = _ChunkShape(rid, created, settings.model_name, chat)
            return StreamingResponse(
                _sse(generation, shape, p.include_usage, front, p.tools),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        text = await _until_done_or_disconnect(generation.collect(), request, front, stream)
        choice: dict[str, Any] = {"index": 0, "finish_reason": generation.finish_reason}
        logprobs = generation.reply_logprobs(chat=chat)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            parsed = p.tools.parse(text) if p.tools is not None else None
            if parsed is not None:
                choice["message"] = {"role": "assistant", "content": parsed[0]}
                choice["message"]["tool_calls"] = parsed[1]
                choice["finish_reason"] = "tool_calls"
            choice["logprobs"] = logprobs
            obj = "chat.completion"
        else:
            choice["text"] = (p.echo or "") + text
            choice["logprobs"] = logprobs
            obj = "text_completion"
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": settings.model_name,
                "choices": [choice],
                "usage": generation.usage(),
            }
        )

    return app


def _template_role(role: str) -> str:
    # OpenAI's newer "developer" role is the system prompt of older templates.
    return "system" if role == "developer" else role


@dataclass(frozen=True)
class _ChunkShape:
    rid: str
    created: int
    model: str
    chat: bool

    def chunk(
        self,
        delta: str | None,
        finish: str | None,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
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


async def _sse(
    g: Generation,
    shape: _ChunkShape,
    include_usage: bool,
    front: EngineFront,
    tools: ToolPlan | None = None,
) -> AsyncIterator[bytes]:
    """Server-sent events; the client leaving cancels the sequence (Starlette cancels this
    generator, and `finally` hands the cancel to the engine). With tools, text that may be a
    call is held until the reply ends (:class:`~.tools.ToolStream`)."""
    done = False
    held = ToolStream(tools) if tools is not None else None
    finish = None
    try:
        first = True
        if shape.chat:
            yield _event(shape.chunk("", None, first=True))
            first = False
        try:
            sent = 0  # characters of reply text so far (completions' text offsets)
            async for d in g.deltas():
                logprobs = g.logprobs_payload(d, chat=shape.chat, offset=sent)
                text = d.text if held is None else held.push(d.text)
                if not text and held is not None and logprobs is None:
                    continue
                yield _event(shape.chunk(text, None, first=first, logprobs=logprobs))
                sent += len(d.text)
                first = False
            if held is not None:
                text, calls = held.finish()
                if text:
                    yield _event(shape.chunk(text, None))
                if calls is not None:
                    yield _event(shape.chunk(None, None, tool_calls=stream_deltas(calls)))
                    finish = "tool_calls"
        except APIError as exc:
            # Headers are gone: report in-band, as OpenAI does, then end the stream.
            yield _event({"error": {"message": exc.message, "type": exc.type, "code": exc.code}})
            done = True
            return
        final = shape.chunk(None if shape.chat else "", finish or g.finish_reason)
        if include_usage:
            final["usage"] = None
        yield _event(final)
        if include_usage:
            tail = shape.chunk(None, None)
            tail["choices"] = []
            tail["usage"] = g.usage()
            yield _event(tail)
        yield b"data: [DONE]\n\n"
        done = True
    finally:
        if not done or g.stream.finished is None:
            front.cancel(g.stream)


async def _until_done_or_disconnect(
    work: Awaitable[str], request: Request, front: EngineFront, stream: RequestStream
) -> str:
    """Awaits a non-streamed generation, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise APIError(499, "client disconnected", "invalid_request_error")
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            front.cancel(stream)


async def _disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
