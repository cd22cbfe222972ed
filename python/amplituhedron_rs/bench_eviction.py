"""Pisot-guard vs LRU on one access trace (seed 001 P5 / F4), in-process on the real cache.

Eviction depends only on each entry's drift ``|‖tail‖₂ − 1|`` and on recency, so the bench
replays a seeded Zipf-like access trace over more distinct prefixes than the cache has
entries against two real :class:`~amplituhedron_rs.AmplituhedronCache` instances (policy
``"pisot"`` and ``"lru"``). Each access probes the cache like the coordinator does: a replay,
and on a miss a capture. The tails are the model's own (the last hidden row of each prefix);
the KV slabs are zero-filled slabs of the right shape for a one-layer range, since their
content never enters the eviction choice.

Two tail sets share each access trace:

- **Luminary basin** — each real tail rescaled to norm ``1 + σ·z`` (``z`` standard normal,
  seeded): the seed's assumption that tails are post-RMSNorm residuals near unit norm;
- **raw** — the tails exactly as the model emits them (pre-norm residuals, norms in the
  hundreds for SmolLM2), so drift is large and roughly proportional to the norm.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from amplituhedron_rs._core import AmplituhedronCache

FloatArray = npt.NDArray[np.float32]
Policy = Literal["pisot", "lru"]
POLICIES: tuple[Policy, Policy] = ("pisot", "lru")


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


def zipf_trace(prefixes: int, accesses: int, s: float, seed: int) -> list[int]:
    """A seeded access trace: prefix indices whose popularity follows rank^-s. Which prefix
    holds which rank is shuffled by the same seed, so popularity is independent of the
    prefix's index (and of its tail)."""
    if prefixes < 1 or accesses < 0:
        raise ValueError(f"need prefixes >= 1 and accesses >= 0, got {prefixes}, {accesses}")
    rng = np.random.default_rng(seed)
    owner = rng.permutation(prefixes)
    weights = 1.0 / np.arange(1, prefixes + 1, dtype=np.float64) ** s
    ranks = rng.choice(prefixes, size=accesses, p=weights / weights.sum())
    return [int(owner[r]) for r in ranks]


def luminary_tails(tails: Sequence[FloatArray], sigma: float, seed: int) -> list[FloatArray]:
    """Each tail's direction with norm ``1 + sigma·z`` (seeded standard normal ``z``)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in tails:
        norm = float(np.linalg.norm(t.astype(np.float64)))
        if not norm > 0:
            raise ValueError("a zero tail has no direction to rescale")
        target = 1.0 + sigma * float(rng.standard_normal())
        out.append((t.astype(np.float64) * (target / norm)).astype(np.float32))
    return out


def drift(tail: FloatArray) -> float:
    """The Pisot-guard drift ``|‖tail‖₂ − 1|`` (what the cache computes at capture)."""
    return abs(float(np.linalg.norm(tail.astype(np.float64))) - 1.0)


@dataclass
class PolicyRun:
    """One policy's result on one trace."""

    policy: Policy
    hits: int
    misses: int
    evictions: int
    hit_rate: float


@dataclass
class TraceRun:
    """Both policies on one seeded trace."""

    seed: int
    accesses: list[int]
    runs: dict[str, PolicyRun] = field(default_factory=dict)


def replay_trace(
    policy: Policy,
    prefixes: Sequence[Sequence[int]],
    tails: Sequence[FloatArray],
    trace: Sequence[int],
    *,
    max_entries: int,
    fingerprint: int,
    kv_heads: int,
    head_dim: int,
) -> PolicyRun:
    """Runs ``trace`` (prefix indices) against a fresh cache with ``policy``."""
    if len(prefixes) != len(tails):
        raise ValueError(f"{len(prefixes)} prefixes but {len(tails)} tails")
    cache = AmplituhedronCache(max_entries=max_entries, max_prefix_len=1 << 20, policy=policy)
    slabs = [np.zeros((1, kv_heads, len(p), head_dim), dtype=np.float32) for p in prefixes]
    hits = 0
    for i in trace:
        if cache.replay(fingerprint, prefixes[i], 0, 1) is not None:
            hits += 1
        else:
            cache.capture(fingerprint, prefixes[i], 0, 1, tails[i], slabs[i], slabs[i])
    stats = cache.stats()
    return PolicyRun(
        policy, hits, len(trace) - hits, int(stats["evictions"]), hits / max(1, len(trace))
    )


def compare_policies(
    spec: TraceSpec,
    prefixes: Sequence[Sequence[int]],
    raw_tails: Sequence[FloatArray],
    *,
    fingerprint: int,
    kv_heads: int,
    head_dim: int,
) -> dict[str, Any]:
    """Both tail sets × both policies × every seeded trace; JSON-ready."""
    if len(prefixes) != spec.prefixes:
        raise ValueError(f"the spec has {spec.prefixes} prefixes, got {len(prefixes)}")
    if len({tuple(p) for p in prefixes}) != len(prefixes):
        raise ValueError("the eviction prefixes must be distinct")
    tail_sets = {
        "luminary": luminary_tails(raw_tails, spec.luminary_sigma, spec.luminary_seed),
        "raw": list(raw_tails),
    }
    traces = [zipf_trace(spec.prefixes, spec.accesses, spec.zipf_s, s) for s in spec.seeds]
    result: dict[str, Any] = {
        "spec": asdict(spec) | {"description": spec.describe()},
        "prefixes": [],
        "traces": {},
    }
    counts = Counter(i for t in traces for i in t)
    for i, p in enumerate(prefixes):
        result["prefixes"].append(
            {
                "index": i,
                "tokens": len(p),
                "accesses": counts[i],
                "raw_norm": float(np.linalg.norm(raw_tails[i])),
                "raw_drift": drift(raw_tails[i]),
                "luminary_norm": float(np.linalg.norm(tail_sets["luminary"][i])),
                "luminary_drift": drift(tail_sets["luminary"][i]),
            }
        )
    for name, tails in tail_sets.items():
        per_seed = []
        pooled = {p: 0 for p in POLICIES}
        for seed, trace in zip(spec.seeds, traces, strict=True):
            run = TraceRun(seed, trace)
            for policy in POLICIES:
                r = replay_trace(
                    policy,
                    prefixes,
                    tails,
                    trace,
                    max_entries=spec.max_entries,
                    fingerprint=fingerprint,
                    kv_heads=kv_heads,
                    head_dim=head_dim,
                )
                run.runs[policy] = r
                pooled[policy] += r.hits
            per_seed.append(run)
        total = spec.accesses * len(spec.seeds)
        result["traces"][name] = {
            "accesses": total,
            "hits": dict(pooled),
            "hit_rate": {p: pooled[p] / total for p in POLICIES},
            "winner": winner(pooled["pisot"], pooled["lru"]),
            "per_seed": [
                {
                    "seed": r.seed,
                    "accesses": r.accesses,
                    **{p: asdict(r.runs[p]) for p in POLICIES},
                }
                for r in per_seed
            ],
        }
    return result


def winner(pisot_hits: int, lru_hits: int) -> str:
    """``"pisot"``, ``"lru"`` or ``"tie"``."""
    if pisot_hits == lru_hits:
        return "tie"
    return "pisot" if pisot_hits > lru_hits else "lru"
