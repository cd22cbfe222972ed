"""Where a hop's time goes (benches): each step's round trip at each station split into
phases that add up to it, from the coordinator's clock and the station's
(:class:`~.protocol.StepTiming`, the host's ``CLOCK_MONOTONIC``; meaningful for stations on
the coordinator's host)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from amplituhedron_rs.mesh.protocol import StepTiming


@dataclass
class HopTimes:
    """Sums over hops, in seconds (``hops``: how many). The phases partition each hop."""

    hops: int = 0
    #: The coordinator builds and encodes the station's header.
    encode: float = 0.0
    #: Sent → the station has the whole request: the write, the wire, the station's wake-up.
    outbound: float = 0.0
    #: The station parses and validates the header, checks the payload, takes the locks.
    parse: float = 0.0
    #: The forward pass (including waking the station's compute threads).
    compute: float = 0.0
    #: Emission, capture, the answer encoded.
    finish: float = 0.0
    #: Written → the coordinator's step resumes: the wire and the coordinator's wake-up.
    back: float = 0.0
    #: The coordinator parses the answer.
    decode: float = 0.0

    def add(
        self, started: float, sent: float, answered: float, parsed: float, st: StepTiming
    ) -> None:
        """One hop: the coordinator's clock at the start, at the send, when the answer was
        handed back and once parsed; the station's timing."""
        self.hops += 1
        self.encode += sent - started
        self.outbound += st.received - sent
        self.parse += st.planned - st.received
        self.compute += st.computed - st.planned
        self.finish += st.finished - st.computed
        self.back += answered - st.finished
        self.decode += parsed - answered

    def per_hop_ms(self) -> dict[str, float]:
        """Each phase's mean per hop, in milliseconds, and their total."""
        n = max(1, self.hops)
        out = {f.name: getattr(self, f.name) * 1e3 / n for f in fields(self) if f.name != "hops"}
        out["total"] = sum(out.values())
        return out
