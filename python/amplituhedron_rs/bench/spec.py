"""``amplituhedron bench-spec``: speculative decoding (prompt lookup) against plain decoding.

Three workloads of real text, built offline from CPython's own sources and documentation:

- **copy-heavy**: rewrite a function with one change, or quote a passage given in the prompt;
- **summarise**: summarise a long passage;
- **free chat**: open questions with nothing to copy.

For each workload and each precision asked for, every prompt is decoded greedily with and
without speculation, interleaved, in the same run. Reported: decode tokens/s of each,
their ratio, the acceptance rate (accepted / proposed drafts) and tokens per verify step.
The greedy outputs must be identical token for token; a difference is reported as a failure.

With ``--stations K`` the same prompts also run over a local mesh of K station processes
(the engine's mesh executor: a verify step carries k+1 rows through each station in one
hop), in the same run, and their outputs must equal the single process's too.

When llama.cpp (``llama-cpp-python``, the ``peers`` extra) is installed, its plain greedy
decode of the same prompts (same GGUF, 2 threads) is measured in the same run as the peer:
each row then also gives speculative tokens/s over llama.cpp's. Its outputs are reported,
not required to match (its kernels round differently).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import sys
import time
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
    #: "process", or "K-station mesh".
    where: str
    prompts: int
    plain_tok_s: float
    spec_tok_s: float
    speedup: float
    acceptance: float
    tokens_per_verify: float
    identical: bool
    samples: list[dict[str, Any]] = field(default_factory=list)
    #: llama.cpp's plain greedy decode of the same prompts, tok/s (None: not installed).
    llamacpp_tok_s: float | None = None

    @property
    def over_llamacpp(self) -> float | None:
        """Speculative tokens/s over llama.cpp's plain decode."""
        return self.spec_tok_s / self.llamacpp_tok_s if self.llamacpp_tok_s else None


@dataclass
class _Tally:
    """One workload's runs in one place."""

    plain_rates: list[float] = field(default_factory=list)
    spec_rates: list[float] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    verifies: int = 0
    identical: bool = True
    samples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, plain: Run, spec: Run, reference: Ids) -> None:
        self.identical &= plain.output_ids == spec.output_ids == reference
        n = len(plain.output_ids) - 1  # the first token comes from the prefill
        if n < 1:
            return
        self.plain_rates.append(n / (plain.decode_ms / 1e3))
        self.spec_rates.append(n / (spec.decode_ms / 1e3))
        self.proposed += spec.draft_proposed
        self.accepted += spec.draft_accepted
        self.verifies += spec.verify_steps

    def row(self, workload: str, precision: str, where: str, prompts: int) -> Row:
        plain = statistics.median(self.plain_rates) if self.plain_rates else float("nan")
        spec = statistics.median(self.spec_rates) if self.spec_rates else float("nan")
        r = Row(
            workload=workload,
            precision=precision,
            where=where,
            prompts=prompts,
            plain_tok_s=plain,
            spec_tok_s=spec,
            speedup=spec / plain,
            acceptance=self.accepted / self.proposed if self.proposed else 0.0,
            tokens_per_verify=(
                (self.accepted + self.verifies) / self.verifies if self.verifies else 1.0
            ),
            identical=self.identical,
            samples=self.samples,
        )
        print(
            f"{precision:>7} · {where:>15} · {workload:>10}: plain {r.plain_tok_s:6.1f} tok/s "
            f"· speculative {r.spec_tok_s:6.1f} tok/s · ×{r.speedup:.2f} · acceptance "
            f"{r.acceptance:.0%} · {r.tokens_per_verify:.2f} tokens/verify · identical "
            f"{r.identical}",
            file=sys.stderr,
        )
        return r


@dataclass(frozen=True)
class Run:
    """What one generation reports, in one process or over a mesh."""

    output_ids: Ids
    decode_ms: float
    draft_proposed: int = 0
    draft_accepted: int = 0
    verify_steps: int = 0


def measure(a: argparse.Namespace) -> list[Row]:
    from amplituhedron_rs.runtime import CacheOptions, load_model

    rows: list[Row] = []
    #: llama.cpp's plain decode per workload: measured once (it has one precision).
    peer_rates: dict[str, float | None] | None = None
    for precision in [p for p in a.precision.split(",") if p]:
        # Cache off: every run decodes the same way (no replayed first token).
        model = load_model(
            a.model,
            cache=CacheOptions(enabled=False),
            precision=precision,
            kv_dtype=a.kv_dtype,
        )
        loads = workloads(model.chat_ids)
        references: dict[str, Ids] = {}
        for name, prompts in loads.items():
            tally = _Tally()
            for label, ids in prompts:
                for _ in range(a.rounds):
                    g0 = model.generate(ids, a.max_tokens)
                    g1 = model.generate(
                        ids, a.max_tokens, draft="prompt-lookup", draft_max=a.draft_max
                    )
                    plain = Run(g0.output_ids, g0.decode_ms)
                    spec = Run(
                        g1.output_ids,
                        g1.decode_ms,
                        g1.draft_proposed,
                        g1.draft_accepted,
                        g1.verify_steps,
                    )
                    references.setdefault(label, g0.output_ids)
                    tally.add(plain, spec, references[label])
                tally.samples.append({"prompt": label, "tokens": len(g0.output_ids)})
            rows.append(tally.row(name, precision, "process", len(prompts)))
        if peer_rates is None:
            peer_rates = _llamacpp_rates(a, str(model.file.path), loads, references)
        if a.stations:
            stop_ids = [model.eos_id] if model.eos_id is not None else []
            rows += asyncio.run(_over_a_mesh(a, precision, loads, references, stop_ids))
    for r in rows:
        r.llamacpp_tok_s = (peer_rates or {}).get(r.workload)
    return rows


def _llamacpp_rates(
    a: argparse.Namespace,
    model_path: str,
    loads: dict[str, list[tuple[str, Ids]]],
    references: dict[str, Ids],
) -> dict[str, float | None]:
    """llama.cpp's plain greedy decode tokens/s per workload (median over prompts and
    rounds), decoding as many tokens as our plain run emitted; empty if not installed."""
    from amplituhedron_rs.bench.peers import LlamaCpp

    peer = LlamaCpp.load(model_path, n_ctx=4096, threads=a.llamacpp_threads)
    if isinstance(peer, str):
        print(f"llama.cpp peer skipped: {peer}", file=sys.stderr)
        return {}
    rates: dict[str, float | None] = {}
    for name, prompts in loads.items():
        samples: list[float] = []
        for label, ids in prompts:
            n = len(references[label])
            if n < 2:
                continue
            for _ in range(a.rounds):
                peer.fresh()
                logits = peer.prefill(ids)
                t0 = time.perf_counter()
                peer.greedy(logits, n)
                samples.append((n - 1) / (time.perf_counter() - t0))
        rates[name] = statistics.median(samples) if samples else None
        print(
            f"llama.cpp {peer.version} · {name:>10}: plain {rates[name] or float('nan'):6.1f} "
            "tok/s",
            file=sys.stderr,
        )
    return rates


async def _over_a_mesh(
    a: argparse.Namespace,
    precision: str,
    loads: dict[str, list[tuple[str, Ids]]],
    references: dict[str, Ids],
    stop_ids: Ids,
) -> list[Row]:
    """The same prompts through a local mesh of ``a.stations`` stations (cache off)."""
    from amplituhedron_rs.mesh.engine import MeshEngine
    from amplituhedron_rs.mesh.launcher import LocalMesh

    where = f"{a.stations}-station mesh"
    station_args = ["--precision", precision, "--kv-dtype", a.kv_dtype, "--no-cache"]
    rows: list[Row] = []
    # The local mesh draws its token; the engine takes it from the spec.
    with LocalMesh(a.stations, model_path=a.model, station_args=station_args) as m:
        # Prompt chunks of a station's max_chunk (256 rows): prefill in as few hops as allowed.
        async with MeshEngine(m, step_tokens=256) as engine:

            async def run(ids: Ids, draft_max: int | None) -> Run:
                r = await engine.run(
                    ids, a.max_tokens, stop_ids=stop_ids, use_cache=False, draft_max=draft_max
                )
                st = r.stats
                return Run(
                    r.output_ids,
                    float(st["decode_ms"]),
                    int(st["draft_proposed"]),
                    int(st["draft_accepted"]),
                    int(st["verify_steps"]),
                )

            for name, prompts in loads.items():
                tally = _Tally()
                for label, ids in prompts:
                    for _ in range(a.rounds):
                        tally.add(
                            await run(ids, None), await run(ids, a.draft_max), references[label]
                        )
                    tally.samples.append({"prompt": label})
                rows.append(tally.row(name, precision, where, len(prompts)))
    return rows


def main(a: argparse.Namespace) -> int:
    rows = measure(a)
    print(
        "\n| workload | precision | where | plain tok/s | speculative tok/s | × | acceptance | "
        "tokens/verify | greedy identical | llama.cpp plain tok/s | × llama.cpp |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        peer = "—" if r.llamacpp_tok_s is None else f"{r.llamacpp_tok_s:.1f}"
        over = "—" if r.over_llamacpp is None else f"{r.over_llamacpp:.2f}"
        print(
            f"| {r.workload} | {r.precision} | {r.where} | {r.plain_tok_s:.1f} | "
            f"{r.spec_tok_s:.1f} | "
            f"{r.speedup:.2f} | {r.acceptance:.0%} | {r.tokens_per_verify:.2f} | "
            f"{'yes' if r.identical else 'NO'} | {peer} | {over} |"
        )
    if a.json:
        out = [asdict(r) | {"over_llamacpp": r.over_llamacpp} for r in rows]
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(r.identical for r in rows) else 1
