"""The structured-outputs validation table (issue 47, SPEC §16): every schema of
tests/structured_schemas.py (held-out ones included) on both bundled models, greedy, in four
ways — alone in one process, all of a model's schemas batched in one engine, batched with
prompt-lookup drafts, and over a 2-station mesh — each reply validated with ``jsonschema``
and compared token for token with the alone run.

    python scripts/structured_table.py [--max-new 320] [--markdown PATH]

A reply counts as valid when the grammar finished it (not cut by ``--max-new``), it parses
as JSON and ``jsonschema`` accepts it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema

import amplituhedron_rs as ar
from amplituhedron_rs._core import Grammar
from amplituhedron_rs.bench.host import describe_host
from amplituhedron_rs.mesh.coordinator import Coordinator
from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec
from amplituhedron_rs.runtime import structured

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from structured_schemas import ALL, HELD_OUT, PROMPTS

MODELS = ("smollm2-135m", "gemma3-270m")


def prompt_ids(model: ar.Model, name: str) -> list[int]:
    """The chat template where the model has one (SmolLM2), a plain prompt (Gemma 3 base)."""
    if model.file.architecture == "gemma3":
        return list(model.tokenize(PROMPTS[name] + "\nJSON: "))
    return list(model.chat_ids("You answer with JSON only.", PROMPTS[name]))


def valid(model: ar.Model, tokens: list[int], finished: bool, schema: Any) -> bool:
    if not finished:
        return False
    try:
        jsonschema.validate(json.loads(model.detokenize(tokens)), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_batch(model: ar.Model, requests: list[dict[str, Any]]) -> list[tuple[list[int], bool]]:
    """Every request in one engine at once: each one's tokens, and whether its grammar ended
    it (not the length limit)."""
    seqs = [model.engine.submit(**r) for r in requests]
    out: dict[int, list[int]] = {s: [] for s in seqs}
    finished: dict[int, bool] = {}
    while len(finished) < len(seqs):
        for ev in model.engine.step():
            if ev.kind == "token" and ev.token is not None:
                out[ev.seq].append(ev.token)
            elif ev.kind == "finished":
                if ev.reason == "error":
                    raise RuntimeError(ev.error)
                finished[ev.seq] = ev.reason != "length"
    return [(out[s], finished[s]) for s in seqs]


async def run_mesh(
    spec: MeshSpec, requests: list[dict[str, Any]], max_new: int, eos: list[int]
) -> list[tuple[list[int], bool]]:
    """Each request over the mesh, one after another."""
    out = []
    async with Coordinator(spec) as c:
        for r in requests:
            g = await c.generate(
                r["prompt"], max_new, use_cache=False, stop_ids=eos, grammar=r["grammar"]
            )
            out.append((list(g.output_ids), g.stop_reason != "length"))
    return out


def strip_eos(model: ar.Model, tokens: list[int]) -> list[int]:
    return [t for t in tokens if t != model.eos_id]


def table_for(name: str, max_new: int) -> list[dict[str, Any]]:
    model = ar.load_model(name)
    names = sorted(ALL)
    grammars: dict[str, Grammar] = {
        n: structured.json_schema(ALL[n]).compile(model.tokenizer) for n in names
    }
    eos = [model.eos_id] if model.eos_id is not None else []
    requests = [
        {
            "prompt": prompt_ids(model, n),
            "max_new_tokens": max_new,
            "stop_ids": eos,
            "use_cache": False,
            "grammar": grammars[n],
        }
        for n in names
    ]
    alone = [run_batch(model, [r])[0] for r in requests]
    batched = run_batch(model, requests)
    drafted = run_batch(model, [{**r, "draft_max": 6} for r in requests])
    with LocalMesh(2, model_path=str(model.file.path)) as spec:
        meshed = asyncio.run(run_mesh(spec, requests, max_new, eos))
    rows = []
    for way, results in (
        ("alone", alone),
        ("batched", batched),
        ("drafts", drafted),
        ("mesh", meshed),
    ):
        pairs = list(zip(names, results, alone, strict=True))
        ok = [valid(model, strip_eos(model, t), f, ALL[n]) for n, (t, f), _ in pairs]
        same = [strip_eos(model, t) == strip_eos(model, a) for _, (t, _), (a, _) in pairs]
        rows.append(
            {
                "model": name,
                "way": way,
                "valid": sum(ok),
                "schemas": len(names),
                "held_out_valid": sum(v for n, v in zip(names, ok, strict=True) if n in HELD_OUT),
                "held_out": sum(n in HELD_OUT for n in names),
                "identical_to_alone": sum(same),
                "invalid": [n for n, v in zip(names, ok, strict=True) if not v],
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-new", type=int, default=320)
    p.add_argument("--markdown", type=Path)
    a = p.parse_args()
    rows = [r for m in MODELS for r in table_for(m, a.max_new)]
    lines = [
        describe_host(),
        "",
        "| model | way | valid / schemas | held-out valid | tokens ≡ alone | not valid |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['way']} | {r['valid']} / {r['schemas']} | "
            f"{r['held_out_valid']} / {r['held_out']} | {r['identical_to_alone']} / "
            f"{r['schemas']} | {', '.join(r['invalid']) or '–'} |"
        )
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        a.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
