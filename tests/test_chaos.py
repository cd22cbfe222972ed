"""The chaos test, short (SPEC §13; ``amplituhedron bench-chaos`` is the full run): 2 layer
ranges × 2 replicas, a station SIGKILLed every 0.3–0.6 s (never the last live replica of its
range) and restarted on its port, while 32 greedy and seeded sessions run through one
coordinator. Every session completes, with exactly the single-process engine's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from amplituhedron_rs import Model, cli
from amplituhedron_rs.bench.chaos import chaos_requests, chaos_run, reference_outputs

pytestmark = [pytest.mark.model, pytest.mark.mesh]


def test_chaos_zero_wrong_tokens_every_session_completes(model: Model) -> None:
    # Long enough for several kills however fast the mesh runs: a kill waits for the last
    # one's restart (≈ 1 s a cycle); 24 sessions of 32 tokens once saw only two.
    requests = chaos_requests(model.tokenize, 32, new_tokens=48, seed=1)
    references = reference_outputs(model, requests)
    report = chaos_run(
        None,
        requests,
        references,
        every=(0.3, 0.6),
        down=(0.2, 0.5),
        concurrency=4,
        seed=1,
    )
    assert report["errors"] == []
    assert report["completed"] == report["sessions"] == len(requests)
    assert report["wrong_tokens"] == 0
    assert report["identical"] == len(requests)
    assert report["kills"] >= 3, report
    assert report["failovers"] >= 1, report


def test_bench_chaos_command_reports_a_tiny_run(tmp_path: Path) -> None:
    """``amplituhedron bench-chaos`` end to end, tiny: the table's figures land in the JSON."""
    out = tmp_path / "chaos.json"
    argv = ["bench-chaos", "--sessions", "4", "--max-tokens", "6", "--concurrency", "2"]
    argv += ["--every", "0.3", "0.6", "--json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["sessions"] == report["completed"] == report["identical"] == 4
    assert report["wrong_tokens"] == 0
    for key in ("kills", "failovers", "rebuilt_sequences", "added_ms_mean", "added_ms_p50"):
        assert key in report
