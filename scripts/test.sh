#!/usr/bin/env bash
# Every test and check the project has: Rust (test, clippy, fmt, bench build),
# the extension build, pytest, ruff, mypy, and the stub check against the built module.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
source "${AMPLITUHEDRON_VENV:-.venv}/bin/activate"

step() { printf '\n==> %s\n' "$*"; }

step "cargo fmt --check";           cargo fmt --all -- --check
step "cargo clippy (core)";         cargo clippy --all-targets -- -D warnings
step "cargo clippy (bindings)";     cargo clippy --features python -- -D warnings
step "cargo test";                  cargo test --quiet
step "cargo bench --no-run";        cargo bench --no-run --quiet
step "ruff";                        ruff check python tests scripts && ruff format --check python tests scripts
step "mypy";                        mypy
step "stubtest (_core.pyi vs the built module)"
python -m mypy.stubtest amplituhedron_rs._core --allowlist scripts/stubtest-allowlist.txt
step "pytest";                      pytest -q "$@"
printf '\nall checks passed\n'
