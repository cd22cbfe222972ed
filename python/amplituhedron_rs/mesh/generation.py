"""What one mesh generation produced and how each station served it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StationVerdict:
    """What one station did for one session."""

    url: str
    layer_lo: int
    layer_hi: int
    replay: str = "off"  # "hit" | "partial" | "miss" | "off"
    replayed_tokens: int = 0
    captured_bytes: int = 0
    prefill_requests: int = 0


@dataclass
class MeshGeneration:
    """The result of one :meth:`Coordinator.generate` call."""

    prompt_ids: list[int]
    output_ids: list[int]
    cache_hit: bool
    replayed_tokens: int
    open_ms: float
    replay_ms: float
    prefill_ms: float
    decode_ms: float
    latency_ms: float
    stop_reason: str
    stations: list[StationVerdict] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["cache"] = {"hit": self.cache_hit, "stations": d.pop("stations")}
        return d
