"""The station wire protocol, shared by the station (which serves it) and the coordinator
(which speaks it): JSON request and response models, the binary conventions and header
names. Compute bodies are raw little-endian arrays: u32 token ids into the entry station,
f32 hidden rows between stations, f32 tail (+ logits) for volumes."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from amplituhedron_rs.runtime.sampling import SamplingParams

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
HASH_PATTERN = r"^[0-9]{1,20}$"
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

TokenId = Annotated[int, Field(ge=0, le=U32_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- requests ------------------------------------------------------------------------------


class ConfigureRequest(_Strict):
    enabled: bool | None = None
    max_entries: int | None = Field(default=None, ge=1, le=1_000_000)
    max_prefix_len: int | None = Field(default=None, ge=1, le=1 << 31)
    max_bytes: int | None = Field(default=None, ge=1, le=1 << 48)
    min_prefix_reuse: int | None = Field(default=None, ge=0, le=1 << 31)


class VolumeRequest(_Strict):
    """Names one volume of one session: replay's JSON body, capture's query string."""

    session_id: str = Field(min_length=1, max_length=128)
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
    prompt_tokens: list[TokenId] = Field(min_length=1)
    session_id: str | None = Field(default=None, min_length=1, max_length=128)
    n_sys: int = Field(default=0, ge=0, le=1 << 20)
    salt: str | None = Field(default=None, max_length=256)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)


class RollbackRequest(_Strict):
    clock: int = Field(ge=0, le=U64_MAX)


class FaultRequest(_Strict):
    prompt_tokens: list[TokenId] = Field(min_length=1)
    position: int = Field(ge=0)
    salt: str | None = None


# --- responses -----------------------------------------------------------------------------


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


class SessionOpened(BaseModel):
    session_id: str
    clock: int
    layer_lo: int
    layer_hi: int


class SessionSummary(BaseModel):
    session_id: str
    clock: int
    prompt_len: int


class SessionList(BaseModel):
    sessions: list[SessionSummary]
    max_sessions: int


class Captured(BaseModel):
    captured: bool
    bytes: int


class Configured(BaseModel):
    stats: dict[str, int]


class Sampled(BaseModel):
    token: int


class RolledBack(BaseModel):
    clock: int
