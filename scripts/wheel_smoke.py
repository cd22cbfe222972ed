"""Smoke test of an installed wheel, run by scripts/wheel_smoke.sh from outside the checkout:
the package imports from the virtualenv, loads the bundled model, generates (the second time
from the cache), passes every Lean oracle from the modules built into it, and runs a tiny
`amplituhedron bench` whose F5 does not fire."""

import json
import subprocess
import sys
from pathlib import Path

venv = Path(sys.argv[1]).resolve()

import amplituhedron_rs as ar  # noqa: E402

where = Path(ar.__file__).resolve()
assert venv in where.parents, f"imported from {where}, not from the wheel in {venv}"
print(f"amplituhedron_rs {ar.__version__} from {where.parent}")

m = ar.load_model()
ids = m.chat_ids("You are terse.", "Name a planet.")
cold = m.generate(ids, 8)
warm = m.generate(ids, 8)
assert cold.output_ids and warm.output_ids == cold.output_ids, (cold, warm)
assert warm.cache_hit and not cold.cache_hit
print(f"generated {cold.text!r}; the second run replayed the cache")

results = ar.oracle.parity()
failed = [f"{r.name}: {r.detail}" for r in results if not r.ok]
assert results and not failed, failed
print(f"Lean oracle parity: all {len(results)} oracles pass")

report_path = Path("bench.json").resolve()
tiny = ["--stations", "2", "--sessions", "2", "--prompt-tokens", "24", "--max-tokens", "2"]
trace = ["--trace-prefixes", "5", "--trace-entries", "2", "--trace-accesses", "30"]
subprocess.run(
    [
        str(venv / "bin" / "amplituhedron"),
        "bench",
        *tiny,
        *trace,
        "--trace-seeds",
        "1",
        "--json",
        str(report_path),
    ],
    check=True,
    timeout=900,
)
report = json.loads(report_path.read_text())
assert report["oracles"]["total"] == len(results) and not report["f5"]["fired"], report["f5"]
print(f"bench: F5 not fired ({report['f5']['evidence']})")
print("wheel smoke test passed")
