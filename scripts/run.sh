#!/usr/bin/env bash
# The main job: set up on first use, then run the falsifiability bench (the volume cache's
# predictions P1–P5 and triggers F1–F5) on the bundled model over a local mesh of 4
# stations, writing bench-out/bench.json (every raw timing and verdict),
# bench-out/bench.png and bench-out/report.md. Extra arguments go to `amplituhedron bench`
# (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
source "${AMPLITUHEDRON_VENV:-.venv}/bin/activate"
mkdir -p bench-out
exec python -m amplituhedron_rs.cli bench \
    --json bench-out/bench.json \
    --plot bench-out/bench.png \
    --report bench-out/report.md \
    "$@"
