"""Type stubs for the native module, checked against the build by mypy.stubtest.

Sections are kept per core module (volume, oracle, ring, model) so they stay easy to find.
"""

__version__: str

# --- volume cache, eviction, memo --------------------------------------------------------

# --- oracle kernel -----------------------------------------------------------------------

# --- ring buffer and attention -----------------------------------------------------------

# --- model runtime -----------------------------------------------------------------------
