"""The bounds of an HTTP surface, one dataclass with one set of defaults (light to import:
the CLI reads them)."""

from __future__ import annotations

from dataclasses import dataclass

#: JSON bodies: an OpenAI request or a station's control call (the OpenAI server's default).
DEFAULT_JSON_BYTES = 1024 * 1024


@dataclass(frozen=True)
class EdgeLimits:
    """What one connection or request may cost before the application sees it."""

    #: Open connections; past it the oldest connection without a request in flight is
    #: closed to make room, and if every connection is busy the new one gets a 503.
    max_connections: int = 1024
    #: Seconds from a connection's opening (or the end of its last response) to a complete
    #: request head; a client that dribbles or never sends a header is cut off.
    header_timeout_s: float = 10.0
    #: Seconds from a complete head to the body's last byte.
    body_timeout_s: float = 30.0
    #: Seconds an idle keep-alive connection stays open between requests.
    keepalive_s: float = 5.0
    #: JSON bodies, counted as they stream; past it a 413.
    max_json_bytes: int = DEFAULT_JSON_BYTES
    #: Octet bodies (the stations' compute frames); past it a 413.
    max_octet_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.max_json_bytes < 1 or self.max_octet_bytes < 1:
            raise ValueError("body limits must be at least 1 byte")
