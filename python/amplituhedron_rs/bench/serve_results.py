"""What ``bench-serve`` records and how it combines rounds: each request's figures, a
concurrency level's, the engine's load from /metrics, and the medians across rounds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    ttft_s: float
    gaps_s: list[float]
    tokens: int
    error: str | None = None


@dataclass
class LevelResult:
    clients: int
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    #: The distinct errors seen (the first few), so a failing peer says why.
    error_messages: list[str] = field(default_factory=list)
    #: tok/s of each round (the figures above are medians over them).
    rounds_tokens_per_s: list[float] = field(default_factory=list)
    #: tok/s over the same system's one-client level, median of the per-round ratios (when
    #: the sweep has one client).
    over_one_client: float | None = None
    #: Our tok/s over this system's at the same level, median of the per-round ratios (peers
    #: only).
    ours_over_this: float | None = None
    #: Our engine's load over the level, from its /metrics (None for peers): the fraction of
    #: the wall time a batched step was in flight, the mean rows per step, and the output
    #: tokens per second of those steps — what the engine sustains with the HTTP layer's
    #: cost and idle gaps taken out.
    engine_busy: float | None = None
    rows_per_step: float | None = None
    engine_tokens_per_s: float | None = None


@dataclass(frozen=True)
class EngineTotals:
    """Our server's engine counters at one moment (``amplituhedron:engine_*``)."""

    steps: float
    rows: float
    busy_seconds: float

    def load(self, later: EngineTotals, wall_s: float, tokens: int) -> EngineLoad:
        """The load from here to ``later``, over ``wall_s`` seconds that gave ``tokens``."""
        steps, busy = later.steps - self.steps, later.busy_seconds - self.busy_seconds
        return EngineLoad(
            busy=busy / wall_s if wall_s > 0 else None,
            rows_per_step=(later.rows - self.rows) / steps if steps > 0 else None,
            tokens_per_s=tokens / busy if busy > 0 else None,
        )


@dataclass(frozen=True)
class EngineLoad:
    """See :attr:`LevelResult.engine_busy` (None: not known, e.g. for a peer)."""

    busy: float | None = None
    rows_per_step: float | None = None
    tokens_per_s: float | None = None


def parse_engine_totals(metrics_text: str) -> EngineTotals | None:
    """The engine counters in a /metrics page, or None when it has none (a peer)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "amplituhedron:engine_steps_total":
                found["steps"] = sample.value
            elif sample.name == "amplituhedron:engine_rows_total":
                found["rows"] = found.get("rows", 0.0) + sample.value
            elif sample.name == "amplituhedron:engine_busy_seconds_total":
                found["busy_seconds"] = sample.value
    if len(found) < 3:
        return None
    return EngineTotals(**found)


@dataclass
class SystemResult:
    name: str
    levels: list[LevelResult] = field(default_factory=list)
    note: str = ""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, interpolated between the two nearest ranks (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    at = q / 100 * (len(s) - 1)
    lo = int(at)
    hi = min(len(s) - 1, lo + 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


def combine(rounds: list[LevelResult]) -> LevelResult:
    """One level's rounds as one result: counts summed, figures the medians over rounds."""

    def median(xs: Sequence[float]) -> float:
        return float(statistics.median(xs)) if xs else float("nan")

    first = rounds[0]
    return LevelResult(
        clients=first.clients,
        requests=sum(r.requests for r in rounds),
        errors=sum(r.errors for r in rounds),
        wall_s=sum(r.wall_s for r in rounds),
        output_tokens=sum(r.output_tokens for r in rounds),
        tokens_per_s=median([r.tokens_per_s for r in rounds]),
        ttft_p50_ms=median([r.ttft_p50_ms for r in rounds]),
        ttft_p99_ms=median([r.ttft_p99_ms for r in rounds]),
        itl_p50_ms=median([r.itl_p50_ms for r in rounds]),
        itl_p99_ms=median([r.itl_p99_ms for r in rounds]),
        error_messages=sorted({m for r in rounds for m in r.error_messages})[:5],
        rounds_tokens_per_s=[r.tokens_per_s for r in rounds],
        engine_busy=median_of_known([r.engine_busy for r in rounds]),
        rows_per_step=median_of_known([r.rows_per_step for r in rounds]),
        engine_tokens_per_s=median_of_known([r.engine_tokens_per_s for r in rounds]),
    )


def median_of_known(xs: Sequence[float | None]) -> float | None:
    """Median of the values that are not None (None if there are none)."""
    known = [x for x in xs if x is not None]
    return float(statistics.median(known)) if known else None


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float | None:
    """Median of the per-round ratios ``num[i] / den[i]`` (None without a usable pair)."""
    ratios = [n / d for n, d in zip(num, den, strict=False) if d > 0]
    return float(statistics.median(ratios)) if ratios else None
