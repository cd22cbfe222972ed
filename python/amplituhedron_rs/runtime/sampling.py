"""The one sampling rule, shared by the API, the CLI, the coordinator and the stations.

Greedy (argmax) exactly when no temperature, top-k or top-p is given, or when the
temperature is 0. Any other given value samples: ``temperature=1.0`` given explicitly
samples at temperature 1, it does not mean greedy. Values left out take the core sampler's
defaults (temperature 1, no top-k, no top-p limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError

U64_MAX = 2**64 - 1
#: The largest ``top_k`` every backend carries (the stations' wire field is an i32): one
#: bound for the server, the coordinator and the stations, so a value one backend cannot
#: take is refused at the edge, never mid-generation.
TOP_K_MAX = 2**31 - 1
#: The logits adjustments and their neutral values (the core's defaults).
_ADJUST_NEUTRAL: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": (),
    "min_tokens": 0,
    "min_tokens_banned": (),
}


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked; checked when built (bad values raise ``InputError``)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    #: OpenAI's: subtracted once from the logit of every token generated so far.
    presence_penalty: float = 0.0
    #: OpenAI's: subtracted from a token's logit once per time it was generated.
    frequency_penalty: float = 0.0
    #: vLLM's: the logits of the prompt's and the generated tokens divided by it when
    #: positive, multiplied by it otherwise.
    repetition_penalty: float = 1.0
    #: ``(token id, bias)`` pairs added to the logits (before the penalties).
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Until this many tokens are generated, ``min_tokens_banned`` cannot be picked (the
    #: engine fills them from its stop ids; a bare sampler takes them here).
    min_tokens: int = 0
    min_tokens_banned: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.top_k is not None and not 0 <= self.top_k <= TOP_K_MAX:
            raise InputError(f"top_k must be in [0, {TOP_K_MAX}], got {self.top_k}")
        if not 0 <= self.seed <= U64_MAX:
            raise InputError(f"seed must be in [0, 2**64), got {self.seed}")
        self.sampler()  # the core checks the rest (temperature > 0, top_p in (0, 1])

    @property
    def greedy(self) -> bool:
        """Whether this picks the argmax (see the module's rule)."""
        if self.temperature == 0:
            return True
        return self.temperature is None and self.top_k is None and self.top_p is None

    def core_kwargs(self) -> dict[str, Any]:
        """The core's keyword arguments (``_core.Sampler``, ``Engine.submit``): ``greedy``,
        the seed, and the values given (the core's defaults stand for the others)."""
        kwargs: dict[str, Any] = {"greedy": self.greedy, "seed": self.seed}
        if not self.greedy:
            for name in ("temperature", "top_k", "top_p"):
                value = getattr(self, name)
                if value is not None:
                    kwargs[name] = value
        # The adjustments only when set: neutral values are the core's defaults.
        for name, neutral in _ADJUST_NEUTRAL.items():
            value = getattr(self, name)
            if value != neutral:
                kwargs[name] = list(value) if isinstance(value, tuple) else value
        return kwargs

    def engine_kwargs(self) -> dict[str, Any]:
        """``Engine.submit``'s sampling keywords (the engine derives ``min_tokens_banned``
        from its stop ids)."""
        kwargs = self.core_kwargs()
        kwargs.pop("min_tokens_banned", None)
        return kwargs

    def sampler(self, prompt: Sequence[int] = ()) -> _core.Sampler:
        """A fresh seeded sampler (one per generation), started at ``prompt`` (the penalties
        count from it)."""
        sampler = _core.Sampler(**self.core_kwargs())
        sampler.begin(list(prompt))
        return sampler

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def draw_kwargs(self) -> dict[str, Any]:
        """The draw's own fields (``temperature``, ``top_k``, ``top_p``, ``seed``): what
        ``Model.generate`` and the coordinator's ``generate`` take."""
        return {k: getattr(self, k) for k in ("temperature", "top_k", "top_p", "seed")}
