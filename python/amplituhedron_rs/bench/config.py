"""What a bench run is parameterized by: plain dataclasses with their checks, light to import
(the CLI reads their defaults to build its help)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TenantSpec:
    """A shared server's traffic: many users, each with a long context of their own (documents,
    history) under one of a few shared system prompts, asking short new questions about it,
    under a memory budget. With ``follow_up`` the questions stay in the context: a
    conversation that grows turn by turn (and starts over past ``max_prompt``)."""

    users: int = 64  #: users, each bound to one system prompt (popularity ∝ 1/rank)
    system_prompts: int = 4  #: shared system prompts
    system_len: int = 192  #: ids per system prompt
    context: tuple[int, int] = (256, 768)  #: ids of a user's own context (range)
    question: tuple[int, int] = (16, 64)  #: ids a request adds (range)
    follow_up: float = 0.0  #: probability a request's question stays in the user's context
    max_prompt: int = 2048  #: a context that would grow past this starts over
    regenerate: float = 0.1  #: probability a request re-sends the user's last prompt
    zipf_users: float = 0.8  #: user activity ∝ 1/rank^s
    accesses: int = 1500  #: requests per trace
    budget_volumes: float = 12.0  #: memory budget, in volumes of the trace's mean length
    min_len: int = 16  #: shortest prefix reuse that counts as a hit
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    luminary_sigma: float = 0.02  #: σ of the tails' norms around 1

    def __post_init__(self) -> None:
        if self.users < 1 or self.system_prompts < 1 or self.accesses < 1 or not self.seeds:
            raise ValueError("the multi-tenant trace needs users, system prompts, accesses, seeds")
        for name, (lo, hi) in (("context", self.context), ("question", self.question)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range of positive lengths, got {lo}-{hi}")
        if self.system_len + self.context[1] + self.question[1] > self.max_prompt:
            raise ValueError("a fresh context and a question must fit max_prompt")
        if not 0 <= self.follow_up <= 1 or not 0 <= self.regenerate < 1:
            raise ValueError("follow_up must be in [0, 1] and regenerate in [0, 1)")
        if self.budget_volumes <= 0 or self.min_len < 1:
            raise ValueError("the budget must be positive and min_len at least 1")

    def describe(self) -> str:
        """One sentence for the bench output."""
        kind = (
            f"questions of {self.question[0]}-{self.question[1]} ids"
            if self.follow_up == 0
            else f"turns of {self.question[0]}-{self.question[1]} ids that stay in the "
            f"context with probability {self.follow_up:g} (up to {self.max_prompt} ids)"
        )
        return (
            f"{len(self.seeds)} seeded traces of {self.accesses} requests by {self.users} users "
            f"(activity ∝ 1/rank^{self.zipf_users:g}) under {self.system_prompts} shared "
            f"{self.system_len}-id system prompts, each user with a context of "
            f"{self.context[0]}-{self.context[1]} unique ids and {kind}; "
            f"{self.regenerate:.0%} re-sends; memory for {self.budget_volumes:g} mean volumes"
        )


#: A conversation-shaped variant: every turn stays in the context, so each user's prompts
#: extend one another until the conversation starts over.
CONVERSATIONS = TenantSpec(
    context=(96, 384), question=(48, 160), follow_up=1.0, max_prompt=1536, users=48
)


@dataclass(frozen=True)
class TraceSpec:
    """The shape of the access traces."""

    prefixes: int = 12  #: distinct prefixes (more than ``max_entries``)
    max_entries: int = 4  #: cache capacity
    accesses: int = 300  #: accesses per trace
    zipf_s: float = 1.0  #: popularity of rank k ∝ 1 / k^s
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)  #: one trace per seed, pooled for the verdict
    luminary_sigma: float = 0.02  #: σ of the Luminary tails' norms around 1
    luminary_seed: int = 1234  #: seed of the Luminary norms (fixed across traces)
    tenants: TenantSpec = field(default_factory=TenantSpec)  #: the multi-tenant trace
    conversations: TenantSpec = CONVERSATIONS  #: its chat variant

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {self.max_entries}")
        if self.prefixes <= self.max_entries:
            raise ValueError(
                f"the trace needs more distinct prefixes ({self.prefixes}) than cache entries "
                f"({self.max_entries}), or nothing is ever evicted"
            )
        if self.accesses < 1:
            raise ValueError(f"accesses must be at least 1, got {self.accesses}")
        if not self.seeds:
            raise ValueError("at least one trace seed is needed")
        if not self.zipf_s >= 0:
            raise ValueError(f"zipf_s must be >= 0, got {self.zipf_s}")
        if not 0 <= self.luminary_sigma < 1:
            raise ValueError(f"luminary_sigma must be in [0, 1), got {self.luminary_sigma}")

    def describe(self) -> str:
        """One sentence for the bench output."""
        return (
            f"{len(self.seeds)} seeded traces (seeds {list(self.seeds)}) of {self.accesses} "
            f"accesses over {self.prefixes} distinct prefixes, Zipf-like popularity "
            f"p(rank k) ∝ 1/k^{self.zipf_s:g} with ranks shuffled per seed, cache of "
            f"{self.max_entries} entries; each access replays and captures on a miss"
        )


@dataclass(frozen=True)
class BenchConfig:
    """Everything one bench run is parameterized by."""

    stations: int = 4
    mesh: str | None = None  #: a running mesh (file or URLs) instead of a local one
    token: str | None = None  #: the stations' bearer token
    sessions: int = 10
    prompt_tokens: int = 256  #: tokens of real text in the shared system prompt
    new_tokens: int = 8
    chunk: int = 64  #: prefill rows per request
    model: str | None = None  #: GGUF path (default: the bundled SmolLM2)
    trace: TraceSpec = field(default_factory=TraceSpec)
    llamacpp_threads: int = 2

    def __post_init__(self) -> None:
        if self.sessions < 2:
            raise ValueError(
                f"--sessions must be at least 2 (P1/P2 compare sessions), got {self.sessions}"
            )
        if self.prompt_tokens < 1:
            raise ValueError(f"--prompt-tokens must be at least 1, got {self.prompt_tokens}")
        if self.new_tokens < 1:
            raise ValueError(f"--new-tokens must be at least 1, got {self.new_tokens}")
        if self.mesh is None and self.stations < 1:
            raise ValueError(f"--stations must be at least 1, got {self.stations}")
        if self.chunk < 1:
            raise ValueError(f"--chunk must be at least 1, got {self.chunk}")
        if self.llamacpp_threads < 1:
            raise ValueError(f"--llamacpp-threads must be at least 1, got {self.llamacpp_threads}")
