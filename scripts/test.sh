#!/usr/bin/env bash
# Every test and check the project has: Rust (test, clippy, fmt; clippy --all-targets
# compiles the benches too), the extension build, pytest, ruff, mypy, and the stub check
# against the built module. Each step prints the seconds it took: CI must stay under 30
# minutes on a 2-core machine; pytest lists its 15 slowest tests for the same reason.
set -euo pipefail
cd "$(dirname "$0")/.."

started=$SECONDS
last=
step() {
    [ -z "$last" ] || printf '    (%ds)\n' "$((SECONDS - last))"
    printf '\n==> %s\n' "$*"
    last=$SECONDS
}

step "set-up (virtualenv, dependencies, release extension)"
./scripts/bootstrap.sh
source "${AMPLITUHEDRON_VENV:-.venv}/bin/activate"

step "cargo fmt --check";           cargo fmt --all -- --check
step "cargo clippy (core)";         cargo clippy --all-targets -- -D warnings
step "cargo clippy (bindings)";     cargo clippy --features python -- -D warnings
step "cargo test";                  cargo test --quiet
step "ruff";                        ruff check python tests scripts && ruff format --check python tests scripts
step "mypy";                        mypy
step "stubtest (_core.pyi vs the built module)"
python -m mypy.stubtest amplituhedron_rs._core --allowlist scripts/stubtest-allowlist.txt
step "pytest";                      pytest -q --durations=15 "$@"
printf '    (%ds)\n\nall checks passed in %ds\n' "$((SECONDS - last))" "$((SECONDS - started))"
