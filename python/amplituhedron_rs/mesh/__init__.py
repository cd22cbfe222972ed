"""Meshes of stations: a model split into layer ranges served over HTTP.

- :mod:`.protocol`: the wire format (request/response models, headers), shared by both ends;
- :mod:`.station`: one layer range and its sessions, as a FastAPI service;
- :mod:`.coordinator`: the client that drives a mesh (replay fan-out, pipelined prefill,
  capture, decode), over :mod:`.client`; its results are :mod:`.generation`'s;
- :mod:`.launcher`: mesh files (:class:`~.launcher.MeshSpec`) and local meshes of station
  processes (:class:`~.launcher.LocalMesh`).

Depends on :mod:`amplituhedron_rs.runtime` and the core. Nothing is imported here, so
``import amplituhedron_rs.mesh.launcher`` does not load the HTTP stacks.
"""
