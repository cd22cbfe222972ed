"""Every Python example of the README runs as written, in order, in one namespace (later
blocks use the model and ids of the first), against the real model and a real local mesh."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)

pytestmark = [pytest.mark.model, pytest.mark.mesh]


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 4
    assert BLOCKS[0].startswith("import amplituhedron_rs as ar\n\nm = ar.load_model()")


def test_every_readme_python_block_runs_as_written() -> None:
    namespace: dict[str, object] = {"__name__": "readme"}
    for number, block in enumerate(BLOCKS, start=1):
        code = compile(block, f"README.md python block {number}", "exec")
        exec(code, namespace)
