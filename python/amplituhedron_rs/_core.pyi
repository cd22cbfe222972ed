"""Type stubs for the native module, checked against the build by mypy.stubtest."""

__version__: str
