"""Zero silently ignored request fields: every field of OpenAI's chat and completions bodies,
vLLM's extra sampling and structured-output fields and llama.cpp server's fields, with what
the server does with it, checked against a running server:

- ``honoured``: the test that shows it works (it must exist), and a request with it succeeds;
- ``refused``: a request with a value that would change the output is a 400 naming it (and,
  where given, the neutral value is accepted);
- ``ignored``: accepted, and the reply is the one without it (greedy): it cannot change
  which tokens come out.

A field implemented later moves from ``refused`` to ``honoured`` here (with its test)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from test_serve import KEY, Server, start_server

pytestmark = [pytest.mark.model, pytest.mark.serve]

TESTS = Path(__file__).parent
_NEUTRAL = object()


@dataclass(frozen=True)
class Honoured:
    #: ``file.py::test_name`` of a test that shows the field at work.
    test: str
    sample: Any


@dataclass(frozen=True)
class Refused:
    sample: Any
    neutral: Any = _NEUTRAL


@dataclass(frozen=True)
class Ignored:
    sample: Any


F = Honoured | Refused | Ignored

SERVE = "test_serve.py::"
COMPAT = "test_serve_compat.py::"
STRUCTURED = "test_serve_structured.py::"
GUIDED = STRUCTURED + "test_vllm_and_llama_cpp_fields_are_honoured"
MSG = [{"role": "user", "content": "Say hi."}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}

#: Fields both endpoints share (OpenAI's, then the extensions every peer has).
COMMON: dict[str, F] = {
    "model": Honoured(SERVE + "test_plain_and_streamed_replies_agree", None),
    "max_tokens": Honoured(SERVE + "test_completions_take_text_or_token_ids", 3),
    "temperature": Honoured(SERVE + "test_a_seed_makes_sampling_reproducible", 0.5),
    "top_p": Honoured(SERVE + "test_a_seed_makes_sampling_reproducible", 0.9),
    "seed": Honoured(SERVE + "test_a_seed_makes_sampling_reproducible", 3),
    "stop": Honoured(SERVE + "test_stop_sequences_cut_the_text_and_say_stop", ["\n\n"]),
    "stream": Honoured(SERVE + "test_plain_and_streamed_replies_agree", False),
    "stream_options": Honoured(
        SERVE + "test_plain_and_streamed_replies_agree", {"include_usage": True}
    ),
    "n": Refused(2, neutral=1),
    "presence_penalty": Refused(0.5, neutral=0.0),
    "frequency_penalty": Refused(0.5, neutral=0),
    "logit_bias": Refused({"12": 5}, neutral={}),
    "user": Ignored("user-42"),
    # vLLM's sampling parameters
    "top_k": Honoured(SERVE + "test_eight_concurrent_streams_each_equal_their_solo_run", 5),
    "cache_salt": Honoured(SERVE + "test_cache_salt_isolates_tenants", "tenant-a"),
    "use_beam_search": Refused(True, neutral=False),
    "min_p": Refused(0.1, neutral=0.0),
    "repetition_penalty": Refused(1.2, neutral=1.0),
    "length_penalty": Refused(0.5, neutral=1.0),
    "stop_token_ids": Refused([13], neutral=[]),
    "include_stop_str_in_output": Refused(True, neutral=False),
    "ignore_eos": Refused(True, neutral=False),
    "min_tokens": Refused(50, neutral=0),
    "skip_special_tokens": Refused(False, neutral=True),
    "spaces_between_special_tokens": Refused(False, neutral=True),
    "truncate_prompt_tokens": Refused(8),
    "allowed_token_ids": Refused([1, 2, 3]),
    "prompt_logprobs": Refused(1),
    "bad_words": Refused(["rain"], neutral=[]),
    "logits_processors": Refused(["x"], neutral=[]),
    "kv_transfer_params": Refused({"do_remote_decode": True}),
    "vllm_xargs": Refused({"a": 1}, neutral={}),
    "priority": Ignored(5),
    "request_id": Ignored("req-1"),
    "return_tokens_as_token_ids": Refused(True, neutral=False),
    "return_token_ids": Refused(True, neutral=False),
    "guided_json": Honoured(GUIDED, SCHEMA),
    "guided_regex": Honoured(GUIDED, "[0-9]+"),
    "guided_choice": Honoured(GUIDED, ["yes", "no"]),
    "guided_grammar": Honoured(GUIDED, 'root ::= "yes"'),
    # Only llguidance's names are accepted (another backend's output could differ).
    "guided_decoding_backend": Refused("xgrammar"),
    "guided_whitespace_pattern": Refused(" "),
    "structural_tag": Refused('{"type": "structural_tag"}'),
    "structured_outputs": Honoured(GUIDED, {"json": SCHEMA}),
    # llama.cpp server's
    "n_predict": Refused(8),
    "typical_p": Refused(0.5, neutral=1.0),
    "tfs_z": Refused(0.5, neutral=1.0),
    "repeat_penalty": Refused(1.1, neutral=1.0),
    "repeat_last_n": Refused(64),
    "penalize_nl": Refused(True, neutral=False),
    "dry_multiplier": Refused(0.8, neutral=0.0),
    "dry_base": Ignored(1.75),
    "dry_allowed_length": Ignored(2),
    "dry_penalty_last_n": Ignored(-1),
    "dry_sequence_breakers": Ignored(["\n"]),
    "xtc_probability": Refused(0.5, neutral=0.0),
    "xtc_threshold": Ignored(0.1),
    "mirostat": Refused(2, neutral=0),
    "mirostat_tau": Ignored(5.0),
    "mirostat_eta": Ignored(0.1),
    "dynatemp_range": Refused(0.5, neutral=0.0),
    "dynatemp_exponent": Ignored(1.0),
    "top_n_sigma": Refused(1.0, neutral=-1.0),
    "min_keep": Refused(2, neutral=0),
    "n_probs": Refused(3, neutral=0),
    "n_indent": Refused(4, neutral=0),
    "samplers": Refused(["top_k", "temperature"]),
    "grammar": Honoured(GUIDED, 'root ::= "yes"'),
    "json_schema": Honoured(GUIDED, SCHEMA),
    "n_keep": Ignored(16),
    "cache_prompt": Ignored(True),
    "id_slot": Ignored(0),
    "t_max_predict_ms": Refused(100),
    "t_max_prompt_ms": Ignored(100),
    "return_tokens": Refused(True, neutral=False),
    "post_sampling_probs": Refused(True, neutral=False),
    "response_fields": Refused(["content"], neutral=[]),
    "lora": Refused([{"id": 0, "scale": 1.0}], neutral=[]),
    "timings_per_token": Ignored(True),
    "image_data": Refused([{"data": "AA==", "id": 1}], neutral=[]),
    "reasoning_format": Refused("deepseek", neutral="none"),
    "parse_tool_calls": Refused(False, neutral=True),
    # ours
    "draft": Honoured(SERVE + "test_a_request_that_speculates_gets_the_plain_greedy_reply", "off"),
}

CHAT: dict[str, F] = {
    "messages": Honoured(SERVE + "test_plain_and_streamed_replies_agree", None),
    "max_completion_tokens": Honoured(SERVE + "test_plain_and_streamed_replies_agree", 3),
    "logprobs": Honoured(
        SERVE + "test_logprobs_are_the_model_distribution_plain_streamed_cached_and_speculative",
        True,
    ),
    "top_logprobs": Honoured(
        SERVE + "test_logprobs_are_the_model_distribution_plain_streamed_cached_and_speculative",
        None,  # only with logprobs: sent with it below
    ),
    "audio": Refused({"voice": "alloy", "format": "wav"}),
    "modalities": Refused(["text", "audio"], neutral=["text"]),
    "function_call": Refused("auto", neutral="none"),
    "functions": Refused([{"name": "f"}], neutral=[]),
    "tools": Honoured(STRUCTURED + "test_required_and_named_tool_choice_are_enforced", TOOLS),
    "tool_choice": Honoured(
        STRUCTURED + "test_required_and_named_tool_choice_are_enforced", "none"
    ),
    "parallel_tool_calls": Honoured(
        STRUCTURED + "test_required_and_named_tool_choice_are_enforced", True
    ),
    "response_format": Honoured(
        STRUCTURED + "test_every_response_format_reply_validates", {"type": "json_object"}
    ),
    "reasoning_effort": Refused("low"),
    "verbosity": Refused("low"),
    "web_search_options": Refused({}),
    "metadata": Ignored({"team": "a"}),
    "store": Ignored(False),
    "service_tier": Ignored("auto"),
    "safety_identifier": Ignored("u-1"),
    "prompt_cache_key": Ignored("k-1"),
    "prediction": Ignored({"type": "content", "content": "Hi"}),
    # vLLM's chat extensions
    "echo": Refused(True, neutral=False),
    "add_generation_prompt": Refused(False, neutral=True),
    "continue_final_message": Refused(True, neutral=False),
    "add_special_tokens": Refused(True),
    "documents": Refused([{"title": "a", "text": "b"}], neutral=[]),
    "chat_template": Refused("{{ messages }}"),
    "chat_template_kwargs": Refused({"enable_thinking": False}, neutral={}),
    "mm_processor_kwargs": Refused({"a": 1}, neutral={}),
}

COMPLETIONS: dict[str, F] = {
    "prompt": Honoured(COMPAT + "test_completions_take_a_list_of_prompts_one_choice_each", None),
    "echo": Honoured(SERVE + "test_echo_scores_the_prompt_for_loglikelihood_evaluation", True),
    "logprobs": Honoured(
        SERVE + "test_logprobs_are_the_model_distribution_plain_streamed_cached_and_speculative",
        2,
    ),
    "best_of": Refused(3, neutral=1),
    "suffix": Refused(" the end."),
    # vLLM's completions extensions
    "add_special_tokens": Refused(False),
    "prompt_embeds": Refused("AAAA"),
    "response_format": Honoured(
        STRUCTURED + "test_gemma_completions_follow_response_format", {"type": "json_object"}
    ),
    "tool_choice": Refused("required", neutral="none"),
}


def endpoints() -> Iterator[tuple[str, str, F]]:
    for name, rule in COMMON.items():
        for path in ("/v1/chat/completions", "/v1/completions"):
            yield path, name, rule
    for name, rule in CHAT.items():
        yield "/v1/chat/completions", name, rule
    for name, rule in COMPLETIONS.items():
        yield "/v1/completions", name, rule


def base(path: str, model: str) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"model": model, "messages": MSG, "max_tokens": 4}
    return {"model": model, "prompt": "The weather today is", "max_tokens": 4}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with start_server() as srv:
        yield srv


def test_every_honoured_field_names_a_test_that_exists() -> None:
    for _, name, rule in endpoints():
        if isinstance(rule, Honoured):
            file, _, test = rule.test.partition("::")
            source = (TESTS / file).read_text()
            assert re.search(rf"^def {test}\(", source, re.M), (name, rule.test)


def test_the_server_tables_agree_with_this_list() -> None:
    """The server's tables (serve/fields.py) refuse and ignore exactly what this list says,
    apart from fields the request models declare."""
    from amplituhedron_rs.serve.fields import IGNORED, REFUSED

    ignored = {n for _, n, r in endpoints() if isinstance(r, Ignored)}
    assert ignored <= set(IGNORED)
    listed = {n for _, n, _ in endpoints()}
    assert set(REFUSED) | set(IGNORED) <= listed, "a field in the server's tables is not listed"


def test_every_field_is_honoured_refused_or_without_effect(server: Server) -> None:
    m = server.model()
    headers = {"Authorization": f"Bearer {KEY}"}
    checked = 0
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as h:
        plain = {p: h.post(p, json=base(p, m)).json() for p in ("/v1/chat/completions",)}
        plain["/v1/completions"] = h.post("/v1/completions", json=base("/v1/completions", m)).json()
        for path, name, rule in endpoints():
            body = base(path, m)
            if isinstance(rule, Honoured):
                if rule.sample is not None:
                    body[name] = rule.sample
                if name == "top_logprobs":
                    body |= {"logprobs": True, "top_logprobs": 2}
                r = h.post(path, json=body)
                assert r.status_code == 200, (path, name, r.text)
            elif isinstance(rule, Refused):
                r = h.post(path, json=body | {name: rule.sample})
                assert r.status_code == 400, (path, name, r.text)
                err = r.json()["error"]
                assert err["param"] == name and name in err["message"], (path, name, err)
                if rule.neutral is not _NEUTRAL:
                    r = h.post(path, json=body | {name: rule.neutral})
                    assert r.status_code == 200, (path, name, "neutral", r.text)
                    assert r.json()["choices"] == plain[path]["choices"], (path, name)
            else:
                r = h.post(path, json=body | {name: rule.sample})
                assert r.status_code == 200, (path, name, r.text)
                assert r.json()["choices"] == plain[path]["choices"], (path, name)
            checked += 1
        # A field nobody defines is refused too, named; a message's name is without effect.
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = h.post(path, json=base(path, m) | {"temperture": 0.5})
            assert r.status_code == 400 and r.json()["error"]["param"] == "temperture"
        named = [{"role": "user", "content": "Say hi.", "name": "ann"}]
        r = h.post(
            "/v1/chat/completions", json=base("/v1/chat/completions", m) | {"messages": named}
        )
        assert r.json()["choices"] == plain["/v1/chat/completions"]["choices"]
    assert checked > 200
