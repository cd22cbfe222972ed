"""amplituhedron-rs: a prefix-cached, pipeline-parallel LLM inference runtime.

>>> import amplituhedron_rs as ar
>>> m = ar.load_model()                       # the bundled SmolLM2-135M-Instruct
>>> g = m.generate(m.chat_ids("You are terse.", "Name a planet."), 8)

This module is the public API: the runtime (:func:`load_model`, :class:`Model`), the core's
cache, ring and attention types, the mesh client, and the exceptions. The parts live in
subpackages, each with one job: :mod:`.runtime` (one process), :mod:`.mesh` (stations,
coordinator, launcher), :mod:`.serve` (the OpenAI-compatible server),
:mod:`.bench` (benches) and :mod:`.oracle` (the Lean oracles' kernel and parity); the
``amplituhedron`` command (:mod:`.cli`) sits on top. Importing this module loads no HTTP
stack: the mesh types are imported on first use.
"""

from typing import TYPE_CHECKING, Any

from amplituhedron_rs import oracle
from amplituhedron_rs._core import (
    AmplituhedronCache,
    AmplituhedronError,
    AmplituhedronVolume,
    CacheError,
    InputError,
    MeshError,
    ModelError,
    QueueFullError,
    RingBuffer,
    RingError,
    SemanticSpan,
    SpanType,
    TokenLogprobs,
    __version__,
    attend,
    prefix_hash,
)
from amplituhedron_rs.runtime import (
    BatchOptions,
    CacheOptions,
    Generation,
    Model,
    SamplingParams,
    SessionOptions,
    load_model,
)
from amplituhedron_rs.runtime.synthetic import synthetic_model

if TYPE_CHECKING:
    from amplituhedron_rs.mesh.coordinator import Coordinator
    from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec

#: Mesh types, imported on first access: the coordinator needs aiohttp.
_LAZY = {
    "Coordinator": "amplituhedron_rs.mesh.coordinator",
    "LocalMesh": "amplituhedron_rs.mesh.launcher",
    "MeshSpec": "amplituhedron_rs.mesh.launcher",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AmplituhedronCache",
    "AmplituhedronError",
    "AmplituhedronVolume",
    "BatchOptions",
    "CacheError",
    "CacheOptions",
    "Coordinator",
    "Generation",
    "InputError",
    "LocalMesh",
    "MeshError",
    "MeshSpec",
    "Model",
    "ModelError",
    "QueueFullError",
    "RingBuffer",
    "RingError",
    "SamplingParams",
    "SemanticSpan",
    "SessionOptions",
    "SpanType",
    "TokenLogprobs",
    "__version__",
    "attend",
    "load_model",
    "oracle",
    "prefix_hash",
    "synthetic_model",
]
