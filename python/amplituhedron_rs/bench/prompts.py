"""The bench's prompts, as token ids: a shared one, one per unique session, one per eviction
prefix and a warm-up, each a slice of offline reference text under a chat question."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from amplituhedron_rs.bench.config import BenchConfig
from amplituhedron_rs.bench.textsource import text_of_tokens

QUESTION = "In one sentence, what is the main idea of the text above?"
"""The fixed user question of the shared prompt."""
UNIQUE_QUESTIONS = (
    "Which term in the text above matters most, and why?",
    "Summarize the text above in five words.",
    "What would a beginner find hardest in the text above?",
    "Name one example that the text above could use.",
)
"""User questions of the unique-prompt regime (cycled; each also has its own system text)."""


@dataclass(frozen=True)
class Prompts:
    """Every prompt of one bench run, as token ids."""

    shared: list[int]  #: cache on/off regimes: identical every session
    unique: list[list[int]]  #: one per session of the unique regime
    eviction: list[list[int]]  #: the eviction trace's distinct prefixes
    warmup: list[int]  #: distinct from all the others


def build_prompts(encode: Any, decode: Any, chat_ids: Any, cfg: BenchConfig) -> Prompts:
    """Prompt ``i`` of the unique regime (and of the eviction trace) takes the ``i+1``-th
    slice of ``prompt_tokens`` tokens of reference text as its system prompt; the shared
    prompt takes slice 0. Every prompt is checked distinct."""
    n = cfg.prompt_tokens
    count = max(cfg.sessions, cfg.trace.prefixes) + 2
    stream = text_of_tokens(encode, n * count)

    def system(i: int) -> str:
        return str(decode(stream[i * n : (i + 1) * n]))

    def unique(i: int) -> list[int]:
        q = UNIQUE_QUESTIONS[i % len(UNIQUE_QUESTIONS)]
        return list(chat_ids(system(i + 1), q))

    prompts = Prompts(
        shared=list(chat_ids(system(0), QUESTION)),
        unique=[unique(i) for i in range(cfg.sessions)],
        eviction=[unique(i) for i in range(cfg.trace.prefixes)],
        warmup=unique(count - 2),
    )
    distinct = {tuple(p) for p in [prompts.shared, prompts.warmup, *prompts.unique]}
    if len(distinct) != cfg.sessions + 2 or len({tuple(p) for p in prompts.eviction}) != len(
        prompts.eviction
    ):
        raise ValueError("the reference text repeats: the bench's prompts are not distinct")
    return prompts
