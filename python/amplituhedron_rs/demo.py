"""A short tour on the bundled model: the same chat twice, the second replayed from the cache."""

from __future__ import annotations

from rich.console import Console

from amplituhedron_rs.model import load_model

SYSTEM = (
    "You are a concise assistant for amateur astronomers. Answer in two sentences, "
    "give one concrete example, and avoid jargon."
)
QUESTION = "Why does the Moon always show the same face to the Earth?"


def main() -> int:
    out = Console()
    err = Console(stderr=True)
    with err.status("loading SmolLM2-135M-Instruct (Q4_1)…"):
        model = load_model()
    ids = model.chat_ids(SYSTEM, QUESTION)
    for attempt in ("first session (cold prefill, then capture)", "second session (replay)"):
        err.rule(attempt)
        g = model.generate(
            ids,
            48,
            stream=lambda piece: out.print(piece, end="", markup=False, highlight=False),
        )
        out.print()
        err.print(
            f"[dim]cache {'hit' if g.cache_hit else 'miss'} · prefill {g.prefill_ms:.1f} ms · "
            f"decode {g.decode_ms / max(1, len(g.output_ids)):.1f} ms/token[/dim]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
