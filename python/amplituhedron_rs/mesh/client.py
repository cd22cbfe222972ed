"""The coordinator's calls to stations: HTTP through one keep-alive aiohttp session, and
batched steps over the step stream (:mod:`.stream`) where a station serves one; every answer
read in full, and every failure a :class:`MeshError` that names the station and the phase of
the generation it broke."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

from amplituhedron_rs._core import MeshError, StepChain
from amplituhedron_rs.mesh.launcher import StationInfo
from amplituhedron_rs.mesh.protocol import BATCH_ROUTE, FRAME_HEADER, OCTETS, Health, split_frame
from amplituhedron_rs.mesh.stream import StreamError, StreamPool

#: How steps reach the stations: the step stream where a station serves one, or HTTP only.
Transport = Literal["stream", "http"]


@dataclass(frozen=True)
class Reply:
    """A station's answer, read in full."""

    status: int
    headers: Mapping[str, str]  # case-insensitive
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


class StationClient:
    """The connection pools to a mesh's stations (HTTP, and the step stream where a station
    serves one: ``transport="stream"``); open it before use, close it after."""

    def __init__(
        self,
        timeout: float,
        headers: Mapping[str, str] | None = None,
        transport: Transport = "stream",
    ) -> None:
        if transport not in ("stream", "http"):
            raise MeshError(f"transport must be 'stream' or 'http', got {transport!r}")
        self._timeout = timeout
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        self.transport = transport
        self._streams = StreamPool()
        #: The step stream's connections for whole chains (see :meth:`step_chain`).
        self._chain = StepChain()
        #: Each station's step-stream port (None: it has none), from its /healthz.
        self._ports: dict[str, int | None] = {}
        #: Each station's host, parsed from its URL once.
        self._hosts: dict[str, str] = {}

    def open(self) -> None:
        # aiohttp keeps connections alive per host and costs ~0.25 ms a request on loopback
        # (httpx measured ~1.5 ms here), which is most of the per-hop budget.
        # The mesh token goes on every request (every station endpoint but /healthz needs it).
        self._session = aiohttp.ClientSession(
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=self._timeout),
            # Shorter than the stations' keep-alive (30 s): a pooled connection is never one
            # the station has just closed (that race was a spurious "Server disconnected").
            connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=15),
        )

    async def close(self) -> None:
        self._streams.close()
        self._chain.close()
        if self._session is not None:
            await self._session.close()

    def learn(self, station: StationInfo, health: Health) -> None:
        """Notes the station's step-stream port from its health check."""
        self._ports[station.url] = health.stream_port

    async def step(
        self,
        phase: str,
        station: StationInfo,
        head: bytes,
        payload: bytes | memoryview,
        *,
        token: str | None,
        headers: Mapping[str, str],
    ) -> tuple[bytes, bytes]:
        """One batched step at ``station``: the answer's JSON header and payload. On the
        step stream when the station serves one (its port comes from its /healthz, asked
        again after a failure: a restarted station may listen elsewhere), else ``POST
        /batch/step``. Failures are StationFailed, as :meth:`call`'s."""
        port = await self._stream_port(station, headers)
        if port is None:
            r = await self.call(
                phase,
                station,
                "POST",
                BATCH_ROUTE,
                content=len(head).to_bytes(FRAME_HEADER, "little") + head + bytes(payload),
                headers={**headers, "Content-Type": OCTETS},
            )
            try:
                out, rest = split_frame(r.content)
            except ValueError as exc:
                raise MeshError(f"station {station.url} answered a malformed step: {exc}") from exc
            return out, bytes(rest)
        host = self._host(station)
        try:
            reply = await self._streams.call(
                host, port, (token or "").encode(), head, payload, self._timeout
            )
        except StreamError as exc:
            self._streams.forget(host, port)
            raise self._silent(station, phase, exc.timeout, str(exc)) from exc
        if reply.status != 200:
            raise _refused(station, phase, reply.status, reply.head)
        return reply.head, reply.payload

    async def step_chain(
        self,
        phase: str,
        stations: Sequence[StationInfo],
        heads: Sequence[bytes],
        payload: bytes | memoryview,
        entries: int,
        *,
        token: str | None,
        headers: Mapping[str, str],
    ) -> tuple[list[tuple[bytes, float, float]], bytes] | None:
        """One batched step through ``stations`` in order, on the step stream, without
        coming back to the event loop between hops (``_core.StepChain`` in a worker thread:
        in asyncio each hop cost the coordinator ≈ 0.15 ms of CPU on every token's critical
        path). Returns each station's answer header with when its request was sent and its
        answer read (``time.monotonic()``), and the last station's payload; None when a
        station serves no step stream (step hop by hop then). Failures are StationFailed
        naming the station, as :meth:`step`'s."""
        addresses = []
        for station in stations:
            port = await self._stream_port(station, headers)
            if port is None:
                return None
            addresses.append((self._host(station), port))
        loop = asyncio.get_running_loop()
        answers, stop = await loop.run_in_executor(
            None,
            self._chain.run,
            addresses,
            (token or "").encode(),
            list(heads),
            bytes(payload),
            entries,
            self._timeout,
        )
        if stop is None:
            assert answers is not None
            replies, out = answers
            return [(bytes(h), sent, answered) for h, sent, answered in replies], bytes(out)
        at, status, timed_out, detail = stop
        station = stations[at]
        if status is None:
            self._chain.forget(*addresses[at])
            raise self._silent(station, phase, timed_out, detail)
        if status == 200:
            raise MeshError(f"station {station.url} {detail}")
        raise _refused(station, phase, status, detail.encode())

    def _host(self, station: StationInfo) -> str:
        host = self._hosts.get(station.url)
        if host is None:
            host = self._hosts[station.url] = urlsplit(station.url).hostname or "127.0.0.1"
        return host

    def _silent(self, station: StationInfo, phase: str, timed_out: bool, why: str) -> StationFailed:
        """No answer on the step stream: the station's port is asked again next time (a
        restarted station may listen elsewhere)."""
        self._ports.pop(station.url, None)
        if timed_out:
            why = f"did not answer within {self._timeout:g} s during {phase}"
        else:
            why = f"failed during {phase}: {why}"
        return StationFailed(None, f"station {station.url} {why}", station=station)

    async def _stream_port(self, station: StationInfo, headers: Mapping[str, str]) -> int | None:
        if self.transport == "http" or not station.url.startswith("http://"):
            return None  # an https:// station is behind TLS: the stream would not be
        if station.url not in self._ports:
            r = await self.call("health check", station, "GET", "/healthz", headers=headers)
            self._ports[station.url] = Health.model_validate_json(r.content).stream_port
        return self._ports[station.url]

    async def call(
        self,
        phase: str,
        station: StationInfo,
        method: str,
        path: str,
        *,
        ok: Sequence[int] = (200, 201),
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Reply:
        """One request within ``timeout`` seconds (default: the client's); a status outside
        ``ok``, a transport failure or a timeout is a MeshError whose ``status`` is the
        station's answer (None: no answer)."""
        if self._session is None:
            raise RuntimeError("use the Coordinator as `async with Coordinator(...) as c:`")
        if "content" in kwargs:
            kwargs["data"] = kwargs.pop("content")
        limit = self._timeout if timeout is None else timeout
        try:
            async with self._session.request(
                method,
                station.url + path,
                timeout=aiohttp.ClientTimeout(total=limit),
                **kwargs,
            ) as r:
                reply = Reply(r.status, CIMultiDict(r.headers), await r.read())
        except TimeoutError as exc:
            raise StationFailed(
                None,
                f"station {station.url} did not answer within {limit:g} s during {phase}",
                station=station,
            ) from exc
        except aiohttp.ClientError as exc:
            raise StationFailed(
                None, f"station {station.url} failed during {phase}: {exc!r}", station=station
            ) from exc
        if reply.status not in ok:
            try:
                detail = reply.json().get("detail", reply.content.decode(errors="replace"))
            except ValueError:
                detail = reply.content.decode(errors="replace")
            raise StationFailed(
                reply.status,
                f"station {station.url} answered {reply.status} during {phase}: {detail}",
                reply.headers.get("Retry-After"),
                station=station,
            )
        return reply


def _refused(station: StationInfo, phase: str, status: int, head: bytes) -> StationFailed:
    """A step the station answered with ``status`` (its ``{"detail": …}`` header)."""
    try:
        body = json.loads(head)
        detail, retry = body.get("detail", ""), body.get("retry_after")
    except (ValueError, AttributeError):
        detail, retry = head.decode(errors="replace"), None
    return StationFailed(
        status,
        f"station {station.url} answered {status} during {phase}: {detail}",
        None if retry is None else str(retry),
        station=station,
    )


class StationFailed(MeshError):
    """A station's refusal or silence, with its HTTP status (None: no answer), on a 503 its
    ``Retry-After``, and the station."""

    def __init__(
        self,
        status: int | None,
        message: str,
        retry_after: str | None = None,
        *,
        station: StationInfo | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.station = station

    @property
    def down(self) -> bool:
        """The station died or stopped answering (no answer, a 502 or a 504), as opposed to
        refusing the request (4xx), being full (503, retried by the open), or failing on it
        (500: a model error, which a replica would repeat): fail over to a replica."""
        return self.station is not None and self.status in (None, 502, 504)

    @property
    def lost(self) -> bool:
        """The station answers but no longer holds the session (404: it restarted, or the
        session expired): rebuild the session, the station itself is fine."""
        return self.station is not None and self.status == 404
