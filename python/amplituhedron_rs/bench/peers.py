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

from amplituhedron_rs.bench.verdicts import amortized_tps, uplift
from amplituhedron_rs.runtime import Model

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


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on a GGUF: prefill, one-token steps, sequence state.

    Logits are read from the context (`llama_get_logits_ith`): llama-cpp-python >= 0.3 no
    longer copies them into `Llama.scores` unless `logits_all=True`.
    """

    def __init__(self, llama_cpp: Any, model_path: str, *, n_ctx: int, threads: int) -> None:
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=model_path,
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.ctx = self.llm.ctx
        self.vocab = int(self.llm.n_vocab())
        self.version = str(getattr(llama_cpp, "__version__", "?"))

    @classmethod
    def load(cls, model_path: str, *, n_ctx: int = 2048, threads: int = 2) -> LlamaCpp | str:
        """The peer, or why it is unavailable (an install hint)."""
        try:
            # Typed as Any: the bindings are only partly annotated, and mypy must pass with
            # or without them installed.
            llama_cpp: Any = importlib.import_module("llama_cpp")
        except ImportError:
            return LLAMACPP_HINT
        except OSError as exc:  # installed, but its shared library does not load
            return f"llama_cpp does not load ({exc}); {LLAMACPP_HINT}"
        return cls(llama_cpp, model_path, n_ctx=n_ctx, threads=threads)

    def fresh(self) -> None:
        """Forgets every position (empty KV)."""
        self.llm.reset()
        lib, ctx = self.lib, self.ctx
        if hasattr(lib, "llama_get_memory"):
            lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        elif hasattr(lib, "llama_kv_self_clear"):
            lib.llama_kv_self_clear(ctx)
        else:  # pragma: no cover - very old bindings
            lib.llama_kv_cache_clear(ctx)

    def last_logits(self) -> np.ndarray[Any, Any]:
        ptr = self.lib.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,)).copy()

    def prefill(self, tokens: Sequence[int]) -> np.ndarray[Any, Any]:
        """Runs ``tokens``; the last position's logits."""
        self.llm.eval(list(tokens))
        return self.last_logits()

    def greedy(self, first_logits: np.ndarray[Any, Any], new_tokens: int) -> list[int]:
        """Greedy decode of ``new_tokens`` starting from ``first_logits``."""
        token = int(np.argmax(first_logits))
        out = [token]
        while len(out) < new_tokens:
            self.llm.eval([token])
            token = int(np.argmax(self.last_logits()))
            out.append(token)
        return out

    def save_state(self) -> tuple[Any, int]:
        """`llama_state_seq_get_data` of sequence 0: (buffer, bytes)."""
        size = self.lib.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        return buf, int(self.lib.llama_state_seq_get_data(self.ctx, buf, size, 0))

    def restore_state(self, state: tuple[Any, int], tokens: Sequence[int]) -> None:
        """`llama_state_seq_set_data` of sequence 0, after which ``tokens`` are in the KV."""
        buf, nbytes = state
        if self.lib.llama_state_seq_set_data(self.ctx, buf, nbytes, 0) == 0:
            raise RuntimeError("llama.cpp refused to restore its own sequence state")
        # The high-level wrapper tracks positions itself: tell it the prompt is in the KV.
        n = len(tokens)
        self.llm.n_tokens = n
        self.llm.input_ids[:n] = list(tokens)


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
    prompt = [int(t) for t in prompt]
    peer = LlamaCpp.load(
        model_path, n_ctx=max(2048, len(prompt) + new_tokens + 16), threads=threads
    )
    if isinstance(peer, str):
        return {"installed": False, "hint": peer}

    def session(kind: str, i: int, body: Callable[[], list[int]]) -> dict[str, Any]:
        peer.fresh()
        t0 = time.perf_counter()
        out = body()
        ms = (time.perf_counter() - t0) * 1e3
        step(f"{kind} s{i + 1}: {ms:.0f} ms")
        return {"latency_ms": ms, "output_ids": out}

    cold = [
        session("cold", i, lambda: peer.greedy(peer.prefill(prompt), new_tokens))
        for i in range(sessions)
    ]
    saved: dict[str, Any] = {}

    def first() -> list[int]:
        logits = peer.prefill(prompt)
        saved["state"], saved["logits"] = peer.save_state(), logits
        return peer.greedy(logits, new_tokens)

    def restored() -> list[int]:
        t0 = time.perf_counter()
        peer.restore_state(saved["state"], prompt)
        saved.setdefault("restore_ms", []).append((time.perf_counter() - t0) * 1e3)
        return peer.greedy(saved["logits"], new_tokens)

    warm = [session("state", 0, first)]
    warm += [session("state", i, restored) for i in range(1, sessions)]
    return _with_uplift(
        _regime(cold),
        _regime(warm),
        version=peer.version,
        threads=threads,
        state_bytes=saved["state"][1],
        restore_ms=saved.get("restore_ms", []),
    )
