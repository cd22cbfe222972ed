"""What a mesh holds in memory, station by station and summed, beside the model file's size:
the table ``mesh up``, ``bench`` and ``bench-mesh`` print (fields: :mod:`..mesh.station.memory`).
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from amplituhedron_rs.mesh.launcher import MeshSpec, station_memory
from amplituhedron_rs._core import ModelError
from amplituhedron_rs.mesh.station.memory import mesh_memory
from amplituhedron_rs.runtime.gguf_file import resolve_model_path


def measure_memory(spec: MeshSpec, model_path: str | None) -> dict[str, Any]:
    """Every station's memory report, their sum, and the model file's size (None: the file is
    not on this host)."""
    stations = station_memory(spec)
    try:
        file_bytes: int | None = resolve_model_path(model_path).stat().st_size
    except (OSError, ModelError):
        file_bytes = None
    return {"stations": stations, "sum": mesh_memory(stations), "file_bytes": file_bytes}


def _mb(v: int | None) -> str:
    return "—" if v is None else f"{v / 1e6:,.1f}"


def memory_table(report: dict[str, Any], title: str = "memory per station (MB)") -> Table:
    """One row per station and the sum: RSS, the baseline it started from, the weights
    resident (copied + mapped) and held, and the rings."""
    table = Table(title=title)
    for col in ("station", "layers", "RSS", "baseline", "weights", "copied", "mapped", "held"):
        table.add_column(col, justify="right")
    table.add_column("rings", justify="right")
    for i, s in enumerate(report["stations"]):
        table.add_row(
            str(i),
            f"{s['layer_lo']}:{s['layer_hi']}",
            *(
                _mb(s.get(k))
                for k in (
                    "rss",
                    "baseline",
                    "weights_resident",
                    "weights_copied",
                    "weights_mapped",
                    "weights_held",
                    "rings",
                )
            ),
        )
    t = report["sum"]
    table.add_row(
        "Σ",
        f"{t['stations']} stations",
        *(
            _mb(t.get(k))
            for k in (
                "rss",
                "baseline",
                "weights_resident",
                "weights_copied",
                "weights_mapped",
                "weights_held",
                "rings",
            )
        ),
        style="bold",
    )
    if report.get("file_bytes"):
        f = report["file_bytes"]
        resident = t.get("weights_resident")
        ratio = "" if resident is None else f" · weights resident / file = {resident / f:.3f}"
        table.caption = f"model file {_mb(f)} MB{ratio}"
    return table

