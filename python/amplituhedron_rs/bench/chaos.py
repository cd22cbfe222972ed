"""``amplituhedron bench-chaos``: failover under fire (SPEC §13, issue 14's target).

A local mesh of K layer ranges × N replicas serves many sessions through one coordinator
while a chaos thread SIGKILLs a random station every few seconds — never the last live
replica of its range — and restarts it on its port a moment later (it comes back empty).
Every session's tokens are compared with the single-process engine's for the same request
(greedy and seeded, prompts sharing system prefixes so the volume cache is in play). The
report: sessions completed, wrong tokens (the target is 0), kills, failovers, sequences
rebuilt, and the time each failover added (detection → the broken work resumed).

The CI test (``tests/test_chaos.py``) runs the same thing, short.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from amplituhedron_rs._core import MeshError
from amplituhedron_rs.bench.report import write_json
from amplituhedron_rs.bench.textsource import text_of_tokens
from amplituhedron_rs.mesh.coordinator import Coordinator
from amplituhedron_rs.mesh.launcher import LocalMesh
from amplituhedron_rs.runtime import load_model
from amplituhedron_rs.runtime.model import Model
from amplituhedron_rs.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class ChaosRequest:
    """One session of the run."""

    prompt: list[int]
    max_new_tokens: int
    sampling: dict[str, Any]  # Coordinator.generate's keywords (empty: greedy)


def chaos_requests(
    encode: Any, sessions: int, *, new_tokens: int = 24, seed: int = 0
) -> list[ChaosRequest]:
    """``sessions`` requests: four shared system prefixes of 48 tokens with a unique tail of
    8–24 tokens each (reference text), greedy and seeded alternating."""
    rng = random.Random(seed)
    text = text_of_tokens(encode, 4 * 48 + sessions * 24)
    systems = [text[i * 48 : (i + 1) * 48] for i in range(4)]
    tails = text[4 * 48 :]
    out = []
    for i in range(sessions):
        tail = tails[i * 24 : i * 24 + rng.randint(8, 24)]
        sampling: dict[str, Any] = {}
        if i % 2:
            sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 1000 + i}
        out.append(ChaosRequest(systems[i % 4] + tail, new_tokens, sampling))
    return out


def reference_outputs(model: Model, requests: Sequence[ChaosRequest]) -> list[list[int]]:
    """Each request's tokens from the single-process engine (batched, cache off; submitted
    in groups the engine's queue holds)."""
    engine = model.engine
    group = max(1, engine.limits[1])
    outputs: dict[int, list[int]] = {}
    seqs = []
    for at in range(0, len(requests), group):
        for r in requests[at : at + group]:
            kw = SamplingParams(**r.sampling).core_kwargs()
            seq = engine.submit(list(r.prompt), r.max_new_tokens, **kw, use_cache=False)
            seqs.append(seq)
            outputs[seq] = []
        while engine.has_work:
            for ev in engine.step():
                if ev.kind == "token" and ev.token is not None:
                    outputs[ev.seq].append(ev.token)
                elif ev.kind == "finished" and ev.reason == "error":
                    raise MeshError(f"the reference run failed: {ev.error}")
    return [outputs[s] for s in seqs]


@dataclass
class ChaosMonkey:
    """A thread that SIGKILLs a random station of ``mesh`` every ``every`` seconds (drawn
    uniformly from the range) — only one whose range has another replica running — and
    restarts it ``down`` seconds later on its port."""

    mesh: LocalMesh
    every: tuple[float, float] = (2.0, 4.0)
    down: tuple[float, float] = (0.5, 1.5)
    seed: int = 0
    kills: int = 0
    restarts: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops killing, and restarts every station still down."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for i in range(len(self.mesh.processes)):
            if not self.mesh.alive(i):
                self.mesh.restart_station(i, env={})

    def _victims(self) -> list[int]:
        """Stations whose death leaves their range a running replica."""
        spec = self.mesh.spec
        assert spec is not None
        out = []
        for i, s in enumerate(spec.stations):
            mates = [
                j
                for j, t in enumerate(spec.stations)
                if j != i and (t.layer_lo, t.layer_hi) == (s.layer_lo, s.layer_hi)
            ]
            if self.mesh.alive(i) and any(self.mesh.alive(j) for j in mates):
                out.append(i)
        return out

    def _run(self) -> None:
        rng = random.Random(self.seed)
        due: list[tuple[float, int]] = []  # (restart time, station)
        next_kill = time.monotonic() + rng.uniform(*self.every)
        while not self._stop.wait(0.05):
            now = time.monotonic()
            for at, i in [d for d in due if d[0] <= now]:
                due.remove((at, i))
                try:
                    self.mesh.restart_station(i, env={})
                    self.restarts += 1
                except MeshError as exc:
                    self.errors.append(str(exc))
            if now >= next_kill:
                victims = self._victims()
                if victims:
                    i = rng.choice(victims)
                    self.mesh.kill_station(i)
                    self.kills += 1
                    due.append((time.monotonic() + rng.uniform(*self.down), i))
                next_kill = time.monotonic() + rng.uniform(*self.every)


async def run_sessions(
    coordinator: Coordinator, requests: Sequence[ChaosRequest], concurrency: int
) -> list[list[int] | str]:
    """Every request through the coordinator, ``concurrency`` at a time: its tokens, or the
    error that ended it."""
    gate = asyncio.Semaphore(concurrency)

    async def one(r: ChaosRequest) -> list[int] | str:
        async with gate:
            try:
                g = await coordinator.generate(r.prompt, r.max_new_tokens, **r.sampling)
            except MeshError as exc:
                return f"error: {exc}"
            return g.output_ids

    return list(await asyncio.gather(*(one(r) for r in requests)))


def wrong_tokens(got: list[int] | str, want: list[int]) -> int:
    """Tokens that differ from the reference at their position (a failed session counts
    only the tokens it emitted: it emitted none after its failure)."""
    if isinstance(got, str):
        return 0
    return sum(a != b for a, b in zip(got, want, strict=False)) + max(0, len(got) - len(want))


def chaos_run(
    model_path: str | None,
    requests: Sequence[ChaosRequest],
    references: Sequence[list[int]],
    *,
    ranges: int = 2,
    replicas: int = 2,
    every: tuple[float, float] = (2.0, 4.0),
    down: tuple[float, float] = (0.5, 1.5),
    concurrency: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """One chaos run; the report (see the module docstring)."""
    mesh = LocalMesh(ranges, replicas=replicas, model_path=model_path)
    spec = mesh.start()
    monkey = ChaosMonkey(mesh, every=every, down=down, seed=seed)
    try:

        async def go() -> tuple[list[list[int] | str], dict[str, Any], float]:
            async with Coordinator(spec, max_running=concurrency) as c:
                monkey.start()
                started = time.perf_counter()
                outs = await run_sessions(c, requests, concurrency)
                seconds = time.perf_counter() - started
                monkey.stop()
                return outs, c.failover_stats(), seconds

        outputs, stats, seconds = asyncio.run(go())
    finally:
        monkey.stop()
        mesh.close()
    failed = [o for o in outputs if isinstance(o, str)]
    wrong = sum(wrong_tokens(o, r) for o, r in zip(outputs, references, strict=True))
    return {
        "sessions": len(requests),
        "completed": len(requests) - len(failed),
        "identical": sum(o == r for o, r in zip(outputs, references, strict=True)),
        "wrong_tokens": wrong,
        "errors": failed[:5],
        "ranges": ranges,
        "replicas": replicas,
        "kills": monkey.kills,
        "restarts": monkey.restarts,
        "seconds": seconds,
        "tokens": sum(len(o) for o in outputs if not isinstance(o, str)),
        **stats,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    err = Console(stderr=True)
    with err.status("loading model and computing the single-process reference…"):
        model = load_model(args.model)
        requests = chaos_requests(
            model.tokenize, args.sessions, new_tokens=args.max_tokens, seed=args.seed
        )
        references = reference_outputs(model, requests)
    del model  # free the single-process weights' pages before the stations map theirs
    with err.status(
        f"{args.sessions} sessions over {args.stations}×{args.replicas} stations, a station "
        f"killed every {args.every[0]:g}–{args.every[1]:g} s…"
    ):
        report = chaos_run(
            args.model,
            requests,
            references,
            ranges=args.stations,
            replicas=args.replicas,
            every=(args.every[0], args.every[1]),
            concurrency=args.concurrency,
            seed=args.seed,
        )
    table = Table(title="chaos: failover under random SIGKILLs")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("sessions completed", f"{report['completed']} / {report['sessions']}"),
        ("identical to single process", f"{report['identical']} / {report['sessions']}"),
        ("wrong tokens", str(report["wrong_tokens"])),
        ("stations killed (restarted)", f"{report['kills']} ({report['restarts']})"),
        ("failovers", str(report["failovers"])),
        ("sequences rebuilt", str(report["rebuilt_sequences"])),
        ("time added per failover, mean", f"{report['added_ms_mean']:.0f} ms"),
        ("time added per failover, p50", f"{report['added_ms_p50']:.0f} ms"),
        ("time added per failover, max", f"{report['added_ms_max']:.0f} ms"),
        ("run time", f"{report['seconds']:.1f} s ({report['tokens']} tokens)"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    err.print(table)
    return report


def main(args: argparse.Namespace) -> int:
    report = run(args)
    write_json(args.json, report)
    ok = report["wrong_tokens"] == 0 and report["completed"] == report["sessions"]
    return 0 if ok else 1
