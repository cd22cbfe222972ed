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
import dataclasses
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
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
from amplituhedron_rs.serve.generation import Generation, Prepared
from amplituhedron_rs.serve.metrics import ServeMetrics
from amplituhedron_rs.serve.protocol import (
    MAX_SEQUENCES,
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now,
)
from amplituhedron_rs.serve.replies import ChunkShape, sse, total_usage, until_done_or_disconnect
from amplituhedron_rs.serve.structured import GrammarCache, Requested
from amplituhedron_rs.serve.tokenize_routes import install_tokenize_routes
from amplituhedron_rs.serve.tools import ToolPlan

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
        vocab = tokenizer.vocab_size
        for name, ids in (
            ("logit_bias", [t for t, _ in body.bias_pairs()]),
            ("stop_token_ids", body.stop_token_ids or []),
        ):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise bad_request(
                    f"{name}: token id {bad} is outside the vocabulary of {vocab}", param=name
                )
        limit = room if max_tokens is None else max_tokens
        if body.min_tokens > limit:
            raise bad_request(
                f"min_tokens: {body.min_tokens} exceeds the {limit} tokens the reply may have",
                param="min_tokens",
            )
        try:
            # The runtime's one rule: greedy when no temperature/top_k/top_p, or temperature 0.
            sampling = SamplingParams(
                body.temperature,
                body.top_k,
                body.top_p,
                seed,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=body.bias_pairs(),
                min_tokens=body.min_tokens,
            ).engine_kwargs()
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        draft = (
            body.draft == "prompt-lookup" if body.draft is not None else settings.draft_by_default
        )
        eos = None if body.ignore_eos else tokenizer.eos_id
        stop_ids = ([eos] if eos is not None else []) + [
            t for t in body.stop_token_ids or [] if t != eos
        ]
        salt = cache_partition(
            None if who < 0 else who, body.cache_salt, shared=settings.shared_cache_keys
        )
        return Prepared(
            GenerationParams(
                prompt=prompt,
                max_new_tokens=room if max_tokens is None else max_tokens,
                sampling=sampling,
                stop_ids=stop_ids,
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
            choices=body.n,
            min_tokens=body.min_tokens,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
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
        """Queues every choice of every prompt of a request, or none (a full queue refuses
        them all). A prompt's choices after the first follow it: the engine admits them once
        it has computed the prompt, which they replay from the volume cache."""
        streams: list[RequestStream] = []
        try:
            leader: RequestStream | None = None
            for p in preps:
                follows = leader.seq if leader is not None and p.choice > 0 else None
                streams.append(front.submit(dataclasses.replace(p.params, follows=follows)))
                if p.choice == 0:
                    leader = streams[-1]
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
        plan, messages, tools = body.rendered(tokenizer.supports_tools)
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
        if len(preps) * body.n > MAX_SEQUENCES:
            raise bad_request(
                f"n: {len(preps)} prompts × n = {body.n} exceeds {MAX_SEQUENCES} sequences per "
                "request",
                param="n",
            )
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
        # Each prompt's n choices, numbered as OpenAI does (prompt by prompt), each its own
        # seed stream: choice i samples with seed + i, as that request alone would.
        preps = [p.choice_of(i) for p in preps for i in range(p.choices)]
        streams = submit(preps)
        first = preps[0]
        metrics.accepted("chat" if chat else "completions", first.params.max_new_tokens, len(preps))
        gens = [
            Generation(st, tokenizer, p, metrics, started, front, index=i)
            for i, (st, p) in enumerate(zip(streams, preps, strict=True))
        ]
        if first.stream:
            shape = ChunkShape(rid, created, settings.model_name, chat)
            return StreamingResponse(
                sse(gens, shape, first.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        texts = await until_done_or_disconnect(gens, request)
        choices = []
        for g, p, text in zip(gens, preps, texts, strict=True):
            choice: dict[str, Any] = {"index": g.index, "finish_reason": g.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                if p.tools is not None:
                    # The parse a streamed reply makes, fed at once.
                    reply = p.tools.reply()
                    choice["message"] = reply.message(text)
                    choice["finish_reason"] = reply.finish_reason(g.finish_reason)
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
                "usage": total_usage(gens),
            }
        )

    return app
