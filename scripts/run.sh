#!/usr/bin/env bash
# The main job: set up on first use, then run the product on the bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
source "${AMPLITUHEDRON_VENV:-.venv}/bin/activate"
exec python -m amplituhedron_rs.demo "$@"
