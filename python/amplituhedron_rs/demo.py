"""The README's main command (placeholder until the runtime lands)."""

from __future__ import annotations

import amplituhedron_rs


def main() -> int:
    print(f"amplituhedron-rs {amplituhedron_rs.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
