"""The machine a figure was measured on: CPU model, L3 size and core count, printed with
every bench's figures (machines here differ from session to session)."""

from __future__ import annotations

import os
import subprocess


def describe_host() -> str:
    """E.g. ``AMD EPYC 9B14, L3 32 MiB (1 instance), 2 CPUs``."""
    model, l3 = "unknown CPU", "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("L3 cache:"):
            l3 = line.split(":", 1)[1].strip()
    return f"{model}, L3 {l3}, {os.cpu_count()} CPUs"
