"""Peers of the mesh in the falsifiability bench, on the same prompt and token budget.

- The single-process runtime without HTTP: :meth:`Model.generate` with the cache off (cold)
  and on (session 1 captures, sessions 2..N replay).
- llama.cpp (``llama-cpp-python``, optional) on the same GGUF with 2 threads: cold prefill +
  decode every session, against its own prompt-state reuse — session 1 prefills and saves
  the sequence state (``llama_state_seq_get_data``) plus the last position's logits, sessions
  2..N restore it (``llama_state_seq_set_data``) and decode. Keeping the logits mirrors the
  exit station keeping them in its volume: neither side re-runs the last prompt position.

Every session is timed wall-clock around the whole call; TPS is generated tokens over the
summed session latency, as for the mesh.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from amplituhedron_rs.bench_model import _clear_llama_memory
from amplituhedron_rs.bench_verdicts import amortized_tps, uplift
from amplituhedron_rs.model import Model

LLAMACPP_HINT = "pip install 'amplituhedron-rs[peers]' (llama-cpp-python; compiles llama.cpp)"
Step = Callable[[str], None]


def _regime(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    generated = sum(len(s["output_ids"]) for s in sessions)
    return {
        "sessions": sessions,
        "generated_tokens": generated,
        "total_latency_ms": sum(s["latency_ms"] for s in sessions),
        "tps": amortized_tps(generated, [s["latency_ms"] for s in sessions]),
    }


def _with_uplift(cold: dict[str, Any], warm: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "installed": True,
        **extra,
        "cold": cold,
        "warm": warm,
        "uplift": uplift(cold["tps"], warm["tps"]),
    }


def measure_single_process(
    model: Model, prompt: Sequence[int], sessions: int, new_tokens: int, step: Step
) -> dict[str, Any]:
    """``Model.generate`` cold (cache off) vs warm (cache on) over ``sessions`` sessions."""

    def run(use_cache: bool) -> list[dict[str, Any]]:
        out = []
        for i in range(sessions):
            t0 = time.perf_counter()
            g = model.generate(prompt, new_tokens, use_cache=use_cache, stop_at_eos=False)
            ms = (time.perf_counter() - t0) * 1e3
            out.append(
                {
                    "latency_ms": ms,
                    "prefill_ms": g.prefill_ms,
                    "decode_ms": g.decode_ms,
                    "replay_hit": g.cache_hit,
                    "output_ids": g.output_ids,
                }
            )
            step(f"{'warm' if use_cache else 'cold'} s{i + 1}: {ms:.0f} ms")
        return out

    model.clear_cache()
    cold = _regime(run(False))
    model.clear_cache()
    warm = _regime(run(True))
    model.clear_cache()
    return _with_uplift(cold, warm)


def llamacpp_available() -> bool:
    """Whether ``llama_cpp`` imports."""
    return importlib.util.find_spec("llama_cpp") is not None


def measure_llamacpp(
    model_path: str,
    prompt: Sequence[int],
    sessions: int,
    new_tokens: int,
    step: Step,
    *,
    threads: int = 2,
) -> dict[str, Any]:
    """llama.cpp cold vs its sequence-state restore; ``{"installed": False, …}`` if absent."""
    try:
        # Typed as Any: the bindings are only partly annotated, and mypy must pass with or
        # without them installed.
        llama_cpp: Any = importlib.import_module("llama_cpp")
    except ImportError:
        return {"installed": False, "hint": LLAMACPP_HINT}
    except OSError as exc:  # installed, but its shared library does not load
        return {"installed": False, "hint": f"llama_cpp does not load ({exc}); {LLAMACPP_HINT}"}
    prompt = [int(t) for t in prompt]
    n = len(prompt)
    llm = llama_cpp.Llama(
        model_path=model_path,
        n_ctx=max(2048, n + new_tokens + 16),
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    ctx = llm.ctx

    def fresh() -> None:
        llm.reset()
        _clear_llama_memory(llama_cpp, ctx)

    vocab = int(llm.n_vocab())

    def last_logits() -> np.ndarray[Any, Any]:
        # Read from the context: llama-cpp-python >= 0.3 no longer copies logits into
        # `llm.scores` unless logits_all=True (its rows stay zero).
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(vocab,)).copy()

    def decode(first_logits: np.ndarray[Any, Any]) -> list[int]:
        token = int(np.argmax(first_logits))
        out = [token]
        while len(out) < new_tokens:
            llm.eval([token])
            token = int(np.argmax(last_logits()))
            out.append(token)
        return out

    def prefill() -> np.ndarray[Any, Any]:
        llm.eval(prompt)
        return last_logits()

    def session(kind: str, i: int, body: Callable[[], list[int]]) -> dict[str, Any]:
        fresh()
        t0 = time.perf_counter()
        out = body()
        ms = (time.perf_counter() - t0) * 1e3
        step(f"{kind} s{i + 1}: {ms:.0f} ms")
        return {"latency_ms": ms, "output_ids": out}

    cold = [session("cold", i, lambda: decode(prefill())) for i in range(sessions)]

    saved: dict[str, Any] = {}

    def first() -> list[int]:
        logits = prefill()
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        saved["nbytes"] = int(llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0))
        saved["state"], saved["logits"] = buf, logits
        return decode(logits)

    def restored() -> list[int]:
        t0 = time.perf_counter()
        got = llama_cpp.llama_state_seq_set_data(ctx, saved["state"], saved["nbytes"], 0)
        if got == 0:
            raise RuntimeError("llama.cpp refused to restore its own sequence state")
        saved.setdefault("restore_ms", []).append((time.perf_counter() - t0) * 1e3)
        # The high-level wrapper tracks positions itself: tell it the prompt is in the KV.
        llm.n_tokens = n
        llm.input_ids[:n] = prompt
        return decode(saved["logits"])

    warm = [session("state", 0, first)]
    warm += [session("state", i, restored) for i in range(1, sessions)]
    return _with_uplift(
        _regime(cold),
        _regime(warm),
        version=getattr(llama_cpp, "__version__", "?"),
        threads=threads,
        state_bytes=saved["nbytes"],
        restore_ms=saved.get("restore_ms", []),
    )
