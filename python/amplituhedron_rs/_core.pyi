"""Type stubs for the native module, checked against the build by mypy.stubtest.

Sections are kept per core module (errors, defaults, volume, oracle, ring, model, quant) so
they stay easy to find. Constructor defaults shown as ``...`` are the core's own (see
:data:`DEFAULTS`).
"""

import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, SupportsIndex, TypeAlias, TypedDict, final

import numpy as np
from numpy.typing import NDArray

__version__: str

# --- errors ------------------------------------------------------------------------------

class AmplituhedronError(Exception):
    """Base class of every error amplituhedron-rs raises."""

class InputError(AmplituhedronError, ValueError):
    """The arguments are wrong whatever the state: a bad shape, length, dtype, value or
    setting. Also a ValueError."""

class CacheError(AmplituhedronError):
    """The volume cache refused an operation on what the pipeline gathered, or failed."""

class RingError(AmplituhedronError):
    """A session's KV ring refused the operation in its current state."""

class ModelError(AmplituhedronError):
    """The model cannot be loaded (an unreadable file, a bad config or bad tensors) or a run
    of it failed."""

class MeshError(AmplituhedronError):
    """A mesh that cannot be used: a bad mesh file, or stations unreachable, failing or
    inconsistent."""

class QueueFullError(AmplituhedronError, RuntimeError):
    """The engine's waiting queue is full: nothing was queued; retry later. Also a
    RuntimeError."""

# --- defaults ----------------------------------------------------------------------------

@final
class Defaults:
    """The core's defaults: volume cache (``CacheConfig``), longest-prefix replay threshold,
    and a session's ring (``SessionConfig``)."""

    @property
    def max_entries(self) -> int: ...
    @property
    def max_prefix_len(self) -> int: ...
    @property
    def max_bytes(self) -> int | None: ...
    @property
    def policy(self) -> _Policy: ...
    @property
    def min_prefix_reuse(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def recall(self) -> int: ...
    @property
    def n_sys(self) -> int: ...
    @property
    def max_chunk(self) -> int: ...
    @property
    def kv_dtype(self) -> Literal["f16", "f32"]: ...

DEFAULTS: Defaults

# --- volume cache, eviction, memo --------------------------------------------------------

# Token ids: a sequence of ints or a 1-D integer array; every id must fit u32.
_Tokens: TypeAlias = Sequence[SupportsIndex] | NDArray[np.integer[Any]]

# Eviction policies: Pisot-guard, least recently used, cost-aware (GreedyDual-Size-Frequency).
_Policy: TypeAlias = Literal["pisot", "lru", "gdsf"]

@final
class AmplituhedronVolume:
    """One cached prefix volume. Immutable; its arrays are read-only views (the KV views of
    one slab each, assembled from the cache's shared blocks on first access)."""

    @property
    def model_fingerprint(self) -> int: ...
    @property
    def prefix_hash(self) -> int: ...
    @property
    def layer_lo(self) -> int: ...
    @property
    def layer_hi(self) -> int: ...
    @property
    def prefix_len(self) -> int: ...
    @property
    def kv_len(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def kv_dtype(self) -> Literal["f16", "f32"]: ...
    @property
    def drift(self) -> float: ...
    @property
    def salted(self) -> bool: ...
    @property
    def tokens(self) -> NDArray[np.uint32]: ...
    @property
    def tail(self) -> NDArray[np.float32] | None: ...
    @property
    def logits(self) -> NDArray[np.float32] | None: ...
    @property
    def kv_keys(self) -> NDArray[np.float32]: ...
    @property
    def kv_vals(self) -> NDArray[np.float32]: ...
    def first_non_finite_position(self) -> int | None: ...

@final
class AmplituhedronCache:
    """A station's bounded cache of prefix volumes."""

    def __new__(
        cls,
        max_entries: int = ...,
        max_prefix_len: int = ...,
        max_bytes: int | None = None,
        policy: _Policy | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        max_disk_bytes: int | None = None,
    ) -> AmplituhedronCache: ...
    def capture(
        self,
        fingerprint: int,
        tokens: _Tokens,
        layer_lo: int,
        layer_hi: int,
        tail: NDArray[np.float32],
        kv_keys: NDArray[np.float32],
        kv_vals: NDArray[np.float32],
        logits: NDArray[np.float32] | None = None,
        salt: str | None = None,
    ) -> int: ...
    def replay(
        self,
        fingerprint: int,
        tokens: _Tokens,
        layer_lo: int,
        layer_hi: int,
        salt: str | None = None,
    ) -> AmplituhedronVolume | None: ...
    def replay_longest(
        self,
        fingerprint: int,
        tokens: _Tokens,
        layer_lo: int,
        layer_hi: int,
        salt: str | None = None,
        min_len: int = 16,
    ) -> tuple[AmplituhedronVolume, int] | None: ...
    def tail(self, prefix_hash: int) -> NDArray[np.float32] | None: ...
    def report_damage(
        self,
        fingerprint: int,
        tokens: _Tokens,
        layer_lo: int,
        layer_hi: int,
        position: int,
        salt: str | None = None,
    ) -> Literal["trimmed", "cleared", "absent"]: ...
    def stats(self) -> dict[str, int]: ...
    def flush(self) -> None: ...
    def enable(self, on: bool) -> None: ...
    def set_max_entries(self, n: int) -> None: ...
    def set_max_prefix_len(self, n: int) -> None: ...
    def set_max_bytes(self, n: int | None) -> None: ...
    def clear(self) -> None: ...
    @property
    def enabled(self) -> bool: ...
    @property
    def max_entries(self) -> int: ...
    @property
    def max_prefix_len(self) -> int: ...
    @property
    def max_bytes(self) -> int | None: ...
    @property
    def policy(self) -> _Policy: ...
    @property
    def cache_dir(self) -> pathlib.Path | None: ...
    @property
    def max_disk_bytes(self) -> int | None: ...
    def __len__(self) -> int: ...

@final
class MatVecMemo:
    """Exact-match memo of y = W·x keyed by (weight id, BLAKE3 of x). Off by default."""

    def __new__(
        cls,
        max_entries: int = ...,
        max_bytes: int | None = None,
        policy: _Policy = ...,
    ) -> MatVecMemo: ...
    def get(self, weight_id: int, x: NDArray[np.float32]) -> NDArray[np.float32] | None: ...
    def insert(self, weight_id: int, x: NDArray[np.float32], y: NDArray[np.float32]) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def enable(self, on: bool) -> None: ...
    def clear(self) -> None: ...
    def set_max_entries(self, n: int) -> None: ...
    def set_max_bytes(self, n: int | None) -> None: ...
    @property
    def enabled(self) -> bool: ...
    @property
    def policy(self) -> _Policy: ...
    def __len__(self) -> int: ...

def prefix_hash(tokens: _Tokens) -> int: ...

# --- oracle kernel -----------------------------------------------------------------------

# Exact integer/rational counterparts of the Lean oracles (lean/Gnosis). Matrices are
# sequences of rows; points of P² are integer triples; rationals are reduced (num, den) with
# den > 0. Semantic errors and wrong row lengths raise InputError (a ValueError); non-integers
# raise TypeError and integers outside the kernel's range (i64 entries, u64 sizes)
# OverflowError. The package exposes them without the prefix as amplituhedron_rs.oracle.

ORACLE_CLINAMEN_SWERVE: int

def lean_modules() -> dict[str, str]:
    """The Lean oracle modules built into the extension: ``{path under lean/: text}``."""

def oracle_plucker_coordinates(m: Sequence[Sequence[int]]) -> list[int]: ...
def oracle_totally_positive(m: Sequence[Sequence[int]]) -> bool: ...
def oracle_totally_nonnegative(m: Sequence[Sequence[int]]) -> bool: ...
def oracle_zero_minor_count(m: Sequence[Sequence[int]]) -> int: ...
def oracle_boundary_profile(m: Sequence[Sequence[int]]) -> tuple[bool, bool, int]: ...
def oracle_plucker_residual(m: Sequence[Sequence[int]]) -> int: ...
def oracle_bracket(a: Sequence[int], b: Sequence[int], c: Sequence[int]) -> int: ...
def oracle_moment_curve(nodes: Sequence[int]) -> list[tuple[int, int, int]]: ...
def oracle_maximal_minors(z: Sequence[Sequence[int]]) -> list[int]: ...
def oracle_vertex_count(z: Sequence[Sequence[int]]) -> int: ...
def oracle_y_of(c: Sequence[int], z: Sequence[Sequence[int]]) -> tuple[int, int, int]: ...
def oracle_canonical_form(z: Sequence[Sequence[int]], y: Sequence[int]) -> tuple[int, int]: ...
def oracle_fan_form(
    z: Sequence[Sequence[int]], vertex: int, y: Sequence[int]
) -> tuple[int, int]: ...
def oracle_admits_volume(prefix_len: int) -> bool: ...
def oracle_fib(n: int) -> int | None: ...
def oracle_fib_u128(n: int) -> int | None: ...
def oracle_execution_volume(n: int) -> int | None: ...
def oracle_topological_erasure(volume: int) -> int: ...
def oracle_trim_trailing(xs: Sequence[int]) -> list[int]: ...
def oracle_grassmannian_volume(prompt_len: int, num_layers: int) -> int: ...
def oracle_well_formed_prefix(prompt_len: int, num_layers: int) -> bool: ...
def oracle_key_tags() -> tuple[int, int]: ...
def oracle_encode_memo_key(input_hash: int) -> list[int]: ...
def oracle_encode_volume_key(
    model_fingerprint: int, prefix_hash: int, layer_lo: int, layer_hi: int
) -> list[int]: ...

# --- ring buffer and attention -----------------------------------------------------------

@final
class SpanType:
    """What a run of positions is, semantically (pruning evicts whole spans)."""

    SYSTEM: ClassVar[SpanType]
    USER: ClassVar[SpanType]
    THOUGHT: ClassVar[SpanType]
    TOOL_CALL: ClassVar[SpanType]
    TOOL_RESULT: ClassVar[SpanType]
    RESPONSE_SENTENCE: ClassVar[SpanType]
    TURN_END: ClassVar[SpanType]
    def __int__(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class SemanticSpan:
    """A run of positions ``[start_clock, end_clock)`` of one span type."""

    @property
    def span_type(self) -> SpanType: ...
    @property
    def start_clock(self) -> int: ...
    @property
    def end_clock(self) -> int: ...
    @property
    def start_slot(self) -> int: ...
    @property
    def slot_count(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...

@final
class RingBuffer:
    """Fixed-size KV ring: anchors, a wrapping FIFO window, recall slots, spans, rollback.

    Slabs (``append``, ``splice``, ``inject_recall``, ``read_logical``) use the volume layout
    ``(n_layers, kv_heads, n, head_dim)`` float32; an f16 ring (the default) rounds values on
    the way in (saturating at ±65504) and widens them exactly on the way out. Bad arguments
    raise InputError (a ValueError), operations the ring's state refuses RingError; either
    changes nothing.
    """

    def __new__(
        cls,
        n_layers: int,
        kv_heads: int,
        head_dim: int,
        slots: int = ...,
        recall: int = ...,
        n_sys: int = ...,
        max_chunk: int | None = None,
        undo_capacity: int = ...,
        kv_dtype: Literal["f16", "f32"] = ...,
    ) -> RingBuffer: ...
    @property
    def kv_dtype(self) -> Literal["f16", "f32"]: ...
    @property
    def clock(self) -> int: ...
    @property
    def n_sys(self) -> int: ...
    @property
    def window_end(self) -> int: ...
    @property
    def window_len(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def recall_count(self) -> int: ...
    def physical_slot(self, clock: int) -> int: ...
    def cache_pos(self, clock: int) -> int: ...
    def active_slots(self) -> NDArray[np.uint32]: ...
    def fixed_slots(self) -> NDArray[np.uint32]: ...
    def window_slots(self) -> NDArray[np.uint32]: ...
    def spans(self) -> list[SemanticSpan]: ...
    def append(
        self,
        keys: NDArray[np.float32],
        vals: NDArray[np.float32],
        span: SpanType = ...,
        new_span: bool = True,
    ) -> None: ...
    def splice(
        self,
        keys: NDArray[np.float32],
        vals: NDArray[np.float32],
        span: SpanType = ...,
        checked: bool = True,
    ) -> None: ...
    def rollback_clock(self, saved: int) -> None: ...
    def inject_recall(self, keys: NDArray[np.float32], vals: NDArray[np.float32]) -> None: ...
    def clear_recall(self) -> None: ...
    def prune_oldest_spans(self, min_tokens: int) -> int: ...
    def layer_keys(self, layer: int) -> NDArray[np.float32]: ...
    def layer_vals(self, layer: int) -> NDArray[np.float32]: ...
    def read_logical(
        self, n: int, layer_lo: int = 0, layer_hi: int | None = None
    ) -> tuple[NDArray[np.float32], NDArray[np.float32]]: ...

def attend(
    q: NDArray[np.float32],
    keys: NDArray[np.float32],
    vals: NDArray[np.float32],
    active_slots: NDArray[np.integer[Any]] | Sequence[int],
    n_kv_heads: int,
) -> NDArray[np.float32]:
    """One query row ``(n_q_heads, head_dim)`` over ``active_slots`` rows of
    ``keys``/``vals`` ``(slots, n_kv_heads, head_dim)``; scale ``1/sqrt(head_dim)``."""

# --- model runtime -----------------------------------------------------------------------

# The model runtime: memory-mapped GGUF weights, one session per layer range (the unit a
# station runs), a pipeline = layer range + volume cache with the design's amplituhedron_*
# calls.

_Logits: TypeAlias = Literal["none", "last", "all"]
_Forwarded: TypeAlias = tuple[NDArray[np.float32], NDArray[np.float32] | None]

def supported_architectures() -> list[str]: ...
def supported_tensor_types() -> list[str]: ...
def tensor_digests(
    path: str | os.PathLike[str], tensors: Sequence[tuple[str, int, Sequence[int], int]]
) -> list[bytes]: ...

class _WeightsMemory(TypedDict):
    held: int
    copied: int
    mapped: int | None
    resident: int

@final
class ModelWeights:
    """Memory-mapped GGUF weights of a model of a supported architecture, validated at load:
    every layer, or with ``layers=(lo, hi)`` only that range's tensors (a station's)."""

    def __new__(
        cls,
        path: str,
        config: dict[str, Any],
        tensors: Sequence[tuple[str, int, Sequence[int], int]],
        precision: Literal["refined", "fast"] = "refined",
        kv_dtype: Literal["f16", "f32"] = ...,
        *,
        layers: tuple[int, int] | None = None,
        digests: Sequence[bytes] | None = None,
    ) -> ModelWeights: ...
    @property
    def layers_held(self) -> tuple[int, int]: ...
    def memory(self) -> _WeightsMemory: ...
    @property
    def fingerprint(self) -> int: ...
    @property
    def precision(self) -> Literal["refined", "fast"]: ...
    @property
    def kv_dtype(self) -> Literal["f16", "f32"]: ...
    @property
    def kv_value_bytes(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def context_len(self) -> int: ...

@final
class ReadProbe:
    """The host's read bandwidth as the runtime's workers see it (a buffer larger than the
    caches, folded by every worker of the pool): the floor of a memory-bound decode step."""

    def __new__(cls, bytes: int = ...) -> ReadProbe: ...
    @property
    def bytes(self) -> int: ...
    def measure(self, passes: int = 3) -> float: ...

@final
class RangeSession:
    """One session's ring buffer and work buffers for the layers [layer_lo, layer_hi)."""

    def __new__(
        cls,
        weights: ModelWeights,
        layer_lo: int,
        layer_hi: int,
        slots: int = ...,
        recall: int = ...,
        n_sys: int = ...,
        max_chunk: int = ...,
    ) -> RangeSession: ...
    @property
    def clock(self) -> int: ...
    @property
    def kv_slots(self) -> list[int]: ...
    @property
    def layer_lo(self) -> int: ...
    @property
    def layer_hi(self) -> int: ...
    @property
    def is_entry(self) -> bool: ...
    @property
    def is_exit(self) -> bool: ...
    def forward_tokens(
        self, tokens: Sequence[int], logits: _Logits = "last", span: SpanType = ...
    ) -> _Forwarded: ...
    def forward_hidden(
        self, hidden: NDArray[np.float32], logits: _Logits = "none", span: SpanType = ...
    ) -> _Forwarded: ...
    def rollback(self, clock: int) -> None: ...
    def reset(self) -> None: ...

@final
class RingLock:
    """A session's lock, shared with the step stream: ``threading.Lock``'s interface; a wait
    releases the GIL."""

    def __new__(cls) -> RingLock: ...
    def acquire(self, blocking: bool = True, timeout: float = ...) -> bool: ...
    def release(self) -> None: ...
    def locked(self) -> bool: ...
    def __enter__(self) -> bool: ...
    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool: ...

@final
class StepStream:
    """A station's step stream: Rust threads read the frames; decode steps and prompt
    pieces (before the last) of registered sessions run without Python (at the exit, decode
    sampled with each session's own sampler), every other frame goes to
    ``handler(head, payload, received) -> (status, header, payload)``."""

    def __new__(
        cls,
        weights: ModelWeights,
        layer_lo: int,
        layer_hi: int,
        host: str,
        port: int,
        *,
        token: bytes | None,
        handler: Callable[[bytes, bytes, float], tuple[int, bytes, bytes]],
        max_rows: int,
        max_logits_rows: int,
        max_json_bytes: int,
        max_octet_bytes: int,
        max_connections: int,
        keepalive_s: float,
        header_timeout_s: float,
        body_timeout_s: float,
        fast: bool = True,
    ) -> StepStream: ...
    @property
    def port(self) -> int: ...
    def register(
        self,
        sid: str,
        session: RangeSession,
        lock: RingLock,
        prompt: Sequence[int],
        sampler: Sampler | None = None,
    ) -> None: ...
    def set_max_prefix_len(self, n: int) -> None: ...
    def unregister(self, sid: str) -> bool: ...
    def last_used(self, sid: str) -> float | None: ...
    @property
    def sessions(self) -> int: ...
    @property
    def fast_rows(self) -> int: ...
    @property
    def fast_steps(self) -> int: ...
    @property
    def connections(self) -> int: ...
    def take_observations(self) -> list[tuple[float, int]]: ...
    def release_buffers(self) -> bool: ...
    def close(self) -> None: ...

@final
class StepChain:
    """The coordinator's end of the step stream for whole chains: pooled connections;
    ``run`` sends one step through every station in order without the GIL."""

    def __new__(cls) -> StepChain: ...
    def run(
        self,
        stations: Sequence[tuple[str, int]],
        token: bytes,
        heads: Sequence[bytes],
        payload: bytes,
        entries: int,
        timeout: float,
    ) -> tuple[
        tuple[list[tuple[bytes, float, float]], bytes] | None,
        tuple[int, int | None, bool, str] | None,
    ]: ...
    def forget(self, host: str, port: int) -> None: ...
    def close(self) -> None: ...

@final
class Sampler:
    """Greedy, or temperature with top-k / top-p, seeded."""

    def __new__(
        cls,
        greedy: bool = ...,
        temperature: float = ...,
        top_k: int = ...,
        top_p: float = ...,
        seed: int = ...,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Sequence[tuple[int, float]] = ...,
        min_tokens: int = 0,
        min_tokens_banned: Sequence[int] = ...,
    ) -> Sampler: ...
    def begin(self, prompt: Sequence[int]) -> None: ...
    def observe(self, start: int, tokens: Sequence[int]) -> None: ...
    def sample(
        self, logits: NDArray[np.float32], index: int, grammar: GrammarState | None = None
    ) -> int: ...
    def verify(
        self,
        rows: NDArray[np.float32],
        drafts: Sequence[int],
        first_index: int,
        grammar: GrammarState | None = None,
    ) -> list[int]: ...

# --- constrained decoding ----------------------------------------------------------------

MAX_GRAMMAR_BYTES: int

@final
class GrammarVocabulary:
    """A model's tokens as bytes (special ones ``0xFF`` + name) and its end tokens."""

    def __new__(cls, tokens: Sequence[bytes], eos: Sequence[int]) -> GrammarVocabulary: ...
    @property
    def size(self) -> int: ...
    @property
    def eos(self) -> list[int]: ...

@final
class Grammar:
    """A grammar compiled against a vocabulary (json_schema, json_object, regex or lark)."""

    def __new__(cls, vocabulary: GrammarVocabulary, kind: str, text: str) -> Grammar: ...
    @property
    def kind(self) -> str: ...
    @property
    def text(self) -> str: ...
    def start(self) -> GrammarState: ...

@final
class GrammarState:
    """One sequence's position in its grammar."""

    @property
    def consumed(self) -> int: ...
    @property
    def done(self) -> bool: ...
    def allowed(self) -> list[int]: ...
    def advance(self, token: int) -> None: ...
    def align(self, consumed: int, next: int) -> None: ...

@final
class BatchForward:
    """One batched forward step of many sessions over a layer range (bit-identical to each
    session run alone; one set of step buffers for every batch)."""

    def __new__(cls, weights: ModelWeights, layer_lo: int, layer_hi: int) -> BatchForward: ...
    @property
    def layer_range(self) -> tuple[int, int]: ...
    def run(
        self,
        sessions: Sequence[RangeSession],
        inputs: Sequence[Sequence[int] | NDArray[np.float32]],
        logits: Sequence[_Logits],
        spans: Sequence[SpanType] | None = None,
    ) -> list[_Forwarded]: ...
    def release_buffers(self) -> bool: ...

@final
class ReplayResult:
    """A replayed volume: status "hit" (whole prompt) or "partial" (after an erasure)."""

    @property
    def status(self) -> Literal["hit", "partial"]: ...
    @property
    def kv_len(self) -> int: ...
    @property
    def tail(self) -> NDArray[np.float32] | None: ...
    @property
    def logits(self) -> NDArray[np.float32] | None: ...

@final
class NativeLlamaPipeline:
    """A layer range with its own volume cache (the design's API, one-for-one)."""

    def __new__(
        cls,
        weights: ModelWeights,
        layer_lo: int,
        layer_hi: int,
        max_entries: int = ...,
        max_prefix_len: int = ...,
        max_bytes: int | None = None,
        policy: _Policy | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        max_disk_bytes: int | None = None,
    ) -> NativeLlamaPipeline: ...
    @property
    def layer_range(self) -> tuple[int, int]: ...
    @property
    def amplituhedron_enabled(self) -> bool: ...
    def amplituhedron_enable(self, on: bool) -> None: ...
    def amplituhedron_set_max_entries(self, n: int) -> None: ...
    def amplituhedron_set_max_prefix_len(self, n: int) -> None: ...
    def amplituhedron_set_max_bytes(self, n: int | None) -> None: ...
    def amplituhedron_clear(self) -> None: ...
    def amplituhedron_set_min_prefix_reuse(self, n: int) -> None: ...
    @property
    def min_prefix_reuse(self) -> int: ...
    def amplituhedron_stats(self) -> dict[str, int]: ...
    def amplituhedron_flush(self) -> None: ...
    def amplituhedron_tail(self, prefix_hash: int) -> NDArray[np.float32] | None: ...
    def amplituhedron_capture(
        self,
        session: RangeSession,
        tokens: Sequence[int],
        tail: NDArray[np.float32],
        logits: NDArray[np.float32] | None = None,
        salt: str | None = None,
    ) -> int: ...
    def amplituhedron_replay(
        self, session: RangeSession, tokens: Sequence[int], salt: str | None = None
    ) -> ReplayResult | None: ...
    def amplituhedron_inject_fault(
        self, tokens: Sequence[int], position: int, salt: str | None = None
    ) -> bool: ...

# --- continuous batching -----------------------------------------------------------------

_LogprobsTuple = tuple[int, float, Sequence[tuple[int, float]]]

#: The most alternatives a token's log-probabilities list (OpenAI's ``top_logprobs`` bound).
MAX_TOP_LOGPROBS: int
MAX_LOGIT_BIAS: float
MAX_OPENAI_PENALTY: float
MIN_REPETITION_PENALTY: float
MAX_REPETITION_PENALTY: float

@final
class TokenLogprobs:
    """A token's log-probability under the model's own distribution (the softmax of the raw
    logits) and the most likely tokens with theirs (``top``: ``(id, logprob)``, higher
    first, lower id on ties)."""

    @property
    def token(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top(self) -> list[tuple[int, float]]: ...

def token_logprobs(logits: NDArray[np.float32], token: int, top_n: int) -> TokenLogprobs: ...

@final
class EngineEvent:
    """A token (``kind == "token"``), a computed prompt's log-probabilities (``kind ==
    "prompt"``, only for requests that asked) or the end of a sequence (``kind ==
    "finished"``)."""

    @property
    def kind(self) -> Literal["token", "prompt", "finished"]: ...
    @property
    def seq(self) -> int: ...
    @property
    def token(self) -> int | None: ...
    @property
    def index(self) -> int | None: ...
    @property
    def logits(self) -> NDArray[np.float32] | None: ...
    @property
    def logprobs(self) -> TokenLogprobs | None: ...
    @property
    def prompt_logprobs(self) -> list[TokenLogprobs] | None: ...
    @property
    def reason(self) -> Literal["stop", "length", "cancelled", "error"] | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def stats(self) -> dict[str, int | float | bool] | None: ...

@final
class EngineAdmission:
    """A new sequence an external executor must prepare (open sessions, replay the cache)."""

    @property
    def seq(self) -> int: ...
    @property
    def prompt(self) -> list[int]: ...
    @property
    def greedy(self) -> bool: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def logit_bias(self) -> list[tuple[int, float]]: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def min_tokens_banned(self) -> list[int]: ...
    @property
    def salt(self) -> str | None: ...
    @property
    def use_cache(self) -> bool: ...
    @property
    def sample_first(self) -> bool: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs(self) -> int | None: ...
    @property
    def grammar(self) -> tuple[str, str] | None: ...

@final
class EngineEntry:
    """One sequence's rows of a planned step; ``tokens[0]`` sits at position ``start``."""

    @property
    def seq(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def kind(self) -> Literal["prefill", "decode"]: ...
    @property
    def last(self) -> bool: ...
    @property
    def emit(self) -> bool: ...

@final
class EngineStepTotals:
    """Totals of the batches an engine has run (see :attr:`Engine.step_totals`)."""

    @property
    def steps(self) -> int: ...
    @property
    def prompt_rows(self) -> int: ...
    @property
    def decode_rows(self) -> int: ...
    @property
    def busy_seconds(self) -> float: ...

@final
class Engine:
    """The continuous-batching engine (thread-safe): over an in-process executor, or for an
    external executor (:meth:`external`)."""

    def __new__(
        cls,
        pipeline: NativeLlamaPipeline,
        *,
        slots: int,
        recall: int,
        n_sys: int,
        max_chunk: int,
        max_running: int,
        max_queue: int,
        step_tokens: int,
    ) -> Engine: ...
    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        greedy: bool = ...,
        temperature: float = ...,
        top_k: int = ...,
        top_p: float = ...,
        seed: int = ...,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Sequence[tuple[int, float]] = ...,
        min_tokens: int = 0,
        stop_ids: Sequence[int] = ...,
        salt: str | None = None,
        use_cache: bool = True,
        draft_max: int | None = None,
        want_logits: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        grammar: Grammar | None = None,
        follows: int | None = None,
    ) -> int: ...
    @staticmethod
    def external(*, max_running: int, max_queue: int, step_tokens: int) -> Engine: ...
    def plan_admissions(self) -> list[EngineAdmission]: ...
    def admitted(
        self,
        results: Sequence[tuple[int, int, int | None, str | None]],
        logprobs: Sequence[_LogprobsTuple | None] | None = None,
        done: Sequence[bool] | None = None,
    ) -> list[EngineEvent]: ...
    def plan_batch(self) -> list[EngineEntry]: ...
    def complete(
        self,
        emitted: Sequence[Sequence[int]],
        error: str | None = None,
        logprobs: Sequence[Sequence[_LogprobsTuple]] | None = None,
        prompt_logprobs: Sequence[Sequence[_LogprobsTuple]] | None = None,
        done: Sequence[bool] | None = None,
        errors: Sequence[str | None] | None = None,
    ) -> list[EngineEvent]: ...
    def take_released(self) -> list[int]: ...
    def cancel(self, seq: int) -> EngineEvent | None: ...
    def step(self) -> list[EngineEvent]: ...
    def prefilled(self, seq: int) -> int | None: ...
    @property
    def has_work(self) -> bool: ...
    @property
    def waiting(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def live_sequences(self) -> int | None: ...
    @property
    def step_totals(self) -> EngineStepTotals: ...
    @property
    def limits(self) -> tuple[int, int, int]: ...

# --- quantized kernels -------------------------------------------------------------------

def quant_dequantize(
    qtype: int, data: NDArray[np.uint8], rows: int, cols: int
) -> NDArray[np.float32]:
    """Dequantize a ``(rows, cols)`` matrix of ggml type id ``qtype`` from its raw bytes."""

def quant_matmul(
    qtype: int,
    data: NDArray[np.uint8],
    rows: int,
    cols: int,
    x: NDArray[np.float32],
    kernel: str | None = None,
    refined: bool = False,
) -> NDArray[np.float32]:
    """``x (n, cols) @ W.T`` → ``(n, rows)``, activations quantized to 8 bits per block
    (32 elements, or 256 for the k-quants).

    ``kernel`` picks one of :func:`quant_kernels` (default: the fastest); all give
    bit-identical results. ``refined`` quantizes them to 16-bit codes (k-quants: adds a
    residual pass).
    """

def quant_embed(
    qtype: int, data: NDArray[np.uint8], rows: int, cols: int, ids: NDArray[np.uint32]
) -> NDArray[np.float32]:
    """Rows ``ids`` of a ``(rows, cols)`` matrix, dequantized → ``(len(ids), cols)``."""

def quant_kernels() -> list[str]:
    """Matmul kernels this CPU can run, slowest first (the last is the default)."""

def quant_types() -> list[tuple[str, int]]:
    """Tensor types the kernels compute with, as ``(ggml name, ggml type id)``."""
