"""What a mesh holds in memory, station by station and summed, beside the model file's size:
the table ``mesh up``, ``bench`` and ``bench-mesh`` print (fields: :mod:`..mesh.station.memory`),
and ``bench-mesh --memory-only``: each mesh size after a short run (so its rings exist and the
pages its forward passes read are in), then one process holding the whole model, against the
targets of SPEC §15 (weights resident ≤ 1.1 × the file; RSS ≤ file + rings + K × baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from rich.table import Table

from amplituhedron_rs._core import ModelError
from amplituhedron_rs.mesh.launcher import LocalMesh, MeshSpec, station_memory
from amplituhedron_rs.mesh.station.memory import SUMMED, mesh_memory, process_rss
from amplituhedron_rs.runtime.gguf_file import resolve_model_path

#: The short run before a mesh is measured: a prompt of this many tokens, then this many.
RUN_PROMPT, RUN_TOKENS = 8, 4


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
            *(_mb(s.get(k)) for k in SUMMED),
        )
    t = report["sum"]
    table.add_row(
        "Σ",
        f"{t['stations']} stations",
        *(_mb(t.get(k)) for k in SUMMED),
        style="bold",
    )
    if report.get("file_bytes"):
        f = report["file_bytes"]
        resident = t.get("weights_resident")
        ratio = "" if resident is None else f" · weights resident / file = {resident / f:.3f}"
        table.caption = f"model file {_mb(f)} MB{ratio}"
    return table


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """SPEC §15's two bounds for a measured mesh (None where a figure is missing)."""
    t, f = report["sum"], report["file_bytes"]
    if f is None or t["rss"] is None or t["baseline"] is None:
        return {"weights_over_file": None, "rss_bound": None, "rss_within_bound": None}
    bound = f + t["rings"] + t["baseline"]
    return {
        "weights_over_file": t["weights_resident"] / f,
        "weights_within_1_1": t["weights_resident"] <= 1.1 * f,
        "rss_bound": bound,
        "rss_within_bound": t["rss"] <= bound,
    }


def _mesh_after_a_run(k: int, model: str | None) -> dict[str, Any]:
    from amplituhedron_rs.mesh.coordinator import Coordinator

    with LocalMesh(k, model_path=model, startup_timeout=1800) as spec:

        async def go() -> None:
            async with Coordinator(spec) as c:
                await c.generate(list(range(1, RUN_PROMPT + 1)), RUN_TOKENS, use_cache=False)

        asyncio.run(go())
        report = measure_memory(spec, model)
    report["targets"] = targets(report)
    return report


def _one_process(model: str | None) -> dict[str, Any]:
    from amplituhedron_rs.runtime import load_model

    before = process_rss()
    m = load_model(model)
    m.generate(list(range(1, RUN_PROMPT + 1)), RUN_TOKENS, use_cache=False, stop_at_eos=False)
    return {
        "baseline": before,
        "rss": process_rss(),
        "weights": dict(m.weights.memory()),
        "file_bytes": resolve_model_path(model).stat().st_size,
    }


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from amplituhedron_rs.bench.host import describe_host
    from amplituhedron_rs.bench.report import write_json

    err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    host = describe_host()
    err.print(f"[dim]{host}[/dim]")
    out: dict[str, Any] = {"host": host, "model": args.model, "meshes": {}}
    for k in args.station_counts:
        with err.status(f"{k} stations…"):
            r = _mesh_after_a_run(k, args.model)
        out["meshes"][str(k)] = r
        err.print(memory_table(r, f"{k} stations: memory per station (MB)"))
        err.print(r["targets"])
    with err.status("one process…"):
        one = _one_process(args.model)
    out["one_process"] = one
    err.print(
        f"one process: RSS {_mb(one['rss'])} MB (baseline {_mb(one['baseline'])} MB), weights "
        f"resident {_mb(one['weights']['resident'])} MB of a {_mb(one['file_bytes'])} MB file"
    )
    write_json(args.json, out)
    return 0
