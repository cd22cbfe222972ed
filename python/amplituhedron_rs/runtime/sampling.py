"""The one sampling rule, shared by the API, the CLI, the coordinator and the stations.

Greedy (argmax) exactly when no temperature, top-k or top-p is given, or when the
temperature is 0. Any other given value samples: ``temperature=1.0`` given explicitly
samples at temperature 1, it does not mean greedy. Values left out take the core sampler's
defaults (temperature 1, no top-k, no top-p limit).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError

U64_MAX = 2**64 - 1
#: The largest ``top_k`` every backend carries (the stations' wire field is an i32): one
#: bound for the server, the coordinator and the stations, so a value one backend cannot
#: take is refused at the edge, never mid-generation.
TOP_K_MAX = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked; checked when built (bad values raise ``InputError``)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

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
        return kwargs

    def sampler(self) -> _core.Sampler:
        """A fresh seeded sampler (one per generation)."""
        return _core.Sampler(**self.core_kwargs())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
