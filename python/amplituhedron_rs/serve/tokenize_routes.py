"""vLLM's tokenizer endpoints, over the model's own tokenizer and chat template.

- ``POST /tokenize`` — ``{"prompt": text}`` (``add_special_tokens``: whether BOS is added
  when the model file asks for one, default true) or ``{"messages": [...]}`` (the chat
  template, ``add_generation_prompt`` default true; with ``tools``, ``tool_choice`` and
  ``parallel_tool_calls`` as the chat endpoint takes them: exactly the ids it runs);
  ``return_token_strs`` adds each id's vocabulary entry. Answers ``{"count", "max_model_len",
  "tokens"[, "token_strs"]}``.
- ``POST /detokenize`` — ``{"tokens": [...]}`` → ``{"prompt": text}`` (special tokens kept).
- ``GET /tokenizer_info`` — the special tokens and the chat template: what
  lm-evaluation-harness's remote tokenizer reads, so it needs no Hugging Face download for a
  GGUF model.

Like the API's routes they need the key when the server has keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from amplituhedron_rs.runtime.tokenizer import Tokenizer
from amplituhedron_rs.serve.errors import bad_request
from amplituhedron_rs.serve.protocol import U32_MAX, ChatFields
from amplituhedron_rs.serve.unicode import Text


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    return_token_strs: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, body: Any) -> Any:
        # JSON null means "not given", as on the API's routes.
        if isinstance(body, dict):
            return {k: v for k, v in body.items() if v is not None}
        return body


class TokenizeText(_Body):
    prompt: Text
    add_special_tokens: StrictBool = True


class TokenizeChat(_Body, ChatFields):
    model_config = ConfigDict(extra="forbid")
    add_generation_prompt: StrictBool = True
    #: The template writes the chat's special tokens; asking for more is refused.
    add_special_tokens: Literal[False] = False
    continue_final_message: Literal[False] = False


class Detokenize(_Body):
    tokens: list[Annotated[int, Field(ge=0, le=U32_MAX)]]


def install_tokenize_routes(
    app: FastAPI,
    tokenizer: Tokenizer,
    max_model_len: int,
    auth: Any,
    check_model: Callable[[str], None],
    *,
    special_in_content: bool,
) -> None:
    """Adds ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` to ``app`` (``auth``: the
    API's key dependency; ``special_in_content``: as the chat endpoint tokenises messages).
    The handlers are synchronous, so they run in worker threads, never on the event loop."""

    def named(body: _Body) -> None:
        if body.model is not None:
            check_model(body.model)

    def answer(ids: list[int], strs: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if strs:
            out["token_strs"] = [tokenizer.token_text(t) for t in ids]
        return out

    @app.post("/tokenize", dependencies=[auth])
    def tokenize(body: TokenizeChat | TokenizeText) -> dict[str, Any]:
        named(body)
        if isinstance(body, TokenizeText):
            ids = tokenizer.encode(body.prompt, add_bos=body.add_special_tokens)
            return answer(ids, body.return_token_strs)
        # Exactly as the chat endpoint renders and tokenises them.
        _, messages, tools = body.rendered(tokenizer.supports_tools)
        try:
            ids = tokenizer.encode_chat(
                messages,
                tools=tools,
                special_in_content=special_in_content,
                add_generation_prompt=body.add_generation_prompt,
            )
        except ValueError as exc:
            raise bad_request(f"messages: {exc}", param="messages") from exc
        return answer(ids, body.return_token_strs)

    @app.post("/detokenize", dependencies=[auth])
    def detokenize(body: Detokenize) -> dict[str, Any]:
        named(body)
        bad = [t for t in body.tokens if t >= tokenizer.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is outside the vocabulary of {tokenizer.vocab_size}",
                param="tokens",
            )
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info", dependencies=[auth])
    def tokenizer_info() -> dict[str, Any]:
        def text(i: int | None) -> str | None:
            return None if i is None else tokenizer.token_text(i)

        return {
            "tokenizer_class": f"GGUF ({tokenizer.kind})",
            "bos_token": text(tokenizer.bos_id),
            "eos_token": text(tokenizer.eos_id),
            "pad_token": None,
            "add_bos_token": tokenizer.add_bos,
            "chat_template": tokenizer.chat_template,
            "model_max_length": max_model_len,
            "vocab_size": tokenizer.vocab_size,
        }
