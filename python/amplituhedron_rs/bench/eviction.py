"""Eviction policies on access traces, in-process on the real cache: Pisot-guard vs LRU
(seed 001 P5 / F4), and the cost-aware policy against both.

Eviction depends only on each entry's drift ``|‖tail‖₂ − 1|``, its recency, its size and
the prefill its hits saved, so the bench replays seeded access traces against real
:class:`~amplituhedron_rs.AmplituhedronCache` instances, one per policy (``"pisot"``,
``"lru"``, ``"gdsf"``). Each access probes the cache like the coordinator does: a replay,
and on a miss a capture. The KV slabs are zero-filled slabs of the right shape for a
one-layer range, since their content never enters the eviction choice.

The Zipf traces (one per seed) run over more distinct prefixes than the cache has entries.
Their tails are the model's own (the last hidden row of each prefix), in two sets:


- **Luminary basin** — each real tail rescaled to norm ``1 + σ·z`` (``z`` standard normal,
  seeded): the seed's assumption that tails are post-RMSNorm residuals near unit norm;
- **raw** — the tails exactly as the model emits them (pre-norm residuals, norms in the
  hundreds for SmolLM2), so drift is large and roughly proportional to the norm.

The **multi-tenant** trace is what a shared server sees: many users, each under one of a
few shared system prompts, each growing a conversation of long unique turns (and now and
then re-sending a prompt). A memory budget bounds the cache, and a miss on the exact prompt
tries the longest cached prefix (``replay_longest``), so a hit is a full replay or the reuse
of at least ``min_len`` positions. Its tails are Luminary tails (random directions, norms
``1 + σ·z``). Every trace reports hit rates and the prefill positions (and, given the
model's prefill time per token, seconds) the hits saved.

The seed's verdict (P5 / F4) compares Pisot-guard with LRU only, as it always did.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from amplituhedron_rs._core import AmplituhedronCache
from amplituhedron_rs.bench.config import BenchConfig, TenantSpec, TraceSpec

if TYPE_CHECKING:
    from amplituhedron_rs.runtime import Model

FloatArray = npt.NDArray[np.float32]
Policy = Literal["pisot", "lru", "gdsf"]
POLICIES: tuple[Policy, ...] = ("pisot", "lru", "gdsf")


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


def model_tails(
    model: Model, prefixes: Sequence[Sequence[int]], on_prefix: Callable[[str], None]
) -> tuple[list[FloatArray], float]:
    """Each prefix's tail (the last hidden row of a prefill over the whole model) and the
    model's prefill seconds per token over all of them."""
    tails = []
    seconds = 0.0
    for i, ids in enumerate(prefixes):
        session = model.new_session(0, model.n_layers)
        start = time.perf_counter()
        hidden, _ = session.forward_tokens(ids, logits="none")
        seconds += time.perf_counter() - start
        tails.append(hidden[-1].copy())
        on_prefix(f"prefix {i + 1}: ‖tail‖ = {float(np.linalg.norm(hidden[-1])):.1f}")
    return tails, seconds / max(1, sum(len(p) for p in prefixes))


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
    saved_positions: int = 0  #: prompt positions the hits did not prefill


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
    hits = saved = 0
    for i in trace:
        if cache.replay(fingerprint, prefixes[i], 0, 1) is not None:
            hits += 1
            saved += len(prefixes[i])
        else:
            cache.capture(fingerprint, prefixes[i], 0, 1, tails[i], slabs[i], slabs[i])
    stats = cache.stats()
    return PolicyRun(
        policy,
        hits,
        len(trace) - hits,
        int(stats["evictions"]),
        hits / max(1, len(trace)),
        saved,
    )


def compare_policies(
    spec: TraceSpec,
    prefixes: Sequence[Sequence[int]],
    raw_tails: Sequence[FloatArray],
    *,
    fingerprint: int,
    kv_heads: int,
    head_dim: int,
    prefill_s_per_token: float | None = None,
) -> dict[str, Any]:
    """Both tail sets × every policy × every seeded trace, and the multi-tenant trace;
    JSON-ready. With ``prefill_s_per_token`` (the model's measured prefill time per prompt
    token) saved positions are also reported as seconds."""
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
        saved = {p: 0 for p in POLICIES}
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
                saved[policy] += r.saved_positions
            per_seed.append(run)
        total = spec.accesses * len(spec.seeds)
        result["traces"][name] = {
            "accesses": total,
            "hits": dict(pooled),
            "hit_rate": {p: pooled[p] / total for p in POLICIES},
            "saved_positions": dict(saved),
            "saved_prefill_s": seconds(saved, prefill_s_per_token),
            "best": best_policy(pooled),
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
    for name, tenants in (("multi_tenant", spec.tenants), ("conversations", spec.conversations)):
        result["traces"][name] = compare_on_tenants(
            tenants,
            fingerprint=fingerprint,
            kv_heads=kv_heads,
            head_dim=head_dim,
            prefill_s_per_token=prefill_s_per_token,
        )
    return result


def winner(pisot_hits: int, lru_hits: int) -> str:
    """The seed's verdict: ``"pisot"``, ``"lru"`` or ``"tie"``."""
    if pisot_hits == lru_hits:
        return "tie"
    return "pisot" if pisot_hits > lru_hits else "lru"


def best_policy(hits: dict[Policy, int]) -> str:
    """The policy with the most hits (or saved positions), or ``"tie"`` if several share
    the most."""
    top = max(hits.values())
    leaders = [p for p, h in hits.items() if h == top]
    return leaders[0] if len(leaders) == 1 else "tie"


def seconds(positions: dict[Policy, int], per_token: float | None) -> dict[Policy, float] | None:
    """Saved positions as prefill seconds, if the time per token is known."""
    if per_token is None:
        return None
    return {p: n * per_token for p, n in positions.items()}


# --- the multi-tenant trace ----------------------------------------------------------------


def tenant_trace(spec: TenantSpec, seed: int) -> list[list[int]]:
    """The prompts of one seeded multi-tenant trace, in request order."""
    rng = np.random.default_rng(seed)
    systems = [
        [100_000 * (k + 1) + t for t in range(spec.system_len)] for k in range(spec.system_prompts)
    ]
    popularity = 1.0 / np.arange(1, spec.system_prompts + 1)
    system_of = rng.choice(spec.system_prompts, size=spec.users, p=popularity / popularity.sum())
    fresh = iter(range(10_000_000, 2**31))  # ids no other prompt ever uses

    def new_context(user: int) -> list[int]:
        n = int(rng.integers(spec.context[0], spec.context[1] + 1))
        return systems[system_of[user]] + [next(fresh) for _ in range(n)]

    contexts = [new_context(u) for u in range(spec.users)]
    activity = 1.0 / np.arange(1, spec.users + 1) ** spec.zipf_users
    who = rng.permutation(spec.users)[
        rng.choice(spec.users, size=spec.accesses, p=activity / activity.sum())
    ]
    last: dict[int, list[int]] = {}
    prompts = []
    for user in (int(u) for u in who):
        if user in last and rng.random() < spec.regenerate:
            prompts.append(last[user])
            continue
        n = int(rng.integers(spec.question[0], spec.question[1] + 1))
        prompt = contexts[user] + [next(fresh) for _ in range(n)]
        if rng.random() < spec.follow_up:
            contexts[user] = prompt
            if len(prompt) + spec.question[1] > spec.max_prompt:
                contexts[user] = new_context(user)
        last[user] = prompt
        prompts.append(prompt)
    return prompts


@dataclass
class TenantRun:
    """One policy on one multi-tenant trace."""

    policy: Policy
    full_hits: int  #: exact replays
    prefix_hits: int  #: reuses of >= min_len positions after an exact miss
    misses: int
    evictions: int
    saved_positions: int  #: prompt positions the hits did not prefill
    prompt_positions: int  #: positions of every prompt in the trace
    hit_rate: float  #: token hit rate: saved_positions / prompt_positions


def replay_tenants(
    policy: Policy,
    prompts: Sequence[Sequence[int]],
    spec: TenantSpec,
    *,
    max_bytes: int,
    seed: int,
    fingerprint: int,
    kv_heads: int,
    head_dim: int,
) -> TenantRun:
    """Runs one multi-tenant trace against a fresh byte-bounded cache with ``policy``."""
    cache = AmplituhedronCache(
        max_entries=1 << 30, max_prefix_len=spec.max_prompt, max_bytes=max_bytes, policy=policy
    )
    rng = np.random.default_rng(seed)
    full = prefix = saved = 0
    for prompt in prompts:
        if cache.replay(fingerprint, prompt, 0, 1) is not None:
            full += 1
            saved += len(prompt)
            continue
        reuse = cache.replay_longest(fingerprint, prompt, 0, 1, min_len=spec.min_len)
        if reuse is not None:
            prefix += 1
            saved += reuse[1]
        direction = rng.standard_normal(head_dim)
        norm = 1.0 + spec.luminary_sigma * rng.standard_normal()
        tail = (direction * (norm / np.linalg.norm(direction))).astype(np.float32)
        slab = np.zeros((1, kv_heads, len(prompt), head_dim), dtype=np.float32)
        cache.capture(fingerprint, prompt, 0, 1, tail, slab, slab)
    positions = sum(len(p) for p in prompts)
    return TenantRun(
        policy,
        full,
        prefix,
        len(prompts) - full - prefix,
        int(cache.stats()["evictions"]),
        saved,
        positions,
        saved / max(1, positions),
    )


def compare_on_tenants(
    spec: TenantSpec,
    *,
    fingerprint: int,
    kv_heads: int,
    head_dim: int,
    prefill_s_per_token: float | None = None,
) -> dict[str, Any]:
    """Every policy on every seeded multi-tenant trace, pooled; JSON-ready.

    Nearly every request shares at least its system prompt with some cached volume, so the
    share of requests that reuse anything says little; ``hit_rate`` is the token hit rate
    (prompt positions served from the cache over all prompt positions, the prefix-cache hit
    rate vLLM reports), and ``hits`` counts requests that reused at least ``min_len``."""
    per_seed = []
    hits = {p: 0 for p in POLICIES}
    full = {p: 0 for p in POLICIES}
    saved = {p: 0 for p in POLICIES}
    total = positions = 0
    for seed in spec.seeds:
        prompts = tenant_trace(spec, seed)
        mean = sum(len(p) for p in prompts) / len(prompts)
        # A volume's bytes: K and V of one layer, the tail (head_dim floats), the ids.
        per_volume = 4 * (2 * kv_heads * head_dim * mean + head_dim + mean)
        max_bytes = int(spec.budget_volumes * per_volume)
        runs = {
            p: replay_tenants(
                p,
                prompts,
                spec,
                max_bytes=max_bytes,
                seed=seed,
                fingerprint=fingerprint,
                kv_heads=kv_heads,
                head_dim=head_dim,
            )
            for p in POLICIES
        }
        for p, r in runs.items():
            hits[p] += r.full_hits + r.prefix_hits
            full[p] += r.full_hits
            saved[p] += r.saved_positions
        total += len(prompts)
        positions += runs["lru"].prompt_positions
        per_seed.append(
            {"seed": seed, "max_bytes": max_bytes} | {p: asdict(r) for p, r in runs.items()}
        )
    return {
        "spec": asdict(spec) | {"description": spec.describe()},
        "accesses": total,
        "prompt_positions": positions,
        "hits": hits,
        "full_hits": full,
        "request_hit_rate": {p: hits[p] / total for p in POLICIES},
        "hit_rate": {p: saved[p] / positions for p in POLICIES},
        "saved_positions": saved,
        "saved_prefill_s": seconds(saved, prefill_s_per_token),
        "best": best_policy(saved),
        "winner": winner(saved["pisot"], saved["lru"]),
        "per_seed": per_seed,
    }


# --- on its own ----------------------------------------------------------------------------


def run(json_path: str | None = None) -> dict[str, Any]:
    """``amplituhedron bench-eviction``: every eviction trace of ``amplituhedron bench``, on
    the bundled model (its tails and its prefill time), without the mesh phases."""
    from amplituhedron_rs.bench.prompts import build_prompts
    from amplituhedron_rs.bench.report import write_json
    from amplituhedron_rs.runtime import CacheOptions, load_model

    cfg = BenchConfig()
    model = load_model(cfg.model, cache=CacheOptions(max_prefix_len=1 << 20))
    tok = model.tokenizer
    prompts = build_prompts(tok.encode, tok.decode, tok.chat_ids, cfg).eviction
    tails, per_token = model_tails(model, prompts, lambda _: None)
    result = compare_policies(
        cfg.trace,
        prompts,
        tails,
        fingerprint=model.fingerprint,
        kv_heads=model.weights.n_kv_heads,
        head_dim=model.weights.head_dim,
        prefill_s_per_token=per_token,
    )
    print(f"prefill: {1e3 * per_token:.2f} ms per token (measured on the eviction prefixes)")
    for name, t in result["traces"].items():
        rates = ", ".join(f"{p} {100 * t['hit_rate'][p]:.1f} %" for p in POLICIES)
        saved = t["saved_prefill_s"]
        seconds_saved = ", ".join(f"{p} {saved[p]:.1f} s" for p in POLICIES)
        print(f"{name}: hit rate {rates}; prefill saved {seconds_saved}; best {t['best']}")
    write_json(json_path, result)
    return result
