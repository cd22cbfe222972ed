"""Constrained decoding on the real models, in process (SPEC §16): every reply validates
against its JSON Schema (``jsonschema``), held-out schemas included, on SmolLM2 and Gemma 3,
greedy and seeded; regex, Lark, GBNF and choice constraints; batched ≡ alone with
constrained and free sequences mixed, with and without drafts; a cached first token is
masked like a fresh one; bad constraints are refused before anything runs. The engine's own
invariants on the synthetic model are in rust/engine/constraint_tests.rs."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

import amplituhedron_rs as ar
from amplituhedron_rs import InputError, _core
from amplituhedron_rs.runtime import structured
from amplituhedron_rs.runtime.gbnf import gbnf_to_lark
from structured_schemas import ALL, PROMPTS

pytestmark = [pytest.mark.model]

MAX_NEW = 320


def chat(model: ar.Model, text: str) -> list[int]:
    return model.chat_ids("You answer with JSON only.", text)


def check(g: Any, schema: dict[str, Any]) -> Any:
    """The reply is complete (the grammar finished it) and valid under ``schema``."""
    assert g.stop_reason == "stop", (g.stop_reason, g.text)
    value = json.loads(g.text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_smollm2_reply_validates_greedy_and_seeded(model: ar.Model, name: str) -> None:
    schema = ALL[name]
    ids = chat(model, PROMPTS[name])
    check(model.generate(ids, MAX_NEW, json_schema=schema, use_cache=False), schema)
    sampled = model.generate(
        ids, MAX_NEW, json_schema=schema, temperature=0.8, top_p=0.95, seed=7, use_cache=False
    )
    check(sampled, schema)


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_gemma_reply_validates(gemma: ar.Model, name: str) -> None:
    # A base model without a chat template: a plain text prompt. (nested_order's price is
    # where Gemma would write fraction digits forever without the grammar's digit bound.)
    schema = ALL[name]
    ids = gemma.tokenize(PROMPTS[name] + "\nJSON: ")
    check(gemma.generate(ids, MAX_NEW, json_schema=schema, use_cache=False), schema)


def test_regex_lark_gbnf_and_choice_constraints(model: ar.Model) -> None:
    ids = chat(model, "What is the date of the first Moon landing?")
    g = model.generate(ids, 40, regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}", use_cache=False)
    assert g.stop_reason == "stop" and re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", g.text)
    lark = 'start: "The answer is " ANSWER "."\nANSWER: /(yes|no|maybe)/\n'
    g = model.generate(chat(model, "Is the sky blue?"), 40, grammar=lark, use_cache=False)
    assert re.fullmatch(r"The answer is (yes|no|maybe)\.", g.text), g.text
    gbnf = 'root ::= "Colour: " colour\ncolour ::= ("red" | "green" | "blue") [!.]?\n'
    g = model.generate(
        chat(model, "Name a colour."), 20, grammar=gbnf_to_lark(gbnf), use_cache=False
    )
    assert re.fullmatch(r"Colour: (red|green|blue)[!.]?", g.text), g.text
    options = ["positive", "negative", "neutral"]
    compiled = structured.choice(options).compile(model.tokenizer)
    g = model.generate(chat(model, "Sentiment of: I love it!"), 10, grammar=compiled)
    assert g.text in options and g.stop_reason == "stop"
    # JSON object mode: any object.
    g = model.generate(
        chat(model, "Describe a cat."),
        200,
        grammar=structured.json_object().compile(model.tokenizer),
        use_cache=False,
    )
    assert isinstance(json.loads(g.text), dict)


def test_constraints_change_only_what_they_must(model: ar.Model) -> None:
    # A constraint that the free reply already satisfies leaves it unchanged: the mask
    # removes only tokens the grammar rejects, before the same sampling rule.
    ids = chat(model, "Say hello.")
    free = model.generate(ids, 12, use_cache=False)
    assert free.text
    exact = model.generate(
        ids, 12, regex=re.escape(free.text).replace("\\ ", " ") + "(.|\\n)*", use_cache=False
    )
    assert exact.output_ids == free.output_ids


def _run(model: ar.Model, requests: list[dict[str, Any]]) -> list[list[int]]:
    """Every request submitted to the engine at once, stepped to the end: tokens each."""
    seqs = [model.engine.submit(**r) for r in requests]
    out: dict[int, list[int]] = {s: [] for s in seqs}
    done: set[int] = set()
    while len(done) < len(seqs):
        for ev in model.engine.step():
            if ev.kind == "token" and ev.token is not None:
                out[ev.seq].append(ev.token)
            elif ev.kind == "finished":
                assert ev.reason != "error", ev.error
                done.add(ev.seq)
    return [out[s] for s in seqs]


def test_batched_equals_alone_mixed_with_and_without_drafts(model: ar.Model) -> None:
    names = sorted(ALL)[:4]
    grammars = {n: structured.json_schema(ALL[n]).compile(model.tokenizer) for n in names}
    eos = [model.eos_id] if model.eos_id is not None else []
    requests: list[dict[str, Any]] = []
    for i in range(8):
        constrained = i % 2 == 0
        name = names[(i // 2) % len(names)]
        prompt = chat(model, PROMPTS[name] if constrained else f"Tell me fact number {i}.")
        r: dict[str, Any] = {
            "prompt": prompt,
            "max_new_tokens": 160 if constrained else 24,
            "stop_ids": eos,
            "use_cache": False,
            "grammar": grammars[name] if constrained else None,
        }
        if i % 3 == 2:
            r.update(greedy=False, temperature=0.9, top_p=0.9, seed=i)
        requests.append(r)
    alone = [_run(model, [r])[0] for r in requests]
    assert _run(model, requests) == alone
    drafted = [{**r, "draft_max": 6} for r in requests]
    assert _run(model, drafted) == alone
    for r, tokens in zip(requests, alone, strict=True):
        if r["grammar"] is not None:
            name = next(n for n, g in grammars.items() if g is r["grammar"])
            jsonschema.validate(json.loads(model.detokenize(tokens)), ALL[name])


def test_drafts_from_the_prompt_are_cut_and_change_no_token(model: ar.Model) -> None:
    schema = ALL["person"]
    example = '{"name": "Ada Lovelace", "age": 36, "email": "ada@math.org"}'
    ids = chat(model, f"Here is a person: {example}. Repeat it exactly as JSON.")
    plain = model.generate(ids, 120, json_schema=schema, use_cache=False)
    spec = model.generate(ids, 120, json_schema=schema, use_cache=False, draft="prompt-lookup")
    assert spec.output_ids == plain.output_ids
    assert spec.draft_proposed > 0
    check(spec, schema)


def test_a_cached_first_token_is_masked_like_a_fresh_one(model: ar.Model) -> None:
    schema = ALL["enum_and_array"]
    ids = chat(model, "Weather report, please.")
    model.clear_cache()
    first = model.generate(ids, 120, json_schema=schema)
    again = model.generate(ids, 120, json_schema=schema)
    assert not first.cache_hit and again.cache_hit
    assert again.output_ids == first.output_ids
    check(again, schema)
    free = model.generate(ids, 4)
    assert free.cache_hit and free.output_ids[0] != again.output_ids[0]


def test_bad_constraints_are_refused_before_anything_runs(model: ar.Model) -> None:
    ids = chat(model, "hi")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"json_schema": "{not json"}, "not JSON"),
        ({"json_schema": {"type": "wat"}}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "start: undefined_rule\n"}, "lark"),
        ({"json_schema": {"type": "object"}, "regex": "a"}, "at most one"),
        ({"json_schema": {"description": "x" * (_core.MAX_GRAMMAR_BYTES + 1)}}, "at most"),
    ]
    for kw, words in cases:
        with pytest.raises(InputError, match=re.escape(words)):
            model.generate(ids, 4, **kw)
    assert model.engine.waiting == 0 and model.engine.running == 0


def test_gbnf_converts_to_an_equivalent_lark_grammar_or_says_where_it_is_not_gbnf() -> None:
    lark = gbnf_to_lark(
        '# a list\nroot ::= item ("," ws item)*\nitem ::= [a-z\\-]{1,5} | "\\x41"\nws ::= [ \\t]?\n'
    )
    assert lark.splitlines()[0] == "start: g_root"
    assert 'g_root: g_item (("," g_ws g_item))*' in lark
    assert '"A"' in lark and "{1,5}" in lark
    for bad, words in [
        ('item ::= "a"\n', "no 'root'"),
        ("root ::= other\n", "not defined"),
        ('root ::= "a" @\n', "line 1 column 14"),
        ('root ::= ("a"\n', "unclosed"),
        ("root ::= [a\n", "unterminated"),
        ('root ::= "a"{3,1}\n', "reversed"),
    ]:
        with pytest.raises(InputError, match=re.escape(words)):
            gbnf_to_lark(bad)
