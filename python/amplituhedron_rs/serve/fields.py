"""What the server does with every request field it does not implement: nothing is silently
ignored.

A field is either honoured (declared on the request models of :mod:`.protocol`), refused
with a 400 naming it (:data:`REFUSED`, unless its value is the neutral one, which changes
nothing), or accepted and ignored because it cannot change which tokens come out or what the
reply holds (:data:`IGNORED`). A field in none of these is a 400 too ("unrecognized request
argument", as OpenAI's own server answers), so a typo never passes as a default.

Explicit JSON ``null`` means "not given", wherever OpenAI accepts it: it is dropped before
validation, so ``"n": null`` is ``n`` left out.

The tables cover OpenAI's chat and completions bodies, vLLM's extra sampling and structured
fields, and llama.cpp server's; ``tests/test_request_fields.py`` lists them all and checks each
against a running server. Implementing a refused field means declaring it on the request
model and deleting its entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Refused:
    """A field that would change the output and is not implemented."""

    why: str
    #: The value(s) that change nothing, accepted silently (clients often send defaults).
    neutral: Callable[[Any], bool] = lambda v: False


def _is(*values: Any) -> Callable[[Any], bool]:
    # `type(v) is type(x)`: True/1 and False/0 must not stand for one another.
    return lambda v: any(type(v) is type(x) and v == x for x in values)


def _empty(v: Any) -> bool:
    return v in ({}, [], "")


def _zero(v: Any) -> bool:
    return type(v) in (int, float) and v == 0


def _one(v: Any) -> bool:
    return type(v) in (int, float) and v == 1


_SAMPLING = "not implemented by this server's sampler"
_RESPONSE = "would change the reply's shape, which this server does not implement"

#: Fields refused with a 400 unless neutral (both endpoints).
REFUSED: dict[str, Refused] = {
    # vLLM's sampling extensions
    "repetition_penalty": Refused(_SAMPLING, _one),
    "min_tokens": Refused(_SAMPLING, _zero),
    "ignore_eos": Refused(_SAMPLING, _is(False)),
    "min_p": Refused(_SAMPLING, _zero),
    "stop_token_ids": Refused(_SAMPLING, _empty),
    "include_stop_str_in_output": Refused(_SAMPLING, _is(False)),
    "skip_special_tokens": Refused(_SAMPLING, _is(True)),
    "spaces_between_special_tokens": Refused(_SAMPLING, _is(True)),
    "use_beam_search": Refused("beam search is not implemented", _is(False)),
    "length_penalty": Refused("beam search is not implemented", _one),
    "best_of": Refused(_SAMPLING, _one),
    "allowed_token_ids": Refused(_SAMPLING),
    "bad_words": Refused(_SAMPLING, _empty),
    "logits_processors": Refused(_SAMPLING, _empty),
    "truncate_prompt_tokens": Refused("prompts are never truncated: a long one is a 400"),
    "vllm_xargs": Refused(_SAMPLING, _empty),
    "prompt_logprobs": Refused(
        "use echo with logprobs (completions) for the prompt's log-probabilities"
    ),
    "return_tokens_as_token_ids": Refused(_RESPONSE, _is(False)),
    "return_token_ids": Refused(_RESPONSE, _is(False)),
    "prompt_embeds": Refused("prompts are text or token ids"),
    "kv_transfer_params": Refused("disaggregated prefill is not implemented"),
    "mm_processor_kwargs": Refused("the models are text-only", _empty),
    "add_special_tokens": Refused(
        "the model file decides whether BOS is added (/tokenize shows the ids)"
    ),
    "add_generation_prompt": Refused("the chat template always adds it", _is(True)),
    "continue_final_message": Refused("the chat template always opens a turn", _is(False)),
    "documents": Refused("the chat template takes no documents", _empty),
    "chat_template": Refused("the server's template is fixed (serve --chat-template FILE)"),
    "chat_template_kwargs": Refused("the chat template takes no arguments", _empty),
    # vLLM's structured outputs: the rest are declared (serve/structured.py)
    "structural_tag": Refused("structural tags are not implemented (use tools or a grammar)"),
    # OpenAI fields this server cannot honour (on an endpoint that does not declare them)
    "echo": Refused("a chat reply never repeats the last message", _is(False)),
    "audio": Refused("audio output is not implemented"),
    "modalities": Refused("text is the only modality", lambda v: v == ["text"]),
    "function_call": Refused("function calling is not implemented", _is("none")),
    "functions": Refused("function calling is not implemented", _empty),
    "tool_choice": Refused("tools are for chat completions", _is("none")),
    "reasoning_effort": Refused("the models do not reason"),
    "verbosity": Refused("the models take no verbosity"),
    "web_search_options": Refused("web search is not implemented"),
    # llama.cpp server's sampling fields
    "n_predict": Refused("use max_tokens"),
    "repeat_penalty": Refused(_SAMPLING, _one),
    "repeat_last_n": Refused(_SAMPLING),
    "penalize_nl": Refused(_SAMPLING, _is(False)),
    "typical_p": Refused(_SAMPLING, _one),
    "tfs_z": Refused(_SAMPLING, _one),
    "top_n_sigma": Refused(_SAMPLING, lambda v: type(v) in (int, float) and v <= 0),
    "dry_multiplier": Refused(_SAMPLING, _zero),
    "xtc_probability": Refused(_SAMPLING, _zero),
    "mirostat": Refused(_SAMPLING, _zero),
    "dynatemp_range": Refused(_SAMPLING, _zero),
    "min_keep": Refused(_SAMPLING, _zero),
    "n_probs": Refused("use logprobs", _zero),
    "n_indent": Refused(_SAMPLING, _zero),
    "samplers": Refused("the sampler chain is fixed"),
    "t_max_predict_ms": Refused("a time limit is not implemented"),
    "return_tokens": Refused(_RESPONSE, _is(False)),
    "post_sampling_probs": Refused(_RESPONSE, _is(False)),
    "response_fields": Refused(_RESPONSE, _empty),
    "lora": Refused("adapters are not implemented", _empty),
    "image_data": Refused("the models are text-only", _empty),
    "reasoning_format": Refused("the models do not reason", _is("none")),
    "parse_tool_calls": Refused("a reply to a request with tools is always parsed", _is(True)),
}

#: Fields accepted and ignored: none changes which tokens come out or what the reply holds.
IGNORED: dict[str, str] = {
    "user": "an end-user id for the caller's own abuse tracking",
    "metadata": "stored-completion tags (nothing is stored)",
    "store": "nothing is stored",
    "service_tier": "one tier",
    "safety_identifier": "an end-user id for the caller's own abuse tracking",
    "prompt_cache_key": "a routing hint; the prefix cache is always on (cache_salt isolates)",
    "prediction": "predicted outputs only change latency, never the tokens",
    "parallel_tool_calls": "only matters with tools (declared on chat completions)",
    "priority": "a scheduling priority; the order of service never changes tokens",
    "request_id": "a caller's id for its logs",
    "cache_prompt": "llama.cpp's: the prefix cache is always on and exact",
    "id_slot": "llama.cpp's slot choice; scheduling only",
    "n_keep": "llama.cpp's context shift; a context that overflows is a 400 here",
    "t_max_prompt_ms": "llama.cpp's: prompts are never cut",
    "timings_per_token": "llama.cpp's timing report; usage is always filled",
    "dry_base": "no effect while dry_multiplier is 0 (refused otherwise)",
    "dry_allowed_length": "no effect while dry_multiplier is 0 (refused otherwise)",
    "dry_penalty_last_n": "no effect while dry_multiplier is 0 (refused otherwise)",
    "dry_sequence_breakers": "no effect while dry_multiplier is 0 (refused otherwise)",
    "xtc_threshold": "no effect while xtc_probability is 0 (refused otherwise)",
    "mirostat_tau": "no effect while mirostat is 0 (refused otherwise)",
    "mirostat_eta": "no effect while mirostat is 0 (refused otherwise)",
    "dynatemp_exponent": "no effect while dynatemp_range is 0 (refused otherwise)",
}


def screen(body: Mapping[str, Any], declared: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` without its ``null`` fields and the fields that change nothing; raises
    ValueError ("param: why") for a refused or unknown field. ``declared``: the request
    model's own fields (they are validated by the model)."""
    out: dict[str, Any] = {}
    for key, value in body.items():
        if value is None:
            continue  # JSON null: not given
        if key in declared:
            out[key] = value
        elif key in REFUSED:
            rule = REFUSED[key]
            if not rule.neutral(value):
                raise ValueError(f"{key}: not supported ({rule.why})")
        elif key not in IGNORED:
            raise ValueError(f"{key}: unrecognized request argument")
    return out
