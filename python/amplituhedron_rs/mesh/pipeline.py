"""Pipelined steps (SPEC §6): a step's prompt entries cut into pieces that flow through the
stations one behind the other, station ``k`` working on piece ``j`` while station ``k+1``
works on piece ``j−1``.

A step of ``n`` pieces over ``K`` stations then takes ``n + K − 1`` stage times instead of
``n·K``, and on one shared host every core has a station's piece to run. Nothing about the
result changes: each piece is the prompt's next positions (kernels are batch-invariant, so
chunked ≡ whole), a station gets a sequence's pieces in order, and only the last piece of a
prompt's last entry emits or captures the whole prompt. A piece that fails fails the whole
step (the executor fails over and runs the step again, every entry from its start).

:func:`cut` makes the pieces (the first carries the step's decode entries), :func:`merge`
turns the pieces' answers back into the step's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from amplituhedron_rs.mesh import protocol as wire


@dataclass(frozen=True)
class PieceStep:
    """One piece of a step: ``(entry index in the step, its piece)`` for every entry it
    carries."""

    parts: tuple[tuple[int, wire.BatchEntrySpec], ...]

    @property
    def entries(self) -> list[int]:
        return [k for k, _ in self.parts]

    @property
    def specs(self) -> list[wire.BatchEntrySpec]:
        return [spec for _, spec in self.parts]


def cut(specs: Sequence[wire.BatchEntrySpec], rows: int) -> list[PieceStep]:
    """The step's pieces: every prefill entry of more than ``rows`` rows in pieces of
    ``rows`` (piece ``j`` of each in piece step ``j``); decode entries whole, in the first.
    One piece step when nothing is cut."""
    per_entry: list[list[wire.BatchEntrySpec]] = []
    for spec in specs:
        n = len(spec.tokens)
        if spec.kind != "prefill" or n <= rows:
            per_entry.append([spec])
            continue
        pieces = []
        for at in range(0, n, rows):
            final = at + rows >= n
            pieces.append(
                spec.model_copy(
                    update={
                        "start": spec.start + at,
                        "tokens": spec.tokens[at : at + rows],
                        # Only the last piece ends the prompt (and emits, if the entry does).
                        "last": spec.last and final,
                        "emit": spec.emit and final,
                    }
                )
            )
        per_entry.append(pieces)
    depth = max(len(p) for p in per_entry)
    return [
        PieceStep(tuple((k, p[j]) for k, p in enumerate(per_entry) if j < len(p)))
        for j in range(depth)
    ]


def merge(
    n_entries: int, steps: Sequence[PieceStep], replies: Sequence[wire.BatchStepReply]
) -> wire.BatchStepReply:
    """The step's answer from its pieces' (the exit station's): per entry, the clock,
    emission and log-probabilities of its last piece, the rows and captured bytes of all,
    and its prompt log-probabilities in order."""
    pieces: list[list[wire.BatchEntryResult]] = [[] for _ in range(n_entries)]
    for step, reply in zip(steps, replies, strict=True):
        for k, result in zip(step.entries, reply.entries, strict=True):
            pieces[k].append(result)
    merged = []
    for results in pieces:
        last = results[-1]
        scored = [r.prompt_logprobs for r in results if r.prompt_logprobs is not None]
        merged.append(
            wire.BatchEntryResult(
                clock=last.clock,
                rows=sum(r.rows for r in results),
                emitted=last.emitted,
                captured=sum(r.captured for r in results),
                logprobs=last.logprobs,
                prompt_logprobs=[lp for s in scored for lp in s] if scored else None,
            )
        )
    return wire.BatchStepReply(entries=merged)
