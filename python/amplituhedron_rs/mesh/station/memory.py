"""What a station costs in memory, as its ``/healthz`` reports it, and the sum over a mesh.

- ``rss``: the process's resident set now (``VmRSS``).
- ``baseline``: its resident set before it loaded its weights (the interpreter, numpy, the
  HTTP stack and the core): what an idle station with no layers costs.
- ``weights_resident``: the weights' anonymous copies plus this process's resident pages of
  the file mapping (``/proc/self/smaps``), of which ``weights_copied`` and ``weights_mapped``;
  ``weights_held``: the bytes of the tensors its range holds (what the start-up check
  counted against ``MemAvailable``).
- ``rings``: bytes of the KV rings it holds (live sessions and pooled rings), as allocated.
- ``available``: the machine's ``MemAvailable`` (shared by every station of a local mesh, so
  it is not summed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: The fields summed over a mesh.
SUMMED = (
    "rss",
    "baseline",
    "weights_resident",
    "weights_copied",
    "weights_mapped",
    "weights_held",
    "rings",
)


def _proc_kb(path: str, key: str) -> int | None:
    """A ``key:  N kB`` field of a /proc file, in bytes (None off Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_rss() -> int | None:
    """This process's resident set in bytes (``VmRSS``)."""
    return _proc_kb("/proc/self/status", "VmRSS")


def mem_available() -> int | None:
    """The machine's ``MemAvailable`` in bytes."""
    return _proc_kb("/proc/meminfo", "MemAvailable")


def station_memory(weights: Mapping[str, Any], baseline: int | None, rings: int) -> dict[str, Any]:
    """A station's memory report from its weights' ``memory()`` and what it measured."""
    return {
        "rss": process_rss(),
        "baseline": baseline,
        "weights_resident": int(weights["resident"]),
        "weights_copied": int(weights["copied"]),
        "weights_mapped": weights["mapped"],
        "weights_held": int(weights["held"]),
        "rings": rings,
        "available": mem_available(),
    }


def mesh_memory(reports: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The stations' reports summed field by field (a field any station could not measure is
    None in the sum)."""
    reports = list(reports)
    total: dict[str, Any] = {"stations": len(reports)}
    for key in SUMMED:
        values = [r.get(key) for r in reports]
        total[key] = None if any(v is None for v in values) else sum(values)
    return total
