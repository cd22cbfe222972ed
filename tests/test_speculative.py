"""Speculative decoding by prompt lookup, through the product's own entry points on the real
model: greedy output identical to plain decoding on every bench workload (copy-heavy,
summarise, free chat), drafts actually proposed and accepted where there is text to copy,
seeded sampled speculation equal to plain seeded sampling, and the CLI's ``--draft``. The
engine's own tests (rust/engine/tests.rs) cover the logits of every emitted position,
volumes captured after speculation and batches mixing speculating and plain neighbours; the
sampling rule is tested statistically in rust/model/sampling/tests.rs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import amplituhedron_rs as ar
from amplituhedron_rs.bench.spec import workloads

pytestmark = [pytest.mark.model]

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(model: ar.Model) -> dict[str, list[tuple[str, list[int]]]]:
    return workloads(model.chat_ids)


@pytest.mark.parametrize("workload", ["copy-heavy", "summarise", "free chat"])
def test_greedy_speculation_equals_plain_greedy(
    model: ar.Model, prompts: dict[str, list[tuple[str, list[int]]]], workload: str
) -> None:
    proposed = accepted = 0
    for label, ids in prompts[workload][:1]:  # the shortest of its kind: prefill is not tested
        plain = model.generate(ids, NEW_TOKENS, use_cache=False, stop_at_eos=False)
        spec = model.generate(
            ids, NEW_TOKENS, use_cache=False, stop_at_eos=False, draft="prompt-lookup"
        )
        assert spec.output_ids == plain.output_ids, label
        assert plain.draft_proposed == 0
        assert spec.draft_accepted <= spec.draft_proposed
        proposed += spec.draft_proposed
        accepted += spec.draft_accepted
    if workload == "copy-heavy":
        # There is text to copy: drafts are proposed, most are right, and fewer verify
        # steps than tokens are paid.
        assert accepted > 0 and accepted >= proposed // 3


def test_speculation_with_a_short_draft_limit_and_the_cache_on(
    model: ar.Model, prompts: dict[str, list[tuple[str, list[int]]]]
) -> None:
    _, ids = prompts["copy-heavy"][0]
    model.clear_cache()
    plain = model.generate(ids, NEW_TOKENS, stop_at_eos=False)  # captures the prompt
    for draft_max in (1, 3):
        again = model.generate(
            ids, NEW_TOKENS, stop_at_eos=False, draft="prompt-lookup", draft_max=draft_max
        )
        assert again.cache_hit and again.output_ids == plain.output_ids


@pytest.mark.parametrize("workload", ["copy-heavy", "free chat"])
def test_seeded_sampled_speculation_equals_plain_seeded_sampling(
    model: ar.Model, prompts: dict[str, list[tuple[str, list[int]]]], workload: str
) -> None:
    # A draft is accepted exactly when it is the token plain sampling draws for its position,
    # so the same seed gives the same tokens with and without speculation, however the draft
    # lengths (sized from measured step times) come out, and in every run.
    _, ids = prompts[workload][0]
    kw = {"temperature": 0.7, "top_p": 0.95, "seed": 11, "use_cache": False}
    plain = model.generate(ids, NEW_TOKENS, stop_at_eos=False, **kw)  # type: ignore[arg-type]
    for draft_max in (8, 2):
        spec = model.generate(
            ids,
            NEW_TOKENS,
            stop_at_eos=False,
            draft="prompt-lookup",
            draft_max=draft_max,
            **kw,  # type: ignore[arg-type]
        )
        assert spec.output_ids == plain.output_ids and len(spec.output_ids) == NEW_TOKENS
    if workload == "copy-heavy":
        assert spec.draft_accepted > 0


def test_bad_draft_arguments_are_input_errors(model: ar.Model) -> None:
    with pytest.raises(ar.InputError, match="draft"):
        model.generate([1, 2, 3], 2, draft="medusa")  # type: ignore[arg-type]


def test_cli_draft_prints_the_plain_tokens(model: ar.Model) -> None:
    ids = model.chat_ids(None, "Repeat exactly: alpha beta gamma delta alpha beta gamma delta")

    def run(*extra: str) -> dict[str, object]:
        argv = [sys.executable, "-m", "amplituhedron_rs.cli", "generate", "--json"]
        argv += ["--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "12", "--no-cache"]
        out = subprocess.run([*argv, *extra], capture_output=True, text=True, check=True)
        result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
        return result

    plain = run()
    spec = run("--draft", "prompt-lookup", "--draft-max", "4")
    assert spec["output_ids"] == plain["output_ids"]
    assert isinstance(spec["draft_proposed"], int) and spec["draft_proposed"] > 0


def test_bench_spec_reports_every_workload_and_the_peer(tmp_path: Path) -> None:
    """A tiny ``bench-spec`` run: one row per workload, greedy identical, and the llama.cpp
    column filled exactly when llama-cpp-python is installed (else it says it skipped)."""
    report = tmp_path / "spec.json"
    argv = [sys.executable, "-m", "amplituhedron_rs.cli", "bench-spec", "--rounds", "1"]
    argv += ["--max-tokens", "6", "--precision", "fast", "--json", str(report)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    rows = json.loads(report.read_text())
    assert [r["workload"] for r in rows] == ["copy-heavy", "summarise", "free chat"]
    for r in rows:
        assert r["identical"] is True and r["where"] == "process"
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0
        assert 0.0 <= r["acceptance"] <= 1.0
    if importlib.util.find_spec("llama_cpp") is None:
        assert all(r["llamacpp_tok_s"] is None for r in rows)
        assert "llama.cpp peer skipped" in out.stderr
    else:
        assert all(r["llamacpp_tok_s"] > 0 for r in rows)
        assert all(r["over_llamacpp"] == r["spec_tok_s"] / r["llamacpp_tok_s"] for r in rows)
    assert "| copy-heavy | fast | process |" in out.stdout
