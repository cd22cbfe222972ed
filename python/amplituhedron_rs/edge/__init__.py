"""The HTTP edge shared by the OpenAI server and the stations (SPEC §14, §17): what every
connection and request meets before any application code runs.

- :mod:`.limits` — the bounds (connections, header/body read timeouts, body sizes);
- :mod:`.asgi` — bearer-token authentication before a body is read, and body limits
  counted as the body streams (chunked too);
- :mod:`.server` — uvicorn with a connection cap that evicts idle connections first, and
  header / body read deadlines (uvicorn has neither).

Depends on nothing else of the package; both :mod:`amplituhedron_rs.serve` and
:mod:`amplituhedron_rs.mesh` build on it.
"""

from __future__ import annotations

from amplituhedron_rs.edge.limits import EdgeLimits

__all__ = ["EdgeLimits"]
