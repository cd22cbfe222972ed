"""The single-process runtime: GGUF reading, tokenizer, sampling rule, options, and the
:class:`Model` that generates with the volume cache. Depends on nothing else in the package
but the core (``_core``)."""

from amplituhedron_rs.runtime.model import Generation, Model, load_model
from amplituhedron_rs.runtime.options import BatchOptions, CacheOptions, SessionOptions
from amplituhedron_rs.runtime.sampling import SamplingParams

__all__ = [
    "BatchOptions",
    "CacheOptions",
    "Generation",
    "Model",
    "SamplingParams",
    "SessionOptions",
    "load_model",
]
