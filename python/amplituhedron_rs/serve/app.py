"""The OpenAI-compatible HTTP server: routes, auth, streaming; the engine does the rest.

- ``POST /v1/chat/completions`` — ``messages`` through the model's own chat template;
- ``POST /v1/completions`` — ``prompt`` as text or token ids, or a list of either;
- ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (no key needed),
  ``GET /metrics`` (Prometheus; :mod:`.metrics`);
- ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (:mod:`.tokenize_routes`).

Each prompt becomes one engine sequence: it consults the volume cache (exact, then longest
prefix; ``usage.prompt_tokens_details.cached_tokens`` reports what was replayed) and joins
the running batch; a request's prompts run batched together, one choice each. A client that
disconnects cancels its sequences at once.

The trust boundary (SPEC §17, SECURITY.md): with ``--api-key``, every path but ``/health``
needs a key, checked before the body is read; bodies are bounded as they stream; prompts
are bounded in characters before they are tokenised, off the event loop; each key is its
own cache partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from amplituhedron_rs import _core
from amplituhedron_rs._core import QueueFullError
from amplituhedron_rs.edge.asgi import BearerAuth, BodyLimit, matching_key
from amplituhedron_rs.edge.limits import DEFAULT_JSON_BYTES
from amplituhedron_rs.runtime.sampling import SamplingParams
from amplituhedron_rs.runtime.tokenizer import Tokenizer
from amplituhedron_rs.serve import errors
from amplituhedron_rs.serve.errors import APIError, bad_request
from amplituhedron_rs.serve.frontend import (
    EngineFailed,
    EngineFront,
    GenerationParams,
    RequestStream,
)
from amplituhedron_rs.serve.generation import Delta, Generation, Prepared
from amplituhedron_rs.serve.metrics import ServeMetrics
from amplituhedron_rs.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now,
    template_role,
    usage,
)
from amplituhedron_rs.serve.structured import GrammarCache, Requested
from amplituhedron_rs.serve.tokenize_routes import install_tokenize_routes
from amplituhedron_rs.serve.tools import ToolPlan, ToolStream, stream_deltas, template_messages

log = logging.getLogger("amplituhedron.serve")


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
    #: Logged at the first chat request (a base checkpoint: why its replies disappoint).
    chat_warning: str | None = None
    #: Every key shares one cache partition (a prompt oracle across keys: off by default).
    shared_cache_keys: bool = False
    #: Special tokens spelled in message content are control tokens (off: text).
    allow_special_tokens_in_content: bool = False
    #: /metrics without a key.
    open_metrics: bool = False
    max_body_bytes: int = DEFAULT_JSON_BYTES


def cache_partition(key_index: int | None, salt: str | None, *, shared: bool) -> str:
    """The cache salt of a request: a hash of who calls (the index of their API key among
    the server's, None for an open server) and their ``cache_salt``, so requests of
    different keys never share volumes unless the operator says ``shared``. Always a hex
    digest: no length or character of a client's salt reaches a station header."""
    who = "shared" if shared or key_index is None else f"key:{key_index}"
    material = f"{who}\0{'' if salt is None else 'salt:' + salt}".encode()
    return hashlib.sha256(material).hexdigest()


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
    metrics = ServeMetrics(front, settings.model_name)
    grammars = GrammarCache(tokenizer)
    chat_warned = False
    keys = [k.encode() for k in settings.api_keys]
    # Outermost last: the key is checked before the body is read, then the body is
    # counted as it streams.
    app.add_middleware(
        BodyLimit,
        json_limit=settings.max_body_bytes,
        octet_limit=settings.max_body_bytes,
        respond=errors.edge_refusal,
    )
    open_paths = {"/health", "/metrics"} if settings.open_metrics else {"/health"}
    app.add_middleware(
        BearerAuth, keys=keys, open_paths=open_paths, respond=errors.edge_refusal, what="API key"
    )
    # No prompt longer than this many characters can fit the context (each token spells
    # at most ``max_token_bytes`` characters): refused before it is tokenised.
    max_prompt_chars = settings.context_len * tokenizer.max_token_bytes

    def caller(authorization: str | None = Header(default=None, include_in_schema=False)) -> int:
        """Which key authenticated the request (the edge already refused a wrong one)."""
        if not keys:
            return -1
        raw = authorization.encode("latin-1") if authorization is not None else None
        index = matching_key(raw, keys)
        if index is None:  # unreachable behind BearerAuth; refuse rather than share
            raise errors.unauthorized("invalid API key")
        return index

    auth = Depends(caller)

    def check_chars(n: int, param: str) -> None:
        if n > max_prompt_chars:
            raise bad_request(
                f"the prompt has {n} characters; no more than {max_prompt_chars} can fit this "
                f"model's context of {settings.context_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

    async def tokenize(text: str) -> list[int]:
        # In a worker thread, without the GIL: a long prompt never stalls the event loop.
        return await asyncio.to_thread(tokenizer.encode, text)

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
        who: int,
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
        salt = cache_partition(
            None if who < 0 else who, body.cache_salt, shared=settings.shared_cache_keys
        )
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
        except ValueError as exc:  # InputError, and a schema's invalid Unicode
            raise bad_request(f"{requested.field}: {exc}", param=requested.field) from exc

    def submit(preps: list[Prepared]) -> list[RequestStream]:
        """Queues every prompt of a request, or none (a full queue refuses them all)."""
        streams: list[RequestStream] = []
        try:
            for p in preps:
                streams.append(front.submit(p.params))
        except (QueueFullError, EngineFailed, ValueError) as exc:
            for st in streams:
                front.cancel(st)
            if isinstance(exc, QueueFullError):
                metrics.rejected.labels(settings.model_name).inc()
                raise errors.queue_full(str(exc)) from exc
            if isinstance(exc, EngineFailed):
                raise errors.engine_error(str(exc), 503) from exc
            raise bad_request(str(exc)) from exc
        return streams

    # --- routes ------------------------------------------------------------------------

    @app.get("/health")
    def health() -> JSONResponse:
        if not front.alive:
            body = {"status": "failed", "model": settings.model_name, "error": front.failure}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok", "model": settings.model_name})

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict[str, Any]:
        return {
            "id": settings.model_name,
            "object": "model",
            "created": now(),
            "owned_by": "amplituhedron",
            "max_model_len": settings.context_len,
        }

    @app.get("/v1/models", dependencies=[auth])
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[auth])
    def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    install_tokenize_routes(
        app,
        tokenizer,
        settings.context_len,
        auth,
        check_model,
        special_in_content=settings.allow_special_tokens_in_content,
    )

    @app.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, who: int = auth
    ) -> Any:
        nonlocal chat_warned
        if settings.chat_warning and not chat_warned:
            chat_warned = True
            log.warning("%s", settings.chat_warning)
        plan = ToolPlan.of(
            body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer.supports_tools
        )
        messages, tools = template_messages(
            [{**m.for_template(), "role": template_role(m.role)} for m in body.messages], plan
        )
        check_chars(sum(len(m["content"]) for m in messages), "messages")
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
        special = settings.allow_special_tokens_in_content
        try:
            prompt = await asyncio.to_thread(
                tokenizer.encode_chat, messages, tools=tools, special_in_content=special
            )
        except ValueError as exc:
            raise bad_request(f"messages: {exc}", param="messages") from exc
        grammar = await compiled(requested)
        prepared = prepare(body, prompt, body.token_limit(), who, grammar=grammar, tools=plan)
        return await respond([prepared], request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, who: int = auth) -> Any:
        # Every prompt is checked before any is queued: a bad one refuses the request.
        given = body.prompts()
        for p in given:
            if isinstance(p, str):
                check_chars(len(p), "prompt")
        preps = [await prepare_prompt(body, prompt, who) for prompt in given]
        return await respond(preps, request, chat=False)

    async def prepare_prompt(body: CompletionRequest, given: str | list[int], who: int) -> Prepared:
        if isinstance(given, str):
            prompt, text = await tokenize(given), given
        else:
            prompt, text = given, None
            bad = [t for t in prompt if t >= tokenizer.vocab_size]
            if bad:
                raise bad_request(
                    f"token id {bad[0]} is outside the vocabulary of {tokenizer.vocab_size}",
                    param="prompt",
                )
        echo = None
        if body.echo:
            echo = text if text is not None else tokenizer.decode(prompt)
        return prepare(
            body,
            prompt,
            body.max_tokens,
            who,
            echo=echo,
            prompt_logprobs=body.prompt_logprobs_count(),
            grammar=await compiled(body.requested()),
        )

    async def respond(preps: list[Prepared], request: Request, *, chat: bool) -> Any:
        rid = new_id("chatcmpl" if chat else "cmpl")
        created = now()
        started = time.perf_counter()
        streams = submit(preps)
        first = preps[0]
        metrics.accepted("chat" if chat else "completions", first.params.max_new_tokens, len(preps))
        gens = [
            Generation(st, tokenizer, p, metrics, started, front, index=i)
            for i, (st, p) in enumerate(zip(streams, preps, strict=True))
        ]
        if first.stream:
            shape = _ChunkShape(rid, created, settings.model_name, chat)
            return StreamingResponse(
                _sse(gens, shape, first.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        texts = await _until_done_or_disconnect(gens, request)
        choices = []
        for g, p, text in zip(gens, preps, texts, strict=True):
            choice: dict[str, Any] = {"index": g.index, "finish_reason": g.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                parsed = p.tools.parse(text) if p.tools is not None else None
                if parsed is not None:
                    choice["message"] = {
                        "role": "assistant",
                        "content": parsed[0],
                        "tool_calls": parsed[1],
                    }
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = (p.echo or "") + text
            choice["logprobs"] = g.reply_logprobs(chat=chat)
            choices.append(choice)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": settings.model_name,
                "choices": choices,
                "usage": _total_usage(gens),
            }
        )

    return app


@dataclass(frozen=True)
class _ChunkShape:
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


def _total_usage(gens: list[Generation]) -> dict[str, Any]:
    """A request's usage: its sequences' summed (one prompt each)."""
    return usage(
        sum(g.prompt_tokens for g in gens),
        sum(g.completion_tokens for g in gens),
        sum(g.cached_tokens for g in gens),
    )


async def _sse(
    gens: list[Generation], shape: _ChunkShape, include_usage: bool
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
            tail["usage"] = _total_usage(gens)
            yield _event(tail)
        yield b"data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            if g.stream.finished is None:
                g.abort()


async def _until_done_or_disconnect(gens: list[Generation], request: Request) -> list[str]:
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
