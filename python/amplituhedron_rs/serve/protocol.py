"""The OpenAI wire format: request bodies (validated) and the shapes of the replies.

Only what the server implements is accepted: a parameter it cannot honour (``n > 1``,
penalties…) is a 400 that names it, never silently ignored, and so is a field nobody
defines (as OpenAI's own server answers); fields that cannot change the output (``user``,
``metadata``…) are accepted. :mod:`.fields` holds those tables. JSON ``null`` means "not
given" everywhere. Structured outputs and tools: :mod:`.structured`, :mod:`.tools`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from amplituhedron_rs._core import (
    MAX_LOGIT_BIAS,
    MAX_OPENAI_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
)
from amplituhedron_rs.runtime.sampling import TOP_K_MAX
from amplituhedron_rs.serve.fields import screen
from amplituhedron_rs.serve.structured import StructuredFields
from amplituhedron_rs.serve.tools import (
    ToolCall,
    ToolChoice,
    ToolDef,
    ToolPlan,
    check_tools,
    template_messages,
)
from amplituhedron_rs.serve.unicode import Text

if TYPE_CHECKING:
    from amplituhedron_rs._core import TokenLogprobs

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
#: Stop sequences per request (OpenAI allows 4; lm-evaluation-harness sends a task's list
#: plus the EOS text, and vLLM sets no limit).
MAX_STOPS = 16
#: Prompts in one completions request (each its own sequence, batched together).
MAX_PROMPTS = 256
#: Choices per prompt (``n``): each its own sequence, its prompt computed once.
MAX_CHOICES = 16
#: Sequences one request may start (prompts × choices).
MAX_SEQUENCES = MAX_PROMPTS
#: ``stop_token_ids`` per request.
MAX_STOP_TOKEN_IDS = 256

Role = Literal["system", "developer", "user", "assistant", "tool"]


def template_role(role: str) -> str:
    """A message's role as chat templates spell it: OpenAI's newer "developer" role is the
    system prompt of older templates."""
    return "system" if role == "developer" else role


class TextPart(BaseModel):
    """One text part of a message's content (``{"type": "text", "text": …}``)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Role
    #: None only for an assistant message that calls tools.
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    #: The calls an assistant message made (sent back by the client).
    tool_calls: list[ToolCall] | None = None
    #: A tool message: the call it answers.
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: only an assistant message with tool_calls may omit it")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only on assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as :mod:`.tools` renders it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name and self.role == "tool":
            out["name"] = self.name
        return out


class ChatFields(BaseModel):
    """What renders a chat's prompt: its messages and tools. ``/v1/chat/completions`` and
    ``/tokenize`` take them alike, so the count ``/tokenize`` gives is what the chat
    prefills."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _tools(self) -> ChatFields:
        check_tools(self.tools, self.tool_choice)
        return self

    def rendered(
        self, native: bool
    ) -> tuple[ToolPlan | None, list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The tool plan, and the messages and tools as the chat template gets them
        (``native``: the template renders tools itself)."""
        plan = ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls, native)
        messages, tools = template_messages(
            [{**m.for_template(), "role": template_role(m.role)} for m in self.messages], plan
        )
        return plan, messages, tools


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _SamplingFields(StructuredFields):
    """Fields shared by both endpoints. ``temperature`` absent or 0 means greedy (the
    runtime's one greedy rule); any other value samples."""

    model_config = ConfigDict(extra="ignore")
    model: Text = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, body: Any) -> Any:
        # Nulls dropped, refused and unknown fields named (see .fields).
        return screen(body, cls.model_fields) if isinstance(body, dict) else body

    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, le=TOP_K_MAX)
    seed: int | None = Field(default=None, ge=0, le=U64_MAX)
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    #: Choices per prompt, each sampled with its own seed stream (``seed + i``).
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    #: Splits the caller's cache partition further (it is hashed with the API key's).
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=256)
    #: Speculative decoding for this request (an extension): "prompt-lookup" or "off"; the
    #: server's default when absent.
    draft: Literal["prompt-lookup", "off"] | None = None
    user: Text | None = None
    # The logits adjustments (OpenAI's, then vLLM's); each token id is checked against the
    # vocabulary when the request is prepared.
    presence_penalty: float = Field(
        default=0.0, ge=-MAX_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY, allow_inf_nan=False
    )
    frequency_penalty: float = Field(
        default=0.0, ge=-MAX_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY, allow_inf_nan=False
    )
    #: Token id (a decimal string) → bias added to its logit.
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float = Field(
        default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, allow_inf_nan=False
    )
    #: EOS and ``stop_token_ids`` cannot end the reply (nor a stop sequence) before this many
    #: tokens.
    min_tokens: int = Field(default=0, ge=0)
    #: EOS does not end the reply.
    ignore_eos: StrictBool = False
    #: More ids that end the reply.
    stop_token_ids: list[Annotated[int, Field(ge=0, le=U32_MAX)]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS
    )
    #: Special tokens' text is left out of the reply.
    skip_special_tokens: StrictBool = True
    #: The stop sequence or stop token that ended the reply is part of it.
    include_stop_str_in_output: StrictBool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit()) or int(key) > U32_MAX:
                raise ValueError(f"logit_bias: keys are token ids, got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias: biases are in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias} for token {key}"
                )
        if len({int(k) for k in v}) != len(v):
            raise ValueError("logit_bias: a token id is given twice")
        return v

    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(id, bias)`` pairs by id (zero biases dropped: they change
        nothing)."""
        pairs = ((int(k), float(b)) for k, b in (self.logit_bias or {}).items() if b != 0)
        return tuple(sorted(pairs))

    def token_ids_named(self) -> list[int]:
        """Every token id the request names (checked against the vocabulary)."""
        return [t for t, _ in self.bias_pairs()] + list(self.stop_token_ids or [])


class ChatCompletionRequest(_SamplingFields, ChatFields):
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    #: Report each generated token's log-probability (the model's own distribution) and
    #: ``top_logprobs`` alternatives.
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        """Alternatives to report per token, or None for no log-probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = list[Annotated[int, Field(ge=0, le=U32_MAX)]]


class CompletionRequest(_SamplingFields):
    #: One prompt (text or token ids) or several (texts or token-id lists): one choice per
    #: prompt, each its own sequence, batched together.
    prompt: Text | TokenIds | list[Text] | list[TokenIds]
    max_tokens: int | None = Field(default=16, ge=0)
    #: Reply with the prompt, then the completion; with ``logprobs``, the prompt's tokens
    #: are scored too (the first has nothing before it: ``null``). ``max_tokens: 0`` with
    #: ``echo`` only scores the prompt (loglikelihood evaluation).
    echo: StrictBool = False
    suffix: Text | None = None
    #: Report each generated token's log-probability and this many alternatives.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _completion_supported(self) -> CompletionRequest:
        prompts = self.prompts()
        if not prompts:
            raise ValueError("prompt: must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts per request")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be at least 1 (0 only with echo)")
        if self.suffix:
            raise ValueError("suffix: not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [[int(t) for t in p]]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def logprobs_count(self) -> int | None:
        """Alternatives to report per token, or None for no log-probabilities."""
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        """Alternatives to report per prompt token (echo with logprobs), or None."""
        return self.logprobs if self.echo else None


# --- replies ---------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def chat_logprobs(
    entries: Sequence[TokenLogprobs], token_bytes: Callable[[int], bytes]
) -> dict[str, Any]:
    """Chat's ``logprobs``: per token its text, log-probability, bytes and alternatives."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        b = token_bytes(token)
        return {"token": b.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(b)}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    entries: Sequence[TokenLogprobs],
    token_bytes: Callable[[int], bytes],
    offset: int,
    first_token: int | None = None,
) -> dict[str, Any]:
    """Legacy completions' ``logprobs``: parallel lists of token texts, log-probabilities,
    alternatives (text → log-probability) and the tokens' offsets in the reply text. An
    echoed prompt's ``first_token`` leads them, unscored (``null``), as OpenAI's did."""

    def text(token: int) -> str:
        return token_bytes(token).decode("utf-8", "replace")

    lead = [] if first_token is None else [first_token]
    texts = [text(t) for t in lead] + [text(e.token) for e in entries]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    unscored: list[Any] = [None] * len(lead)
    return {
        "tokens": texts,
        "token_logprobs": unscored + [e.logprob for e in entries],
        "top_logprobs": unscored + [{text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }
