"""HTTP to stations, as the coordinator speaks it: one keep-alive aiohttp session, every
answer read in full, and every failure a :class:`MeshError` that names the station and the
phase of the generation it broke."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from multidict import CIMultiDict

from amplituhedron_rs._core import MeshError
from amplituhedron_rs.mesh.launcher import StationInfo


@dataclass(frozen=True)
class Reply:
    """A station's answer, read in full."""

    status: int
    headers: Mapping[str, str]  # case-insensitive
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


class StationClient:
    """The connection pool to a mesh's stations; open it before use, close it after."""

    def __init__(self, timeout: float, headers: Mapping[str, str] | None = None) -> None:
        self._timeout = timeout
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None

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
        if self._session is not None:
            await self._session.close()

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
