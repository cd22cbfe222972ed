"""The falsifiability bench: verdict logic on hand-made numbers at, above and below every
threshold; the eviction harness on the real cache; and one tiny end-to-end run through the
same command as the full bench (2 real station processes over HTTP, 3 sessions, a 24-token
system prompt, 2 new tokens) checking the JSON schema, the plot and the report."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from amplituhedron_rs import cli
from amplituhedron_rs.bench import report as bench_report
from amplituhedron_rs.bench.config import CONVERSATIONS, TenantSpec, TraceSpec
from amplituhedron_rs.bench.eviction import (
    compare_on_tenants,
    luminary_tails,
    replay_tenants,
    replay_trace,
    tenant_trace,
    zipf_trace,
)
from amplituhedron_rs.bench.verdicts import (
    F3_MIN_UPLIFT,
    P3_MIN_UPLIFT,
    Measurements,
    SessionPhases,
    amortized_tps,
    f1_false_positive_hit,
    f2_session2_not_faster,
    f3_uplift_below_2x,
    f4_pisot_worse_than_lru,
    f5_oracle_parity,
    judge,
    latency_reduction,
    p1_sessions_skip_prefill,
    p2_session2_faster,
    p3_amortized_uplift,
    p4_zero_false_hits,
    p5_pisot_retains_luminary,
    verdicts_json,
)

HIT2 = SessionPhases(("hit", "hit"), 0.0)
MISS2 = SessionPhases(("miss", "miss"), 150.0)

# --- P1 ---------------------------------------------------------------------------------


def test_p1_upheld_when_every_later_session_skips_prefill() -> None:
    p = p1_sessions_skip_prefill([MISS2, HIT2, HIT2])
    assert p.upheld and p.value == 2 and p.threshold == 2


@pytest.mark.parametrize(
    "bad",
    [
        SessionPhases(("hit", "miss"), 120.0),  # one station missed
        SessionPhases(("hit", "partial"), 3.0),  # an erasure is not a full skip
        SessionPhases(("hit", "hit"), 0.5),  # all hit but time went to prefill
        SessionPhases((), 0.0),  # no station answered at all
    ],
)
def test_p1_falsified_by_any_later_session_that_did_not_skip(bad: SessionPhases) -> None:
    p = p1_sessions_skip_prefill([MISS2, HIT2, bad, HIT2])
    assert not p.upheld
    assert p.value == 2 and p.threshold == 3
    assert "[3]" in p.detail


def test_p1_needs_two_sessions() -> None:
    with pytest.raises(ValueError, match="at least 2 sessions"):
        p1_sessions_skip_prefill([HIT2])


# --- P2 / F2 ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("session2_ms", "upheld"),
    [(100.0, True), (200.0, True), (201.0, False), (1000.0, False), (1500.0, False)],
)
def test_p2_and_f2_at_around_and_below_80_percent(session2_ms: float, upheld: bool) -> None:
    p2 = p2_session2_faster(1000.0, session2_ms)
    f2 = f2_session2_not_faster(1000.0, session2_ms)
    assert p2.value == pytest.approx(1 - session2_ms / 1000.0)
    assert p2.threshold == 0.8
    assert p2.upheld is upheld
    assert f2.fired is (not upheld)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_latencies_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="positive latency"):
        latency_reduction(bad, 10.0)
    with pytest.raises(ValueError, match="positive latency"):
        p2_session2_faster(10.0, bad)


@given(
    st.floats(min_value=1e-3, max_value=1e6, allow_nan=False),
    st.floats(min_value=1e-3, max_value=1e6, allow_nan=False),
)
def test_f2_is_exactly_the_negation_of_p2(s1: float, s2: float) -> None:
    assert f2_session2_not_faster(s1, s2).fired is not p2_session2_faster(s1, s2).upheld


# --- P3 / F3 ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("warm_tps", "p3_upheld", "f3_fired"),
    [
        (6.0, True, False),  # 3×
        (5.0, True, False),  # exactly 2.5×
        (4.8, False, False),  # 2.4×: P3 falsified, F3 quiet (the seed's slack band)
        (4.0, False, False),  # exactly 2×: F3 needs strictly below
        (3.98, False, True),  # 1.99×
        (1.0, False, True),
    ],
)
def test_p3_and_f3_thresholds(warm_tps: float, p3_upheld: bool, f3_fired: bool) -> None:
    p3 = p3_amortized_uplift(2.0, warm_tps)
    f3 = f3_uplift_below_2x(2.0, warm_tps)
    assert p3.value == pytest.approx(warm_tps / 2.0)
    assert p3.threshold == P3_MIN_UPLIFT
    assert p3.upheld is p3_upheld
    assert f3.fired is f3_fired
    assert f"{F3_MIN_UPLIFT}" in f3.claim


def test_uplift_needs_a_positive_cold_baseline() -> None:
    with pytest.raises(ValueError, match="cold TPS must be positive"):
        p3_amortized_uplift(0.0, 3.0)


def test_amortized_tps_is_tokens_over_summed_latency() -> None:
    assert amortized_tps(16, [1000.0, 1000.0]) == 8.0
    assert amortized_tps(0, [5.0]) == 0.0
    with pytest.raises(ValueError, match="at least one session"):
        amortized_tps(8, [])
    with pytest.raises(ValueError, match="positive latency"):
        amortized_tps(8, [10.0, 0.0])


# --- P4 / F1 ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replies", "stats", "value"), [(0, 0, 0), (1, 0, 1), (0, 2, 2), (3, 3, 3)]
)
def test_p4_and_f1_on_false_hits(replies: int, stats: int, value: int) -> None:
    p4 = p4_zero_false_hits(replies, stats)
    f1 = f1_false_positive_hit(replies, stats)
    assert p4.value == value and p4.threshold == 0
    assert p4.upheld is (value == 0)
    assert f1.fired is (value > 0)
    assert f"{replies} station replies" in f1.evidence


def test_false_hit_counts_cannot_be_negative() -> None:
    with pytest.raises(ValueError, match="reply_false_hits"):
        p4_zero_false_hits(-1, 0)


# --- P5 / F4 ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pisot", "lru", "upheld"), [(150, 150, True), (151, 150, True), (149, 150, False)]
)
def test_p5_and_f4_compare_hit_counts(pisot: int, lru: int, upheld: bool) -> None:
    p5 = p5_pisot_retains_luminary(pisot, lru, 300)
    f4 = f4_pisot_worse_than_lru(pisot, lru, 300)
    assert p5.value == pisot / 300 and p5.threshold == lru / 300
    assert p5.upheld is upheld
    assert f4.fired is (not upheld)


def test_p5_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match=r"within 0\.\.10"):
        p5_pisot_retains_luminary(11, 3, 10)
    with pytest.raises(ValueError, match="at least one access"):
        p5_pisot_retains_luminary(0, 0, 0)


# --- F5 ---------------------------------------------------------------------------------


def test_f5_fires_on_any_failure_or_an_unavailable_suite() -> None:
    assert not f5_oracle_parity(41, []).fired
    f = f5_oracle_parity(41, ["vandermonde_runtime_oracle_plucker: Lean says 1"])
    assert f.fired and "1 of 41" in f.evidence and "plucker" in f.evidence
    u = f5_oracle_parity(0, [], unavailable="no lean/ directory")
    assert u.fired and "no lean/ directory" in u.evidence
    with pytest.raises(ValueError, match="checked no oracle"):
        f5_oracle_parity(0, [])


# --- all together -----------------------------------------------------------------------


def _measurements(**changes: Any) -> Measurements:
    base: dict[str, Any] = {
        "warm_sessions": (MISS2, HIT2, HIT2),
        "session1_ms": 1000.0,
        "session2_ms": 100.0,
        "cold_tps": 2.0,
        "warm_tps": 7.0,
        "reply_false_hits": 0,
        "stats_false_hits": 0,
        "pisot_hits": 150,
        "lru_hits": 140,
        "trace_accesses": 300,
        "oracle_total": 41,
        "oracle_failures": (),
    }
    base.update(changes)
    return Measurements(**base)


def test_judge_upholds_everything_on_good_numbers() -> None:
    predictions, triggers = judge(_measurements())
    assert list(predictions) == ["p1", "p2", "p3", "p4", "p5"]
    assert list(triggers) == ["f1", "f2", "f3", "f4", "f5"]
    assert all(p.upheld for p in predictions.values())
    assert not any(f.fired for f in triggers.values())
    j = verdicts_json(predictions, triggers)
    assert set(j["p3"]) == {"name", "claim", "value", "threshold", "upheld", "detail"}
    assert set(j["f3"]) == {"name", "claim", "fired", "evidence"}


def test_judge_fires_every_trigger_on_bad_numbers() -> None:
    predictions, triggers = judge(
        _measurements(
            warm_sessions=(MISS2, MISS2),
            session2_ms=900.0,
            warm_tps=2.2,
            reply_false_hits=1,
            pisot_hits=100,
            oracle_failures=("x: wrong",),
        )
    )
    assert not any(p.upheld for p in predictions.values())
    assert all(f.fired for f in triggers.values())


# --- the eviction harness on the real cache ---------------------------------------------


def test_zipf_trace_is_seeded_and_in_range() -> None:
    a = zipf_trace(12, 300, 1.0, seed=3)
    assert a == zipf_trace(12, 300, 1.0, seed=3)
    assert a != zipf_trace(12, 300, 1.0, seed=4)
    assert len(a) == 300 and set(a) <= set(range(12))
    counts = np.bincount(a, minlength=12)
    assert counts.max() > 3 * np.median(counts)  # skewed, not uniform


def test_luminary_tails_keep_direction_with_norm_near_one() -> None:
    rng = np.random.default_rng(0)
    raw = [rng.standard_normal(64).astype(np.float32) * 100 for _ in range(8)]
    lum = luminary_tails(raw, 0.02, seed=1)
    for r, t in zip(raw, lum, strict=True):
        assert abs(float(np.linalg.norm(t)) - 1.0) < 0.1
        cos = float(r @ t) / float(np.linalg.norm(r) * np.linalg.norm(t))
        assert cos == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="zero tail"):
        luminary_tails([np.zeros(4, np.float32)], 0.02, seed=1)


PREFIXES = [[10 + i, 20 + i, 30 + i] for i in range(3)]
KW: dict[str, Any] = {"max_entries": 2, "fingerprint": 7, "kv_heads": 1, "head_dim": 2}


def _tail(norm: float) -> np.ndarray[Any, np.dtype[np.float32]]:
    return np.array([norm, 0.0, 0.0, 0.0], dtype=np.float32)


def test_pisot_keeps_a_unit_norm_entry_that_lru_evicts() -> None:
    # A (drift 0) and B (drift 4) fill the cache; C evicts. LRU drops A (older), Pisot drops
    # B (largest drift × age), so the next access to A hits only under Pisot.
    tails = [_tail(1.0), _tail(5.0), _tail(1.0)]
    trace = [0, 1, 2, 0]
    pisot = replay_trace("pisot", PREFIXES, tails, trace, **KW)
    lru = replay_trace("lru", PREFIXES, tails, trace, **KW)
    assert (pisot.hits, pisot.evictions) == (1, 1)
    assert (lru.hits, lru.evictions) == (0, 2)


def test_pisot_equals_lru_when_every_drift_is_zero() -> None:
    tails = [_tail(1.0)] * 3
    trace = zipf_trace(3, 100, 1.0, seed=0)
    pisot = replay_trace("pisot", PREFIXES, tails, trace, **KW)
    lru = replay_trace("lru", PREFIXES, tails, trace, **KW)
    assert (pisot.hits, pisot.evictions) == (lru.hits, lru.evictions)
    assert pisot.hits + pisot.misses == 100


def test_the_cost_aware_policy_keeps_the_entry_hit_most_where_lru_keeps_the_latest() -> None:
    # A is hit twice, B once but later; C then evicts one of them. LRU drops A (older), the
    # cost-aware policy drops B (one hit against two, same size and cost).
    tails = [_tail(1.0)] * 3
    trace = [0, 1, 0, 0, 1, 2, 0]
    gdsf = replay_trace("gdsf", PREFIXES, tails, trace, **KW)
    lru = replay_trace("lru", PREFIXES, tails, trace, **KW)
    assert (gdsf.hits, lru.hits) == (4, 3)
    assert gdsf.saved_positions == 4 * len(PREFIXES[0])


SMALL_TENANTS = TenantSpec(users=6, accesses=120, seeds=(0,), context=(40, 80), system_len=32)


def test_tenant_traces_are_seeded_shared_and_bounded() -> None:
    trace = tenant_trace(SMALL_TENANTS, 3)
    assert trace == tenant_trace(SMALL_TENANTS, 3)
    assert trace != tenant_trace(SMALL_TENANTS, 4)
    systems = {tuple(p[: SMALL_TENANTS.system_len]) for p in trace}
    assert 1 <= len(systems) <= SMALL_TENANTS.system_prompts
    assert all(len(p) <= SMALL_TENANTS.max_prompt for p in trace)
    # Re-sends repeat a prompt; fresh questions never extend an earlier prompt, while
    # conversations do.
    assert len({tuple(p) for p in trace}) < len(trace)
    no_resend = replace(SMALL_TENANTS, regenerate=0.0)
    assert len({tuple(p) for p in tenant_trace(no_resend, 3)}) == SMALL_TENANTS.accesses

    def extends_earlier(prompts: list[list[int]]) -> bool:
        seen = {tuple(p) for p in prompts}
        return any(tuple(p[:k]) in seen for p in prompts for k in range(1, len(p)))

    assert not extends_earlier(tenant_trace(no_resend, 3))
    chat = replace(CONVERSATIONS, users=6, accesses=120, seeds=(0,), regenerate=0.0)
    assert extends_earlier(tenant_trace(chat, 3))
    for bad in (
        {"users": 0},
        {"context": (5, 4)},
        {"question": (0, 3)},
        {"max_prompt": 100},
        {"follow_up": 1.5},
        {"regenerate": 1.0},
        {"budget_volumes": 0.0},
        {"min_len": 0},
    ):
        with pytest.raises(ValueError):
            replace(SMALL_TENANTS, **bad)


def test_tenant_runs_count_every_request_and_position() -> None:
    prompts = tenant_trace(SMALL_TENANTS, 0)
    positions = sum(len(p) for p in prompts)
    # Room for everything: every re-send is a full hit, every other request after a user's
    # first reuses at least that user's context.
    roomy = replay_tenants("gdsf", prompts, SMALL_TENANTS, max_bytes=1 << 40, seed=0, **KW_TENANT)
    assert roomy.full_hits + roomy.prefix_hits + roomy.misses == len(prompts)
    assert roomy.evictions == 0 and roomy.prompt_positions == positions
    assert roomy.full_hits == len(prompts) - len({tuple(p) for p in prompts})
    assert roomy.hit_rate == roomy.saved_positions / positions
    tight = replay_tenants("lru", prompts, SMALL_TENANTS, max_bytes=20_000, seed=0, **KW_TENANT)
    assert tight.evictions > 0 and tight.saved_positions < roomy.saved_positions
    pooled = compare_on_tenants(SMALL_TENANTS, **KW_TENANT)
    assert pooled["accesses"] == len(prompts) and pooled["prompt_positions"] == positions
    for p in ("pisot", "lru", "gdsf"):
        run = pooled["per_seed"][0][p]
        assert pooled["hits"][p] == run["full_hits"] + run["prefix_hits"]
        assert pooled["hit_rate"][p] == run["saved_positions"] / positions
    assert pooled["saved_prefill_s"] is None


KW_TENANT: dict[str, Any] = {"fingerprint": 7, "kv_heads": 1, "head_dim": 4}


def test_trace_spec_rejects_a_cache_that_never_evicts() -> None:
    with pytest.raises(ValueError, match="more distinct prefixes"):
        TraceSpec(prefixes=4, max_entries=4)
    with pytest.raises(ValueError, match="max_entries"):
        TraceSpec(max_entries=0)


def test_cli_rejects_bad_bench_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--sessions", "1"]) == 2
    assert "--sessions must be at least 2" in capsys.readouterr().err
    assert cli.main(["bench", "--trace-prefixes", "3", "--trace-entries", "3"]) == 2
    assert "more distinct prefixes" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert cli.main(["bench", "--plot", str(tmp_path / "b.png")]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "needs matplotlib" in err and "pip install 'amplituhedron-rs[plot]'" in err
    assert not (tmp_path / "b.png").exists()


# --- one tiny real run, end to end ------------------------------------------------------

TINY = [
    "bench",
    "--tenant-requests",
    "60",
    "--stations",
    "2",
    "--sessions",
    "3",
    "--prompt-tokens",
    "24",
    "--max-tokens",
    "2",
    "--trace-prefixes",
    "5",
    "--trace-entries",
    "2",
    "--trace-accesses",
    "40",
    "--trace-seeds",
    "2",
]

SESSION_KEYS: dict[str, type | tuple[type, ...]] = {
    "session": int,
    "latency_ms": float,
    "replay_ms": float,
    "prefill_ms": float,
    "decode_ms": float,
    "replay_hit": bool,
    "output_ids": list,
    "stations": list,
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench-out")
    argv = [
        *TINY,
        "--json",
        str(out / "bench.json"),
        "--plot",
        str(out / "plots" / "bench.png"),
        "--report",
        str(out / "report.md"),
    ]
    assert cli.main(argv) == 0
    report: dict[str, Any] = json.loads((out / "bench.json").read_text())
    return out, report


def _check_types(obj: Mapping[str, Any], keys: Mapping[str, type | tuple[type, ...]]) -> None:
    for key, kind in keys.items():
        assert key in obj, f"missing {key!r}"
        assert isinstance(obj[key], kind), f"{key!r} is {type(obj[key]).__name__}"


@pytest.mark.model
@pytest.mark.mesh
def test_tiny_run_json_schema(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    _, r = tiny_run
    for regime in ("cold", "warm", "unique"):
        assert len(r[regime]["sessions"]) == 3
        _check_types(r[regime], {"tps": float, "sessions": list, "generated_tokens": int})
        for s in r[regime]["sessions"]:
            _check_types(s, SESSION_KEYS)
            assert len(s["output_ids"]) == 2
            assert all(isinstance(t, int) for t in s["output_ids"])
    _check_types(r, {"uplift": float, "peers": dict, "eviction": dict, "bit_exact": dict})
    _check_types(r["cold"], {"tps": float})
    _check_types(r["warm"], {"tps": float})
    for key in ("p1", "p2", "p3", "p4", "p5"):
        _check_types(r[key], {"value": float, "threshold": float, "upheld": bool})
    for key in ("f1", "f2", "f3", "f4", "f5"):
        _check_types(r[key], {"fired": bool, "evidence": str})
    _check_types(
        r["unique"],
        {
            "false_hits": dict,
            "resident_bytes": int,
            "latency_ratio": float,
            "distinct_prompts": int,
        },
    )
    for name in ("luminary", "raw"):
        t = r["eviction"]["traces"][name]
        _check_types(t, {"accesses": int, "hits": dict, "hit_rate": dict, "per_seed": list})
        assert t["accesses"] == 80
        for seed in t["per_seed"]:
            assert len(seed["accesses"]) == 40
            assert seed["pisot"]["hits"] + seed["pisot"]["misses"] == 40
    _check_types(r["peers"], {"mesh": dict, "single_process": dict, "llamacpp": dict})
    llama = r["peers"]["llamacpp"]
    if llama["installed"]:
        _check_types(
            llama,
            {"cold": dict, "warm": dict, "uplift": float, "state_bytes": int, "threads": int},
        )
        assert llama["threads"] == 2 and llama["state_bytes"] > 0
        assert [len(s["output_ids"]) for s in llama["warm"]["sessions"]] == [2, 2, 2]
    else:
        assert "pip install" in llama["hint"]


@pytest.mark.model
@pytest.mark.mesh
def test_tiny_run_measures_what_it_reports(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    _, r = tiny_run
    cold, warm, unique = r["cold"]["sessions"], r["warm"]["sessions"], r["unique"]["sessions"]
    # The cache-disabled regime never replays; the enabled one misses once, then hits.
    assert not any(s["replay_hit"] for s in cold)
    assert [s["replay_hit"] for s in warm] == [False, True, True]
    assert all(s["prefill_ms"] == 0.0 for s in warm[1:])
    assert all(v["replay"] == "hit" for s in warm[1:] for v in s["stations"])
    assert r["p1"]["upheld"] and r["p1"]["value"] == 2
    # Greedy, same prompt: every session of both regimes gives the same tokens.
    assert r["bit_exact"]["identical"]
    assert all(s["output_ids"] == cold[0]["output_ids"] for s in cold + warm)
    # The verdicts are computed from the raw numbers in the same file.
    assert r["p2"]["value"] == pytest.approx(1 - warm[1]["latency_ms"] / warm[0]["latency_ms"])
    assert r["warm"]["tps"] == pytest.approx(6 / (sum(s["latency_ms"] for s in warm) / 1e3))
    assert r["uplift"] == pytest.approx(r["warm"]["tps"] / r["cold"]["tps"])
    assert r["p3"]["value"] == pytest.approx(r["uplift"])
    assert r["f2"]["fired"] is not r["p2"]["upheld"]
    # Unique prompts: all distinct, all miss, nothing hit.
    assert r["unique"]["distinct_prompts"] == 3
    assert not any(s["replay_hit"] for s in unique)
    assert r["unique"]["false_hits"] == {"replies": 0, "stats": 0}
    assert r["p4"]["upheld"] and not r["f1"]["fired"]
    assert r["unique"]["resident_bytes"] > 0
    # Eviction: the verdict reads the Luminary trace's pooled hit counts.
    lum = r["eviction"]["traces"]["luminary"]
    assert r["p5"]["upheld"] is (lum["hits"]["pisot"] >= lum["hits"]["lru"])
    assert r["f4"]["fired"] is not r["p5"]["upheld"]
    assert all(abs(p["luminary_norm"] - 1) < 0.2 for p in r["eviction"]["prefixes"])
    assert all(p["raw_norm"] > 10 for p in r["eviction"]["prefixes"])
    # The oracle suite ran for real and passed.
    assert r["oracles"]["total"] > 0 and not r["f5"]["fired"]
    # The single-process peer replayed too.
    sp = r["peers"]["single_process"]
    assert sp["installed"] and [s["replay_hit"] for s in sp["warm"]["sessions"]] == [
        False,
        True,
        True,
    ]
    assert sp["same_tokens_as_mesh"]  # one process and the mesh agree token for token


@pytest.mark.model
@pytest.mark.mesh
def test_tiny_run_writes_plot_and_report(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    out, r = tiny_run
    png = (out / "plots" / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    md = (out / "report.md").read_text()
    assert "seed 0" not in md  # users have no design notes: the claims are named instead
    assert "](plots/bench.png)" in md  # relative to the report's folder
    for key in ("p1", "p2", "p3", "p4", "p5"):
        verdict = "upheld" if r[key]["upheld"] else "FALSIFIED"
        assert any(
            line.startswith(f"| {key.upper()} |") and verdict in line for line in md.splitlines()
        )
    for key in ("f1", "f2", "f3", "f4", "f5"):
        fired = "FIRED" if r[key]["fired"] else "not fired"
        assert any(
            line.startswith(f"| {key.upper()} |") and fired in line for line in md.splitlines()
        )
    # Re-rendering the saved JSON without a plot says so instead of linking nothing.
    assert "no plot" in bench_report.markdown(r, out / "again.md", None)
    assert len(bench_report.summary_tables(r)) == 7
    # The seeds' §7 estimate stands beside the measured figures, in the report too.
    assert "seeds' §7 estimate" in md and "| uplift | 3.5× |" in md
    assert r["seed_estimate"]["decode_ms_per_token"] == 280


def test_bench_serve_fails_only_on_our_errors() -> None:
    from amplituhedron_rs.bench.serve import exit_status

    def report(ours: int, peer: int) -> dict[str, object]:
        return {
            "systems": [
                {"name": "amplituhedron", "levels": [{"errors": 0}, {"errors": ours}]},
                {"name": "llama_cpp.server", "levels": [{"errors": peer}]},
                {"name": "llama-server", "levels": [], "note": "not given"},
            ]
        }

    assert exit_status(report(0, 0)) == 0
    assert exit_status(report(0, 15)) == 0
    assert exit_status(report(2, 0)) == 1


def test_bench_serve_rounds_combine_into_medians_and_per_round_ratios() -> None:
    from amplituhedron_rs.bench.serve_results import LevelResult, combine, median_ratio

    def level(tps: float, ttft: float, errors: int = 0) -> LevelResult:
        return LevelResult(
            clients=8,
            requests=16,
            errors=errors,
            wall_s=2.0,
            output_tokens=1000,
            tokens_per_s=tps,
            ttft_p50_ms=ttft,
            ttft_p99_ms=2 * ttft,
            itl_p50_ms=10.0,
            itl_p99_ms=30.0,
            error_messages=["boom"] if errors else [],
        )

    rounds = [level(300.0, 90.0), level(500.0, 70.0, errors=1), level(400.0, 80.0)]
    c = combine(rounds)
    assert (c.tokens_per_s, c.ttft_p50_ms, c.ttft_p99_ms) == (400.0, 80.0, 160.0)
    assert (c.requests, c.errors, c.output_tokens, c.wall_s) == (48, 1, 3000, 6.0)
    assert c.rounds_tokens_per_s == [300.0, 500.0, 400.0]
    assert c.error_messages == ["boom"]
    # A slow round slows both sides of a ratio: the per-round ratios are all 2, although the
    # ratio of the medians (400 / 150) is not.
    ours, one = [300.0, 500.0, 400.0], [150.0, 250.0, 200.0]
    assert median_ratio(ours, one) == 2.0
    assert median_ratio([1.0, 3.0, 2.0], [1.0, 1.0, 1.0]) == 2.0
    assert median_ratio([1.0], [0.0]) is None


def test_bench_serve_reads_the_engine_load_from_metrics() -> None:
    """Our server's engine counters, before and after a level, give its busy fraction, rows
    per step and tokens per busy second; a peer's page without them gives nothing; rounds
    combine into medians of the rounds that have them."""
    from amplituhedron_rs.bench.serve_results import LevelResult, combine, parse_engine_totals

    def page(steps: int, prompt: int, decode: int, busy: float) -> str:
        m = 'model_name="smollm2-135m"'
        return (
            "# HELP amplituhedron:engine_steps_total Batched steps run\n"
            "# TYPE amplituhedron:engine_steps_total counter\n"
            f"amplituhedron:engine_steps_total{{{m}}} {steps}.0\n"
            "# HELP amplituhedron:engine_rows_total Rows computed\n"
            "# TYPE amplituhedron:engine_rows_total counter\n"
            f'amplituhedron:engine_rows_total{{{m},kind="prompt"}} {prompt}.0\n'
            f'amplituhedron:engine_rows_total{{{m},kind="decode"}} {decode}.0\n'
            "# HELP amplituhedron:engine_busy_seconds_total Busy\n"
            "# TYPE amplituhedron:engine_busy_seconds_total counter\n"
            f"amplituhedron:engine_busy_seconds_total{{{m}}} {busy}\n"
        )

    before, after = (
        parse_engine_totals(page(10, 100, 50, 1.5)),
        parse_engine_totals(page(110, 300, 850, 4.5)),
    )
    assert before is not None and after is not None
    load = before.load(after, wall_s=4.0, tokens=900)
    assert (load.busy, load.rows_per_step, load.tokens_per_s) == (0.75, 10.0, 300.0)
    assert parse_engine_totals("# a peer\nprocess_cpu_seconds_total 3.0\n") is None

    def level(busy: float | None) -> LevelResult:
        return LevelResult(8, 16, 0, 2.0, 1000, 500.0, 1.0, 2.0, 3.0, 4.0, engine_busy=busy)

    assert combine([level(0.9), level(None), level(0.7)]).engine_busy == 0.8
    assert combine([level(None)]).engine_busy is None


def test_bench_serve_asks_no_question_twice_in_a_run() -> None:
    """A repeated prompt would be answered whole from the prefix cache (TTFT of one decode
    step): every request of a sweep (warm-up, every round and level) asks something new."""
    from amplituhedron_rs.bench.serve import WARM_UP, level_tag, question

    levels, rounds, requests = [1, 2, 4, 8, 16], 3, 4
    # (tag, clients, requests per client) of every part of the sweep, the warm-up first.
    parts = [(WARM_UP, 1, 1)] + [
        (level_tag(r, c), c, requests) for r in range(rounds) for c in levels
    ]
    asked = [question(tag, k, j) for tag, n, m in parts for k in range(n) for j in range(m)]
    assert len(asked) == 1 + rounds * requests * sum(levels)
    assert len(set(asked)) == len(asked)
    # The same request gets the same question on every system, so they serve alike.
    assert question(level_tag(1, 8), 3, 1) == question(level_tag(1, 8), 3, 1)


def test_bench_serve_percentiles_interpolate_between_ranks() -> None:
    import math

    from amplituhedron_rs.bench.serve_results import percentile

    assert percentile([30.0, 10.0, 20.0], 50) == 20.0
    assert percentile([10.0, 20.0], 50) == 15.0  # not the lower of the two
    assert math.isclose(percentile([10.0, 20.0], 99), 19.9)
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0], 0) == 10.0
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0], 100) == 50.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_bench_serve_counts_a_stream_cut_short_as_an_error() -> None:
    """A streamed reply that ends without a finish_reason (a server that abandoned it) is an
    error, not a served request with a zero time to first token; a whole reply is not."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from amplituhedron_rs.bench.serve import one_request
    from amplituhedron_rs.bench.servers import Server

    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()

    async def scenario() -> list[Any]:
        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            await reply.write(chunk({"role": "assistant"}))
            for word in ("a", "b", "c"):
                await reply.write(chunk({"content": word}))
            if body["messages"][-1]["content"].startswith("#whole"):
                await reply.write(chunk({}, "length"))
            await reply.write(b"data: [DONE]\n\n")
            return reply

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        server = Server("fake", [], port, "m")
        try:
            async with aiohttp.ClientSession() as http:
                return [await one_request(http, server, "sys", q, 3) for q in ("#whole", "#cut")]
        finally:
            server.log.close()
            await runner.cleanup()

    whole, cut = asyncio.run(scenario())
    assert whole.error is None and whole.tokens == 3 and len(whole.gaps_s) == 2
    assert whole.ttft_s > 0
    assert cut.error == "the stream ended without a finish_reason" and cut.tokens == 3
