"""``amplituhedron bench-spec``: speculative decoding (prompt lookup) against plain decoding.

Three workloads of real text, built offline from CPython's own sources and documentation:

- **copy-heavy**: rewrite a function with one change, or quote a passage given in the prompt;
- **summarise**: summarise a long passage;
- **free chat**: open questions with nothing to copy.

For each workload and each precision asked for, every prompt is decoded greedily with and
without speculation, interleaved, in the same run. Reported: decode tokens/s of each,
their ratio, the acceptance rate (accepted / proposed drafts) and tokens per verify step.
The greedy outputs must be identical token for token; a difference is reported as a failure.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Ids = list[int]


def workloads(
    chat_ids: Callable[[str | None, str], Ids],
) -> dict[str, list[tuple[str, Ids]]]:
    """(label, prompt ids) per workload."""
    import json as json_module
    import textwrap

    from amplituhedron_rs.bench.textsource import reference_text

    functions: list[Callable[..., Any]] = [
        json_module.JSONEncoder.iterencode,
        textwrap.TextWrapper._wrap_chunks,
    ]
    copy = [
        (
            f"rewrite {f.__qualname__}",
            chat_ids(
                "You are a coding assistant.",
                "Rewrite this Python function with one change: rename its first local "
                "variable to `state`. Output only the code.\n\n" + inspect.getsource(f),
            ),
        )
        for f in functions
    ]
    passage = inspect.getdoc(json_module) or ""
    copy.append(
        (
            "quote a passage",
            chat_ids(None, f"Here is a passage:\n\n{passage}\n\nQuote its first two paragraphs."),
        )
    )
    text = reference_text(6000)
    summarise = [
        (
            f"summarise passage {i}",
            chat_ids(None, f"{text[i * 2000 : (i + 1) * 2000]}\n\nSummarise the text above."),
        )
        for i in range(2)
    ]
    chat = [
        (q, chat_ids(None, q))
        for q in (
            "Tell me about your favourite holiday and why you like it.",
            "What should I cook tonight if I have rice, eggs and spinach?",
            "Why do people enjoy long walks?",
        )
    ]
    return {"copy-heavy": copy, "summarise": summarise, "free chat": chat}


@dataclass
class Row:
    workload: str
    precision: str
    prompts: int
    plain_tok_s: float
    spec_tok_s: float
    speedup: float
    acceptance: float
    tokens_per_verify: float
    identical: bool
    samples: list[dict[str, Any]] = field(default_factory=list)


def measure(a: argparse.Namespace) -> list[Row]:
    from amplituhedron_rs.runtime import CacheOptions, load_model

    rows: list[Row] = []
    for precision in [p for p in a.precision.split(",") if p]:
        # Cache off: every run decodes the same way (no replayed first token).
        model = load_model(
            a.model,
            cache=CacheOptions(enabled=False),
            precision=precision,
        )
        for name, prompts in workloads(model.chat_ids).items():
            plain_rates: list[float] = []
            spec_rates: list[float] = []
            proposed = accepted = verifies = emitted = 0
            identical = True
            samples = []
            for label, ids in prompts:
                for _ in range(a.rounds):
                    g0 = model.generate(ids, a.max_new_tokens)
                    g1 = model.generate(
                        ids, a.max_new_tokens, draft="prompt-lookup", draft_max=a.draft_max
                    )
                    identical &= g0.output_ids == g1.output_ids
                    n = len(g0.output_ids) - 1  # the first token comes from the prefill
                    if n < 1:
                        continue
                    plain_rates.append(n / (g0.decode_ms / 1e3))
                    spec_rates.append(n / (g1.decode_ms / 1e3))
                    proposed += g1.draft_proposed
                    accepted += g1.draft_accepted
                    verifies += g1.verify_steps
                    emitted += n
                samples.append({"prompt": label, "tokens": len(g0.output_ids)})
            plain = statistics.median(plain_rates) if plain_rates else float("nan")
            spec = statistics.median(spec_rates) if spec_rates else float("nan")
            rows.append(
                Row(
                    workload=name,
                    precision=precision,
                    prompts=len(prompts),
                    plain_tok_s=plain,
                    spec_tok_s=spec,
                    speedup=spec / plain,
                    acceptance=accepted / proposed if proposed else 0.0,
                    tokens_per_verify=(accepted + verifies) / verifies if verifies else 1.0,
                    identical=identical,
                    samples=samples,
                )
            )
            r = rows[-1]
            print(
                f"{precision:>7} · {name:>10}: plain {r.plain_tok_s:6.1f} tok/s · speculative "
                f"{r.spec_tok_s:6.1f} tok/s · ×{r.speedup:.2f} · acceptance {r.acceptance:.0%} "
                f"· {r.tokens_per_verify:.2f} tokens/verify · identical {r.identical}",
                file=sys.stderr,
            )
    return rows


def main(a: argparse.Namespace) -> int:
    rows = measure(a)
    print(
        "\n| workload | precision | plain tok/s | speculative tok/s | × | acceptance | "
        "tokens/verify | greedy identical |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.workload} | {r.precision} | {r.plain_tok_s:.1f} | {r.spec_tok_s:.1f} | "
            f"{r.speedup:.2f} | {r.acceptance:.0%} | {r.tokens_per_verify:.2f} | "
            f"{'yes' if r.identical else 'NO'} |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0 if all(r.identical for r in rows) else 1
