"""Type stubs for the native module, checked against the build by mypy.stubtest.

Sections are kept per core module (volume, oracle, ring, model) so they stay easy to find.
"""

__version__: str

# --- volume cache, eviction, memo --------------------------------------------------------

# --- oracle kernel -----------------------------------------------------------------------

# --- ring buffer and attention -----------------------------------------------------------

# --- model runtime -----------------------------------------------------------------------

# --- quantized kernels -------------------------------------------------------------------

import numpy as np
import numpy.typing as npt

def quant_dequantize(
    qtype: int, data: npt.NDArray[np.uint8], rows: int, cols: int
) -> npt.NDArray[np.float32]:
    """Dequantize a ``(rows, cols)`` matrix of ggml type id ``qtype`` from its raw bytes."""

def quant_matmul(
    qtype: int,
    data: npt.NDArray[np.uint8],
    rows: int,
    cols: int,
    x: npt.NDArray[np.float32],
    kernel: str | None = None,
) -> npt.NDArray[np.float32]:
    """``x (n, cols) @ W.T`` → ``(n, rows)``, activations quantized to 8 bits per 32-block.

    ``kernel`` picks one of :func:`quant_kernels` (default: the fastest); all give
    bit-identical results.
    """

def quant_embed(
    qtype: int, data: npt.NDArray[np.uint8], rows: int, cols: int, ids: npt.NDArray[np.uint32]
) -> npt.NDArray[np.float32]:
    """Rows ``ids`` of a ``(rows, cols)`` matrix, dequantized → ``(len(ids), cols)``."""

def quant_kernels() -> list[str]:
    """Matmul kernels this CPU can run, slowest first (the last is the default)."""
