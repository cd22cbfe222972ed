"""Every bench, its verdicts, report and plot.

- :mod:`.falsifiability`: ``amplituhedron bench``, the predictions P1–P5 and triggers F1–F5
  measured over a mesh (with :mod:`.verdicts`, :mod:`.eviction`, :mod:`.peers`,
  :mod:`.report`, :mod:`.progress`, :mod:`.config`);
- :mod:`.model`: ``amplituhedron bench-model``, the runtime against llama.cpp;
- :mod:`.mesh`: ``amplituhedron bench-mesh``, what the HTTP mesh costs per hop;
- :mod:`.serve`: ``amplituhedron bench-serve``, streaming clients against the server;
- :mod:`.spec`: ``amplituhedron bench-spec``, speculative decoding against plain decoding;
- :mod:`.textsource`: offline reference text for prompts.

Depends on :mod:`amplituhedron_rs.runtime`, :mod:`amplituhedron_rs.mesh` and
:mod:`amplituhedron_rs.oracle`.
"""
