"""A station: one layer range of the model and its sessions' ring buffers, over HTTP.

- :mod:`.settings`: what a station is started with;
- :mod:`.session`: a live session, what a capture may freeze, the forward in pieces;
- :mod:`.state`: the station and its operations (no HTTP routing);
- :mod:`.routes`: the endpoints, thin FastAPI routes over the state;
- :mod:`.fastpath`: decode steps served straight from ASGI;
- :mod:`.errors`: the one table from exception type to HTTP status;
- :mod:`.app`: the app factory (metrics, middleware, handlers) and ``serve``.
"""

from amplituhedron_rs.mesh.station.app import create_app, serve
from amplituhedron_rs.mesh.station.settings import StationSettings
from amplituhedron_rs.mesh.station.state import Station

__all__ = ["Station", "StationSettings", "create_app", "serve"]
