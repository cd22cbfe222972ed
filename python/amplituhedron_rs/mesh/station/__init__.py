"""A station: one layer range of the model and its sessions' ring buffers, over HTTP.

- :mod:`.state`: settings, sessions and the operations (no HTTP routing);
- :mod:`.routes`: the endpoints, thin FastAPI routes over the state;
- :mod:`.fastpath`: decode steps served straight from ASGI;
- :mod:`.errors`: the one table from exception type to HTTP status;
- :mod:`.app`: the app factory (metrics, middleware, handlers) and ``serve``.
"""

from amplituhedron_rs.mesh.station.app import create_app, serve
from amplituhedron_rs.mesh.station.state import Station, StationSettings

__all__ = ["Station", "StationSettings", "create_app", "serve"]
