"""The one sampling rule: greedy exactly when no temperature, top-k or top-p is given, or
when the temperature is 0; any given value samples. The API, the CLI and the mesh all build
their sampler through :class:`SamplingParams`."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import pytest

import amplituhedron_rs as ar
from amplituhedron_rs.cli.common import sampling
from amplituhedron_rs.mesh.protocol import SamplingSpec

# Two near-equal tokens: sampling at temperature 1 picks token 0 about 45 % of the time.
LOGITS = np.array([0.0, 0.2, -30.0], dtype=np.float32)


def draws(params: ar.SamplingParams, seeds: range) -> set[int]:
    out = set()
    for seed in seeds:
        p = ar.SamplingParams(params.temperature, params.top_k, params.top_p, seed)
        out.add(p.sampler().sample(LOGITS, 0))
    return out


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({}, True),
        ({"temperature": 0.0}, True),
        ({"temperature": 0.0, "top_k": 5}, True),
        ({"temperature": 1.0}, False),
        ({"temperature": 0.7}, False),
        ({"top_k": 2}, False),
        ({"top_p": 0.9}, False),
    ],
)
def test_greedy_exactly_when_nothing_is_given_or_temperature_is_zero(
    kwargs: dict[str, Any], greedy: bool
) -> None:
    params = ar.SamplingParams(**kwargs)
    assert params.greedy is greedy
    picked = draws(params, range(40))
    assert picked == ({1} if greedy else {0, 1})


def test_bad_values_are_input_errors() -> None:
    bad: list[dict[str, Any]] = [
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"seed": -1},
        {"seed": 2**64},
    ]
    for kwargs in bad:
        with pytest.raises(ar.InputError):
            ar.SamplingParams(**kwargs)


def _cli(**given: object) -> argparse.Namespace:
    args = {"greedy": False, "temperature": None, "top_k": None, "top_p": None, "seed": 0}
    return argparse.Namespace(**(args | given))


def test_the_cli_and_the_wire_follow_the_same_rule() -> None:
    assert sampling(_cli()).greedy
    assert not sampling(_cli(temperature=1.0)).greedy  # as the API: a given 1.0 samples
    assert sampling(_cli(temperature=0.0)).greedy
    with pytest.raises(SystemExit, match="--greedy cannot be combined"):
        sampling(_cli(greedy=True, temperature=1.0))
    for params in (ar.SamplingParams(), ar.SamplingParams(temperature=1.0, top_k=3, seed=9)):
        wire = SamplingSpec.of(params)
        assert SamplingSpec.model_validate_json(wire.model_dump_json()).params() == params
