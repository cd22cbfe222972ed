"""Type stubs for the native module, checked against the build by mypy.stubtest.

Sections are kept per core module (volume, oracle, ring, model) so they stay easy to find.
"""

__version__: str

# --- volume cache, eviction, memo --------------------------------------------------------

# --- oracle kernel -----------------------------------------------------------------------

# --- ring buffer and attention -----------------------------------------------------------

from collections.abc import Sequence
from typing import Any, ClassVar, final

import numpy as np
from numpy.typing import NDArray

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
    ``(n_layers, kv_heads, n, head_dim)`` float32. Bad input raises ValueError and changes
    nothing.
    """

    def __new__(
        cls,
        n_layers: int,
        kv_heads: int,
        head_dim: int,
        slots: int = 4096,
        recall: int = 128,
        n_sys: int = 0,
        max_chunk: int | None = None,
        undo_capacity: int = 64,
    ) -> RingBuffer: ...
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
