"""The station wire protocol, shared by the station (which serves it) and the coordinator
(which speaks it): JSON request and response models, the binary conventions and header
names. Compute bodies are raw little-endian arrays: u32 token ids into the entry station,
f32 hidden rows between stations, f32 tail (+ logits) for volumes."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from amplituhedron_rs._core import MAX_GRAMMAR_BYTES, MAX_TOP_LOGPROBS, TokenLogprobs
from amplituhedron_rs.runtime.sampling import TOP_K_MAX, SamplingParams

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


def tenant_header(tenant: str) -> str:
    """The tenant header's value: a hex SHA-256 of the tenant, whatever its characters or
    length (a header carries neither control characters nor kilobytes)."""
    return hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()


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
    top_k: int | None = Field(default=None, ge=0, le=TOP_K_MAX)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int = Field(default=0, ge=0, le=U64_MAX)
    # The logits adjustments (the core sampler checks their domains and the ids against the
    # vocabulary; these bounds keep the wire small).
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=1e6)
    logit_bias: list[tuple[TokenId, float]] = Field(default_factory=list, max_length=1 << 20)
    min_tokens: int = Field(default=0, ge=0, le=1 << 31)
    min_tokens_banned: list[TokenId] = Field(default_factory=list, max_length=1 << 16)

    @classmethod
    def of(cls, params: SamplingParams) -> SamplingSpec:
        return cls(**params.to_json())

    def params(self) -> SamplingParams:
        fields = self.model_dump()
        fields["logit_bias"] = tuple((int(t), float(b)) for t, b in self.logit_bias)
        fields["min_tokens_banned"] = tuple(self.min_tokens_banned)
        return SamplingParams(**fields)


class GrammarSpec(_Strict):
    """A sequence's constraint (SPEC §16), as the core compiles it: the exit station builds
    the session's grammar state from it and samples under its mask."""

    kind: Literal["json_schema", "json_object", "regex", "lark"]
    text: str = Field(max_length=MAX_GRAMMAR_BYTES)


class OpenSessionRequest(_Strict):
    """The station draws the session id; the tenant (cache salt) comes from the
    authenticated caller's ``X-Amplituhedron-Tenant`` header, never from the body.
    ``grammar`` (exit station only; bounded) constrains the session's sampled tokens."""

    prompt_tokens: list[TokenId] = Field(min_length=1, max_length=1 << 20)
    n_sys: int = Field(default=0, ge=0, le=1 << 20)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    grammar: GrammarSpec | None = None


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
    #: The TCP port of the station's step stream on its host (None: it serves steps over
    #: HTTP only). See the step stream below.
    stream_port: int | None = None


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
    #: The session's grammar is complete after it.
    done: bool = False


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
    #: Answer with :class:`StepTiming` (benches: where a hop's time goes).
    timing: bool = False


class StepHeaders:
    """The JSON headers of one step at each station of a chain. They differ only in the
    session ids (each station draws its own), so the entries' other fields are serialised
    once per step instead of once per hop: ``render(ids)`` is
    ``BatchStepRequest(entries=[spec with session_id=ids[i]], timing=timing)`` as JSON."""

    def __init__(self, specs: Sequence[BatchEntrySpec], timing: bool) -> None:
        # Each entry without its session id, less the opening brace (start, tokens and kind
        # are required: never empty).
        self._rest = [s.model_dump_json(exclude={"session_id"}).encode()[1:] for s in specs]
        self._tail = b'],"timing":true}' if timing else b'],"timing":false}'

    def render(self, ids: Sequence[str]) -> bytes:
        """The header naming the sessions ``ids`` (one per entry, in order)."""
        if len(ids) != len(self._rest):
            raise ValueError(f"{len(ids)} session ids for {len(self._rest)} entries")
        entries = b",".join(
            b'{"session_id":' + json.dumps(sid).encode() + b"," + rest
            for sid, rest in zip(ids, self._rest, strict=True)
        )
        return b'{"entries":[' + entries + self._tail


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
    #: Exit station: the session's grammar is complete after the emitted tokens.
    done: bool = False
    #: Exit station: this entry's grammar could not go on (its sequence ends with this
    #: error after the emitted tokens; the other entries are unaffected).
    error: str | None = None


class StepTiming(BaseModel):
    """When the station reached each phase of a step, in seconds of the host's
    ``CLOCK_MONOTONIC`` (``time.monotonic()``): comparable with the caller's own clock only
    on the same host, which is what a bench of a local mesh needs."""

    #: The whole request was in (its last byte read).
    received: float
    #: Parsed and validated; every session's lock held.
    planned: float
    #: The forward pass returned.
    computed: float
    #: Emission and capture done, the answer encoded (it is written next).
    finished: float


class BatchStepReply(BaseModel):
    entries: list[BatchEntryResult]
    timing: StepTiming | None = None


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


# --- the step stream -----------------------------------------------------------------------
#
# A station also takes batched steps over a persistent TCP stream on its ``stream_port``
# (announced in /healthz): the same JSON header and payload as ``/batch/step``, without
# HTTP. Its hops cost a fifth of an HTTP hop's on loopback (see docs/performance.md).
# Each request frame carries the mesh token, checked in constant time before the header
# or payload is read, and declares its lengths up front, refused (413) past the station's
# limits before they are read:
#
#     4 bytes  STREAM_MAGIC
#     u16 LE   token length T (at most MAX_TOKEN_BYTES; 0 on an open station)
#     u32 LE   header length H
#     u32 LE   payload length P
#     T bytes  the mesh token
#     H bytes  JSON header: a BatchStepRequest
#     P bytes  payload, as /batch/step's
#
# The answer frame is ``STREAM_MAGIC, u16 status, u32 H, u32 P`` then the header (a
# BatchStepReply on 200, else ``{"detail": …, "retry_after"?: …}``) and the payload. One
# request at a time per connection, answered in order. After a refusal of the frame itself
# (bad magic, token or lengths: 400, 401, 413) the station closes the connection.

STREAM_MAGIC = b"AMS1"
STREAM_PREFIX = struct.Struct("<4sHII")
MAX_TOKEN_BYTES = 1024


def stream_request(token: bytes, head: bytes, payload: bytes | memoryview = b"") -> bytes:
    """One request frame of the step stream."""
    prefix = STREAM_PREFIX.pack(STREAM_MAGIC, len(token), len(head), len(payload))
    return b"".join((prefix, token, head, payload))


def stream_reply(status: int, head: bytes, payload: bytes = b"") -> bytes:
    """One answer frame of the step stream."""
    return b"".join(
        (STREAM_PREFIX.pack(STREAM_MAGIC, status, len(head), len(payload)), head, payload)
    )
