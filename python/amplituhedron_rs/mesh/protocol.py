"""The station wire protocol, shared by the station (which serves it) and the coordinator
(which speaks it): JSON request and response models, the binary conventions and header
names. Compute bodies are raw little-endian arrays: u32 token ids into the entry station,
f32 hidden rows between stations, f32 tail (+ logits) for volumes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from amplituhedron_rs._core import MAX_TOP_LOGPROBS, TokenLogprobs
from amplituhedron_rs.runtime.sampling import SamplingParams

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
HASH_PATTERN = r"^[0-9]{1,20}$"
#: Session ids are drawn by the station (``secrets.token_urlsafe``): URL-safe, never escaped.
SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"
OCTETS = "application/octet-stream"

DECODE_ROUTE = "/sessions/{session_id}/decode"
FORWARD_ROUTE = "/sessions/{session_id}/forward"

# Response headers of the compute and volume endpoints.
HIDDEN_ROWS = "X-Hidden-Rows"
LOGITS_ROWS = "X-Logits-Rows"
CLOCK = "X-Clock"
TOKEN = "X-Token"
REPLAY_STATUS = "X-Amplituhedron-Status"
REPLAY_KV_LEN = "X-Amplituhedron-Kv-Len"
REPLAY_LOGITS = "X-Amplituhedron-Logits"
RETRY_AFTER = "Retry-After"
# Request header: the tenant the authenticated coordinator acts for (the station derives
# the cache salt from it and the mesh token; a tenant is refused on an open station).
TENANT = "X-Amplituhedron-Tenant"

# Strict: a JSON float, bool or string is not a token id.
TokenId = Annotated[int, Field(ge=0, le=U32_MAX, strict=True)]
SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN)]


class _Strict(BaseModel):
    # NaN/Infinity (which Python's JSON parser accepts) are refused like any bad value.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# --- requests ------------------------------------------------------------------------------


class ConfigureRequest(_Strict):
    enabled: bool | None = None
    max_entries: int | None = Field(default=None, ge=1, le=1_000_000)
    max_prefix_len: int | None = Field(default=None, ge=1, le=1 << 31)
    max_bytes: int | None = Field(default=None, ge=1, le=1 << 48)
    min_prefix_reuse: int | None = Field(default=None, ge=0, le=1 << 31)


class VolumeRequest(_Strict):
    """Names one volume of one session: replay's JSON body, capture's query string."""

    session_id: SessionId
    prefix_hash: str = Field(pattern=HASH_PATTERN, description="u64 as a decimal string")
    prefix_len: int = Field(ge=1, le=1 << 31)
    layer_lo: int = Field(ge=0, le=65535)
    layer_hi: int = Field(ge=0, le=65535)


class SamplingSpec(_Strict):
    """How the exit station samples this session's tokens: the fields of
    :class:`SamplingParams`, with its one greedy rule (one seeded sampler per session, so the
    tokens equal the single-process runtime's for the same parameters)."""

    temperature: float | None = Field(default=None, ge=0, le=1e6)
    top_k: int | None = Field(default=None, ge=0, le=1 << 31)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int = Field(default=0, ge=0, le=U64_MAX)

    @classmethod
    def of(cls, params: SamplingParams) -> SamplingSpec:
        return cls(**params.to_json())

    def params(self) -> SamplingParams:
        return SamplingParams(**self.model_dump())


class OpenSessionRequest(_Strict):
    """The station draws the session id; the tenant (cache salt) comes from the
    authenticated caller's ``X-Amplituhedron-Tenant`` header, never from the body."""

    prompt_tokens: list[TokenId] = Field(min_length=1, max_length=1 << 20)
    n_sys: int = Field(default=0, ge=0, le=1 << 20)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)


class RollbackRequest(_Strict):
    clock: int = Field(ge=0, le=U64_MAX)


class FaultRequest(_Strict):
    prompt_tokens: list[TokenId] = Field(min_length=1, max_length=1 << 20)
    position: int = Field(ge=0, le=1 << 31)


# --- responses -----------------------------------------------------------------------------


class StationMemory(BaseModel):
    """What a station holds in memory, in bytes (see :mod:`.station.memory`). None: not
    measurable on this platform."""

    rss: int | None
    baseline: int | None
    weights_resident: int
    weights_copied: int
    weights_mapped: int | None
    weights_held: int
    rings: int
    available: int | None


class Health(BaseModel):
    status: str
    layer_lo: int
    layer_hi: int
    n_layers: int
    fingerprint: str
    hidden: int
    vocab: int
    sessions: int
    entry: bool
    exit: bool
    memory: StationMemory | None = None


class SessionOpened(BaseModel):
    session_id: str
    clock: int
    layer_lo: int
    layer_hi: int


class SessionCount(BaseModel):
    """How full the station is; session ids are never listed (they are capabilities)."""

    live: int
    max_sessions: int


class Captured(BaseModel):
    captured: bool
    bytes: int
    #: Why nothing was captured, when the station declined on principle.
    reason: str | None = None


class Configured(BaseModel):
    stats: dict[str, int]


class TokenLogprobsWire(BaseModel):
    """One emitted token's log-probability and its most likely alternatives
    (``(id, logprob)``, higher first), as the exit station computed them."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)

    @classmethod
    def of(cls, t: TokenLogprobs) -> TokenLogprobsWire:
        return cls(token=t.token, logprob=t.logprob, top=t.top)

    def as_tuple(self) -> tuple[int, float, list[tuple[int, float]]]:
        """What the engine's ``admitted``/``complete`` take."""
        return self.token, self.logprob, self.top


class Sampled(BaseModel):
    token: int
    #: Its log-probabilities, when asked for (``?logprobs=N``).
    logprobs: TokenLogprobsWire | None = None


class RolledBack(BaseModel):
    clock: int


# --- the batched step (many sessions, one request per station per step) -------------------
#
# ``POST /batch/step`` (bearer token) runs one step of many sessions at one station. Its body
# and its answer are both a *frame*:
#
#     u32 LE  header length H
#     H bytes JSON header (UTF-8): a BatchStepRequest / BatchStepReply
#     rest    payload: f32 LE hidden rows, every entry's rows concatenated in entry order
#
# The request's payload is empty at the entry station (the header's token ids are the input)
# and holds ``sum(len(tokens))`` rows of ``hidden`` floats elsewhere. The answer's payload
# holds every entry's output rows, except at the exit station, which answers none: it emits
# tokens instead (sampled or verified with each session's own seeded sampler, keyed by
# position), so no logits cross the wire.

BATCH_ROUTE = "/batch/step"
FRAME_HEADER = 4


class BatchEntrySpec(_Strict):
    """One session's rows of a step: ``tokens[0]`` sits at position ``start``. A station
    first rolls the session back to ``start`` when it holds more (drafts rejected last step)."""

    session_id: SessionId
    start: int = Field(ge=0, le=1 << 31)
    #: The rows' token ids (the input at the entry station; the drafts to verify at the exit).
    tokens: list[TokenId] = Field(min_length=1)
    #: "prefill": a chunk of the prompt; "decode": the last emitted token, then drafts.
    kind: Literal["prefill", "decode"]
    #: Prefill: the chunk ends the prompt.
    last: bool = False
    #: Exit station, prefill ending the prompt: sample the first token.
    emit: bool = False
    #: Prefill ending the prompt: every station captures the prompt's volume (its own KV,
    #: its own last output row, and at the exit station its own logits). Any prefill chunk:
    #: a prompt longer than a station's longest captured prefix caches its head from the
    #: chunk that computes the head's last position.
    capture: bool = False
    #: Exit station: report each emitted token's log-probability with this many
    #: alternatives (None: none).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    #: Exit station, prefill: report the log-probability of each prompt token a row
    #: predicts (the one after it, within the prompt) with this many alternatives.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class BatchStepRequest(_Strict):
    entries: list[BatchEntrySpec] = Field(min_length=1, max_length=4096)


class BatchEntryResult(BaseModel):
    #: Positions the session holds after the step.
    clock: int
    #: Output rows of this entry in the answer's payload (0 at the exit station).
    rows: int
    #: Exit station: the emitted tokens (1 to len(tokens) for a decode entry).
    emitted: list[int] = Field(default_factory=list)
    #: Bytes of the captured volume (0: declined or not asked).
    captured: int = 0
    #: Exit station, when asked: the emitted tokens' log-probabilities, in order.
    logprobs: list[TokenLogprobsWire] | None = None
    #: Exit station, when asked: the prompt tokens' log-probabilities, in order.
    prompt_logprobs: list[TokenLogprobsWire] | None = None


class BatchStepReply(BaseModel):
    entries: list[BatchEntryResult]


def pack_frame(header: BaseModel, payload: bytes = b"") -> bytes:
    """A frame: the header's JSON, length-prefixed, then the payload."""
    head = header.model_dump_json().encode()
    return len(head).to_bytes(FRAME_HEADER, "little") + head + payload


def split_frame(body: bytes) -> tuple[bytes, memoryview]:
    """The JSON header and the payload of a frame; ValueError if it is not one."""
    if len(body) < FRAME_HEADER:
        raise ValueError(f"a frame starts with a {FRAME_HEADER}-byte header length")
    n = int.from_bytes(body[:FRAME_HEADER], "little")
    if n > len(body) - FRAME_HEADER:
        raise ValueError(
            f"the frame's header length {n} exceeds its {len(body) - FRAME_HEADER} bytes"
        )
    view = memoryview(body)
    return bytes(view[FRAME_HEADER : FRAME_HEADER + n]), view[FRAME_HEADER + n :]
